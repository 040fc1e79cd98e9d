"""The emulated IPU: fixed memory, compile-once programs, counted host streams, replicas.

Pipeline position: the worker owns the host buffers (flat parameters and gradients); the IPU
*compiles* a program for a batch size — planning every byte it needs against its fixed memory
and failing early with :class:`IPUCompileError` if it does not fit — and then runs it every
step. With ``variables_on_host`` (default, as the seeds run) the weights are streamed in at the
start of each step and the optimizer state never touches the device; otherwise weights and
optimizer state are resident and count against device memory.

Backward streams each gradient piece to the host the moment it is ready (last layer first, a
large kernel in row blocks, see ``ModelSpec.grad_pieces``) through the ``on_grad(start, stop)``
callback, so the host can reduce it while the device carries on. With ``replicas`` > 1 the
per-worker batch is split across that many emulated IPUs (each with its own memory and
workspace); they run backward in lock step, piece by piece, and their gradients are averaged
into the host buffer before the callback fires — the result is the
gradient of the whole per-worker batch, because each replica's loss is a mean over its slice.

A real IPU computes on ~1,500 tiles in parallel; the emulator stands in for them with
``host_threads`` host threads: each IPU's batch is cut into that many equal *shards*, each with
its own workspace, run concurrently (numpy releases the GIL) and reduced like replicas. BLAS then
runs single-threaded inside each shard (see :func:`blas_limits`): on a small shared machine,
OpenBLAS threads that spin while another process holds a core are far slower than two
independent shards, and shards also parallelise the element-wise work BLAS never touches.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator

import numpy as np

from ringtrain.errors import InvalidSpec, IPUCompileError
from ringtrain_trainer import trace
from ringtrain_trainer.engine import native, recompute, workspace
from ringtrain_trainer.engine.model import ModelSpec, Program
from ringtrain_trainer.engine.precision import Precision
from ringtrain_trainer.engine.program import tensor_shapes
from ringtrain_trainer.ipu.accumulate import Accumulator, accumulator_bytes, with_accumulator
from ringtrain_trainer.ipu.config import (  # noqa: F401 (re-exported: callers import them from here)
    EVAL_BATCH,
    MB,
    MIN_SHARD_FLOPS,
    IPUConfig,
    IPUStats,
    blas_limits,
    resolve_host_threads,
)
from ringtrain_trainer.ipu.executable import Executable, add_output_losses
from ringtrain_trainer.ipu.fit import fit
from ringtrain_trainer.ipu.memory import MemoryPlan, plan_memory
from ringtrain_trainer.ipu.shards import ShardGroups, threads_for


class IPU:
    """One worker's emulated IPU(s), bound to the host's flat parameter and gradient buffers."""

    def __init__(
        self,
        spec: ModelSpec,
        config: IPUConfig,
        host_params: np.ndarray,
        host_grads: np.ndarray,
        tracer: trace.Tracer = trace.OFF,
    ):
        if config.replicas < 1:
            raise InvalidSpec(f"--ipus-per-worker must be at least 1, got {config.replicas}")
        if host_params.shape != (spec.num_params,) or host_grads.shape != host_params.shape:
            raise InvalidSpec(f"host buffers must have shape ({spec.num_params},)")
        self.spec, self.config, self.tracer = spec, config, tracer
        layers = [f"L{i} {type(layer).__name__.lower()}" for i, layer in enumerate(spec.layers)]
        self._trace_names = ([f"forward {n}" for n in layers], [f"backward {n}" for n in layers])
        self.host_params, self.host_grads = host_params, host_grads
        self.dtype = host_params.dtype
        # Device-side weights: a separate copy streamed in each step, or the host buffer itself
        # when resident (the optimizer then updates it "on device").
        self.weights = np.zeros_like(host_params) if config.variables_on_host else host_params
        self.weight_views = spec.views(self.weights)
        #: the worker's non-trainable state (BatchNormalization's moving statistics): the
        #: mean of its training programs' copies after every step (``layers``)
        self.state = spec.init_state(self.dtype)
        self.stats = IPUStats()
        self.output_losses: np.ndarray | None = None
        self.eval_sums: np.ndarray | None = None
        self._cache: dict[tuple[int, bool], Executable] = {}
        self._shard_grads: list[np.ndarray] = []  # gradients of shards 1.. (shard 0: host's)
        self.host_threads = resolve_host_threads(config.host_threads)
        self.groups = ShardGroups(self.host_threads)
        self.accumulator = Accumulator(config.accumulation, spec.num_params, self.dtype)
        self.precision = Precision(config.precision, config.stochastic_rounding)
        if self.precision.half and not config.variables_on_host:
            raise InvalidSpec(
                "--precision fp16 keeps float32 master weights and optimizer state on the host: "
                "it needs variables on the host (drop --no-variables-on-host)"
            )
        frozen: int = spec.num_frozen
        if self.precision.half and frozen:
            raise InvalidSpec(
                f"--precision fp16 (or a mixed_float16 model) with {frozen:,} frozen "
                "parameters (trainable=False) is not supported: frozen weights are held as "
                "float32 state and would not be rounded to float16 as trained weights are "
                "(supported: fp32 with frozen layers)"
            )
        try:
            self.chunks = workspace.cap_workspaces(
                spec,
                config.available_memory_proportion,
                config.memory_bytes,
                self.precision.itemsize,
            )
        except workspace.WorkspaceError as e:
            raise IPUCompileError(f"model {spec.name!r}: {e}") from None
        n, seed, rank = spec.num_params, config.seed, config.rank
        self._round_weights = self.precision.weight_rounder(n, seed, rank)
        self._round_grads = self.precision.program_rounder(n, seed, rank, 0)

    def plan(self, batch: int, train: bool) -> MemoryPlan:
        """The memory one IPU needs for ``batch`` examples *per replica* (:mod:`.memory`)."""
        state = 0 if self.config.variables_on_host else self.config.optimizer_state_bytes
        size = self.precision.itemsize
        plan = plan_memory(self.spec, batch, train, size, self.config.memory_bytes, state)
        k = self.config.accumulation if train else 1
        return with_accumulator(plan, accumulator_bytes(k, self.spec.num_params, size))

    def load_state(self, state: np.ndarray) -> None:
        """Set the model's non-trainable state (a checkpoint's, the chief's) everywhere."""
        np.copyto(self.state, state)
        for exe in self._cache.values():
            for p in exe.programs:
                np.copyto(p.state, self.state)

    def compile(self, batch: int, train: bool = True) -> Executable:
        """Plan and allocate a program for a per-worker ``batch``; cached. A training (or
        evaluation) program compiled for a second batch size counts as a recompile."""
        key = (batch, train)
        exe = self._cache.get(key)
        if exe is not None:
            return exe
        r = self.config.replicas if train else 1
        if batch % r:
            raise InvalidSpec(
                f"--batch-size {batch} does not divide evenly across --ipus-per-worker {r}"
            )
        per_ipu = batch // r
        baseline = self.plan(per_ipu, train)
        plan, cuts = fit(self.spec, self.config, baseline, per_ipu, train, self.dtype.itemsize)
        t = threads_for(
            self.spec.flops_per_example(train) * per_ipu,
            per_ipu,
            self.host_threads,
            self.config.min_shard_flops,
            coupled=any(layer.batch_coupled for layer in self.spec.layers),
        )
        shards = r * t
        # weights streamed in: the host optimizer never touches what backward reads, so each
        # layer's weight gradients may stream out before its input gradient is computed
        early = self.config.variables_on_host
        make = (
            functools.partial(recompute.RecomputeProgram, cut_positions=cuts) if cuts else Program
        )
        programs = [
            make(
                self.spec,
                batch // shards,
                train,
                self.dtype,
                grads_first=early,
                state=self.state.copy() if train else self.state,
            )
            for _ in range(shards)
        ]
        cap = programs[0].batch * max(math.prod(s) for s in tensor_shapes(self.spec).values())
        for i, p in enumerate(programs):
            p.ctx.update(seed=self.config.seed, example0=self.config.rank * batch + i * p.batch)
            p.rounder = self.precision.program_rounder(
                max(cap, p.dlogits.size), self.config.seed, self.config.rank, i + 1
            )
        grads = []
        if train:
            while len(self._shard_grads) < shards - 1:
                self._shard_grads.append(np.zeros_like(self.host_grads))
            grads = [
                self.spec.views(g) for g in [self.host_grads, *self._shard_grads[: shards - 1]]
            ]
        groups = [list(range(j, shards, t)) for j in range(t)]
        exe = Executable(
            batch,
            train,
            plan,
            programs,
            grads,
            groups,
            self.spec.flops_per_example(train) * batch,
            np.zeros(shards),
            baseline if cuts else None,
        )
        if any(t == train for _, t in self._cache):  # same kind of program, new shape
            self.stats.recompiles += 1
        self.stats.compiles += 1
        self._cache[key] = exe
        return exe

    def _load(self, exe: Executable, images: np.ndarray, labels: np.ndarray | None) -> None:
        t, per = self.tracer.now(), exe.programs[0].batch
        for i, p in enumerate(exe.programs):
            np.copyto(p.x, images[i * per : (i + 1) * per].reshape(p.x.shape))
            if labels is not None:
                np.copyto(p.labels, labels[i * per : (i + 1) * per])
            if p.rounder is not None:
                p.rounder(p.x)
        self.stats.data_in_bytes += images.nbytes + (0 if labels is None else labels.nbytes)
        self.tracer.add(trace.DATA, "data to IPU", t, value=images.nbytes)

    def _stream_weights(self) -> None:
        if self.config.variables_on_host:
            t = self.tracer.now()
            np.copyto(self.weights, self.host_params)
            if self._round_weights is not None:  # the float16 copy of the fp32 masters
                self._round_weights(self.weights)
            self.stats.weights_in_bytes += self.weights.nbytes
            self.tracer.add(trace.WEIGHTS, "weights in", t, value=self.weights.nbytes)

    def _run_group(self, exe: Executable, group: list[int]) -> Iterator[int]:
        """One host thread's work: forward (+ loss) of its shards, then backward piece by
        piece, yielding each gradient piece once all its shards have written it. The tracer
        times the layers on the lanes of this group's tile (its first shard's backward)."""
        tile = 2 * exe.groups.index(group) if self.tracer.on else 0
        for i in group:
            p = exe.programs[i]
            lap = self.tracer.laps(trace.FORWARD + tile, self._trace_names[0])
            if exe.train:
                exe.losses[i] = p.train_forward(self.weight_views, lap, self.precision.loss_scale)
            else:
                p.forward(self.weight_views, lap)
        if not exe.train:
            return
        lap = self.tracer.laps(trace.BACKWARD + tile, self._trace_names[1])
        walkers = [
            exe.programs[i].backward_pieces(
                self.weight_views, exe.grads[i], lap if i == group[0] else None
            )
            for i in group
        ]
        for piece in walkers[0]:
            for w in walkers[1:]:
                next(w)
            yield piece

    def _launch(self, exe: Executable) -> list[Iterator[int]]:
        """Every shard group of ``exe`` started (``shard_groups``), the first on this thread."""
        return self.groups.launch(exe.groups, functools.partial(self._run_group, exe))

    def _mean_of_shards(self, start: int, stop: int, n: int) -> None:
        """The host gradient piece as the mean of the ``n`` shards' (shard 0's buffer is the
        host's): sums in shard order, then one multiply; the last add and the multiply in one
        compiled pass where float32 (the same operations, the same bits)."""
        out, scale = self.host_grads[start:stop], self.dtype.type(1.0 / n)
        others = [g[start:stop] for g in self._shard_grads[: n - 1]]
        for g in others[:-1]:
            np.add(out, g, out=out)
        if native.kernels is not None and out.dtype == np.float32:
            native.kernels.add_scale(out, others[-1], scale)
        else:
            np.add(out, others[-1], out=out)
            np.multiply(out, scale, out=out)

    def train_step(
        self,
        exe: Executable,
        images: np.ndarray,
        labels: np.ndarray,
        on_grad: Callable[[int, int], None] | None = None,
        step: int | None = None,
        micro: int = 0,
    ) -> float:
        """Forward + backward on one per-worker batch; returns the mean loss.

        Gradients land in the host gradient buffer; ``on_grad(start, stop)`` fires per piece
        of ``spec.grad_pieces`` (last layer first; large kernels in row blocks) while the rest
        of backward is still being computed. With gradient accumulation (``accumulation`` K)
        this is micro-batch ``micro`` of K: only the last one streams its pieces, each the
        mean over the K micro-batches (:mod:`.accumulate`).
        """
        t0 = time.perf_counter()
        self._stream_weights()
        self._load(exe, images, labels)
        # the examples of micro-batch ``micro`` sit where they sit in the step's batch of K
        # micro-batches, so Dropout's per-example masks are the big batch's (``accumulate``)
        first = (self.config.rank * self.config.accumulation + micro) * exe.batch
        for i, p in enumerate(exe.programs):
            p.ctx["step"] = self.stats.steps if step is None else step
            p.ctx["example0"] = first + i * p.batch
        runs = self._launch(exe)
        n = len(exe.programs)
        try:
            for k, piece in enumerate(self.spec.grad_pieces):
                for run in runs:
                    if next(run) != piece:
                        raise RuntimeError(f"a shard group skipped gradient piece {piece}")
                start, stop = piece
                t = self.tracer.now()
                if n > 1:
                    self._mean_of_shards(start, stop, n)
                if self._round_grads is not None:  # streamed out as float16
                    self._round_grads(self.host_grads[start:stop])
                if not self.accumulator.fold(self.host_grads, start, stop, micro):
                    continue
                self.stats.grads_out_bytes += (stop - start) * self.dtype.itemsize
                if on_grad is not None:
                    on_grad(start, stop)
                self.tracer.add(
                    trace.GRADS, "grad piece", t, k, (stop - start) * self.dtype.itemsize
                )
        finally:
            self.groups.finish(runs)
        for a, b in self.spec.live_state:  # frozen weights: the same everywhere, never averaged
            np.mean([p.state[a:b] for p in exe.programs], axis=0, out=self.state[a:b])
            for p in exe.programs:
                np.copyto(p.state[a:b], self.state[a:b])
        self.stats.compute_s += time.perf_counter() - t0
        self.stats.flops += exe.flops_per_run
        self.stats.steps += 1
        return float(exe.losses.sum()) / n

    def train_batch(
        self,
        exe: Executable,
        images: np.ndarray,
        labels: np.ndarray,
        on_grad: Callable[[int, int], None] | None = None,
        step: int | None = None,
    ) -> float:
        """One optimizer step's K·B examples (K = ``accumulation``, B = ``exe.batch``): the
        micro-batches one after another, the last streaming the mean; the mean loss. A
        pipeline (``pipeline_ipu``) takes the same K·B at once."""
        b, k = exe.batch, self.config.accumulation
        loss = 0.0
        parts = None
        for m in range(k):
            loss += self.train_step(
                exe,
                images[m * b : (m + 1) * b],
                labels[m * b : (m + 1) * b],
                on_grad if m == k - 1 else None,
                step=step,
                micro=m,
            )
            parts = add_output_losses(exe, parts)
        #: several outputs: the step's mean loss per trained output (``MultiLoss.parts``)
        self.output_losses = None if parts is None else parts / k
        return loss / k

    def evaluate(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        batch: int = EVAL_BATCH,
        scale: float = 1.0,
        metrics=None,
    ) -> float:
        """The loss's metric (``engine.losses.Loss.score``: accuracy, or MAE for regression)
        over a whole split, batch by batch (the last batch padded); the model sees
        ``images * scale`` (``data.Split``'s rule: pass the split's ``scale``). ``metrics``
        (an ``engine.keras_metrics.MetricSet``) is updated with the same outputs."""
        exe = self.compile(batch, train=False)
        x = np.zeros((batch, *self.spec.input_shape), self.dtype)
        per = exe.programs[0].batch
        score = 0.0
        trained = len(getattr(self.spec.loss, "trained", ()))
        sums = np.zeros(2 * trained) if trained else None
        factor = self.dtype.type(scale)
        for s in range(0, len(labels), batch):
            n = min(batch, len(labels) - s)
            np.multiply(images[s : s + n].reshape((n, *self.spec.input_shape)), factor, out=x[:n])
            t0 = time.perf_counter()
            self._stream_weights()
            self._load(exe, x, None)
            self.groups.finish(self._launch(exe))
            self.stats.compute_s += time.perf_counter() - t0
            self.stats.flops += exe.flops_per_run
            for i, p in enumerate(exe.programs):
                lo, hi = i * per, min(n, (i + 1) * per)
                if hi > lo:
                    score += p.loss.score(p.output[: hi - lo], labels[s + lo : s + hi])
                    if metrics is not None:
                        metrics.update(p.output[: hi - lo], labels[s + lo : s + hi])
                    if sums is not None:
                        z, y = p.output[: hi - lo], labels[s + lo : s + hi]
                        sums += [*p.loss.totals(z, y), *p.loss.scores(z, y)]
        #: several outputs: per trained output the summed loss, then the summed metric
        self.eval_sums = sums
        return score / max(1, len(labels))

    def close(self) -> None:
        self.groups.close()
