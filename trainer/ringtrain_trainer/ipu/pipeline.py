"""The worker's emulated IPUs as a pipeline: one stage per IPU, micro-batches through them.

Pipeline position: replaces :class:`~ringtrain_trainer.ipu.device.IPU` in the worker when
``--pipeline-stages`` is set (``engine.pipeline`` cuts the model and plans each stage's IPU).
Each stage has ``depth`` programs (one per micro-batch in flight) that allocate only its own
nodes' buffers. The depth is ``--gradient-accumulation-steps`` K (Graphcore's
``gradient_accumulation_count`` is the pipeline's depth), the micro-batch is ``--batch-size``
B, as without pipelining: a step takes K·B examples, micro-batch m at rows m·B..(m+1)·B. With the
Grouped schedule every stage runs on its own thread: it runs the forwards of all micro-batches,
handing each one's activation to the next stage over an emulated inter-IPU link (a copy into
the next IPU's receive buffer, counted in ``link_bytes``), then the backwards as the gradients
come back over the links. Stage s runs micro-batch m + 1 while stage s + 1 runs m, so stages
overlap in time. Sequential runs the same work one stage at a time on the calling thread.

Each stage's backward writes its micro-batch's gradients into its own contiguous slice of the
host gradient buffer (the layout follows the graph order) and folds them into
:mod:`.accumulate`'s accumulator, slice by slice, so the last micro-batch leaves the mean over
the K·B examples, exactly as unpipelined; the gradient pieces then go to the reducer once per
step. Float16 and loss scaling are not implemented in the stages: refused (:func:`refuse`).
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ringtrain import optionrules
from ringtrain.errors import InvalidSpec
from ringtrain_trainer import trace
from ringtrain_trainer.config import layer_names
from ringtrain_trainer.engine import pipeline
from ringtrain_trainer.engine.model import ModelSpec, Program
from ringtrain_trainer.ipu.accumulate import accumulator_bytes, with_accumulator
from ringtrain_trainer.ipu.device import IPU, IPUConfig
from ringtrain_trainer.ipu.executable import Executable
from ringtrain_trainer.ipu.memory import MemoryPlan, plan_memory

SCHEDULES = optionrules.SCHEDULES


def refuse(precision: str, stochastic_rounding: str, loss_scaling: str = "off") -> None:
    """Refuse, before anything runs, the numerics the stages do not implement."""
    if precision == "fp16":
        raise InvalidSpec(
            "--pipeline-stages with --precision fp16 (or a mixed_float16 model): not "
            "implemented together (the stages compute in float32)"
        )
    if stochastic_rounding != "OFF":
        raise InvalidSpec(
            f"--pipeline-stages with --stochastic-rounding {stochastic_rounding}: not "
            "implemented together"
        )
    if loss_scaling != "off":
        raise InvalidSpec(
            f"--pipeline-stages with --loss-scaling {loss_scaling}: not implemented together"
        )


class _Failed(Exception):
    """Another stage failed: this one stops waiting."""


class PipelinedIPU(IPU):
    """``config.replicas`` IPUs as the stages of one pipeline."""

    def __init__(
        self,
        spec: ModelSpec,
        config: IPUConfig,
        host_params: np.ndarray,
        host_grads: np.ndarray,
        tracer: trace.Tracer = trace.OFF,
        *,
        stages: str = "auto",
        schedule: str = "Grouped",
    ):
        if (why := optionrules.schedule_error(schedule, stages or "auto")) is not None:
            raise InvalidSpec(f"pipeline.schedule {why}")
        if config.recompute:
            raise InvalidSpec("allowRecompute with pipeline.stages: not implemented together")
        refuse(config.precision, config.stochastic_rounding)
        if len(spec.graph.inputs) > 1 or len(spec.graph.outputs) > 1:
            raise InvalidSpec(
                "pipeline.stages: a model with several inputs or outputs is not supported "
                "(supported: one input, one output)"
            )
        super().__init__(spec, config, host_params, host_grads, tracer)
        names = () if stages.strip() == "auto" else layer_names(stages)
        self.names, self.schedule, self.depth = names, schedule, config.accumulation
        self.n_stages = config.replicas
        self.stages: list[pipeline.Stage] = []
        self.stage_plans: list[MemoryPlan] = []
        self._stage_pool: ThreadPoolExecutor | None = None
        self._busy = [0.0] * self.n_stages
        self._links = [0] * self.n_stages

    def _split(self, micro: int, train: bool):
        state = 0 if self.config.variables_on_host else self.config.optimizer_state_bytes
        size = self.dtype.itemsize
        base = plan_memory(self.spec, micro, train, size, self.config.memory_bytes, state)
        depth = self.depth if train else 1
        stages = pipeline.split(self.spec, base, self.n_stages, depth, self.names)
        plans = [  # each stage's IPU sums its own layers' gradients (accumulate)
            with_accumulator(
                pipeline.stage_plan(self.spec, base, s, depth, size, micro, train),
                accumulator_bytes(depth, self.stage_params(s), size),
            )
            for s in stages
        ]
        pipeline.check_fits(self.spec, stages, plans, not self.names)
        return stages, plans

    def stage_params(self, st: pipeline.Stage) -> int:
        """Parameters of stage ``st``'s layers."""
        return sum(s.stop - s.start for s in self.spec.slots if s.spec.layer in st.nodes)

    def compile(self, batch: int, train: bool = True) -> Executable:
        """``batch``: the micro-batch B; a training step takes ``depth`` of them."""
        key = (batch, train)
        if key in self._cache:
            return self._cache[key]
        if not train:  # forward only: the stages in turn, on one host program
            _, plans = self._split(batch, False)
            prog = Program(self.spec, batch, False, self.dtype, state=self.state)
            exe = Executable(batch, False, max(plans, key=lambda p: p.total), [prog], [], [[0]])
            exe.stage_plans = plans
            self.stats.compiles += 1
            self._cache[key] = exe
            return exe
        micro = batch
        self.stages, self.stage_plans = self._split(micro, True)
        shapes = pipeline.tensor_shapes(self.spec)
        progs: list[list[Program]] = []
        for st in self.stages:
            nodes = frozenset(st.nodes)
            row = [
                Program(self.spec, micro, True, self.dtype, state=self.state, nodes=nodes)
                for _ in range(self.depth)
            ]
            for m, p in enumerate(row):
                # micro-batch m's examples where they sit in the worker's K·B (accumulate)
                first = (self.config.rank * self.depth + m) * micro
                p.ctx.update(seed=self.config.seed, example0=first)
                if st.receives is not None:  # the link's receive buffer on this IPU
                    p.tensors[st.receives] = np.zeros((micro, *shapes[st.receives]), self.dtype)
                if st.sends is not None:
                    p._grads[st.sends] = np.zeros((micro, *shapes[st.sends]), self.dtype)
            progs.append(row)
        self._progs = progs
        self._ranges = [
            (
                min(self.spec.layer_ranges[i][0] for i in st.nodes),
                max(self.spec.layer_ranges[i][1] for i in st.nodes),
            )
            for st in self.stages
        ]
        self._grad_views = self.spec.views(self.host_grads)
        exe = Executable(
            micro * self.depth,
            True,
            max(self.stage_plans, key=lambda p: p.total),
            [p for row in progs for p in row],
            [],
            [],
            self.spec.flops_per_example(True) * micro * self.depth,
            np.zeros(self.depth),
        )
        exe.stage_plans = self.stage_plans
        if any(t for _, t in self._cache):
            self.stats.recompiles += 1
        self.stats.compiles += 1
        self._cache[key] = exe
        return exe

    # -- one step ------------------------------------------------------------------------------

    def _get(self, q: queue.SimpleQueue[int | None]) -> int:
        item = q.get()
        if item is None:
            raise _Failed
        return item

    def _forward(self, s: int, exe: Executable, fwd: list[queue.SimpleQueue[int | None]]) -> None:
        st, last = self.stages[s], s == len(self.stages) - 1
        lane = trace.STAGE + s
        for m in range(self.depth):
            if s:
                self._get(fwd[s])
            p = self._progs[s][m]
            t, busy = self.tracer.now(), time.perf_counter()
            for i in st.nodes:
                p.forward_node(i, self.weight_views)
            if last:
                exe.losses[m] = p.loss_and_dlogits(p.output)
            self.tracer.add(lane, "forward micro-batch", t, m)
            if not last:
                t, sends = self.tracer.now(), st.sends
                assert sends is not None  # every stage but the last sends a tensor on
                dst = self._progs[s + 1][m].tensor(sends)
                np.copyto(dst, p.tensor(sends))
                self._links[s] += dst.nbytes  # one counter per thread
                self.tracer.add(lane, "link out", t, m, dst.nbytes)
            self._busy[s] += time.perf_counter() - busy
            if not last:
                fwd[s + 1].put(m)

    def _backward(self, s: int, bwd: list[queue.SimpleQueue[int | None]]) -> None:
        st, last = self.stages[s], s == len(self.stages) - 1
        lo, hi = self._ranges[s]
        views = self._grad_views
        lane = trace.STAGE + s
        order = [i for i in self.spec.graph.backward_order() if i in st.nodes]
        for m in range(self.depth):
            if not last:
                self._get(bwd[s])
            p = self._progs[s][m]
            t, busy = self.tracer.now(), time.perf_counter()
            if last:
                p._grads[self.spec.graph.outputs[0]] = p.dlogits
            for i in order:
                for _ in p.backward_node(i, self.weight_views, views):
                    pass
            self.accumulator.fold(self.host_grads, lo, hi, m)  # the stages' slices are disjoint
            self.tracer.add(lane, "backward micro-batch", t, m)
            if s:
                t, receives = self.tracer.now(), st.receives
                assert receives is not None  # every stage but the first receives a tensor
                src = p.tensor_grad(receives)
                dst = self._progs[s - 1][m].tensor_grad(receives)
                np.copyto(dst, src.reshape(dst.shape))
                self._links[s] += dst.nbytes  # one counter per thread
                self.tracer.add(lane, "link back", t, m, dst.nbytes)
            self._busy[s] += time.perf_counter() - busy
            if s:
                bwd[s - 1].put(m)

    def _stage(self, s: int, exe, fwd, bwd) -> None:
        try:
            self._forward(s, exe, fwd)
            self._backward(s, bwd)
        except BaseException:
            for q in (*fwd, *bwd):
                q.put(None)  # wake every stage waiting on a link
            raise

    def train_step(
        self,
        exe: Executable,
        images: np.ndarray,
        labels: np.ndarray,
        on_grad: Callable[[int, int], None] | None = None,
        step: int | None = None,
        micro: int = 0,
    ) -> float:
        """Forward + backward of ``depth`` micro-batches (``images``: K·B examples, as
        :meth:`train_batch` takes them) through the stages; the mean of their gradients goes
        to ``on_grad`` piece by piece once all stages finish. ``micro`` (``IPU.train_step``'s
        micro-batch of an accumulation) is not used: every micro-batch is in flight at once."""
        t0 = time.perf_counter()
        self._stream_weights()
        micro, first, last = exe.batch // self.depth, self._progs[0], self._progs[-1]
        if len(images) != exe.batch:
            raise ValueError(f"a pipelined step takes {exe.batch} examples, got {len(images)}")
        t = self.tracer.now()
        for m in range(self.depth):
            np.copyto(first[m].x, images[m * micro : (m + 1) * micro].reshape(first[m].x.shape))
            np.copyto(last[m].labels, labels[m * micro : (m + 1) * micro])
        self.stats.data_in_bytes += images.nbytes + labels.nbytes
        self.tracer.add(trace.DATA, "data to IPU", t, value=images.nbytes)
        for row in self._progs:
            for p in row:
                p.ctx["step"] = self.stats.steps if step is None else step
        n = len(self.stages)
        # per stage: the micro-batches handed to it (None: another stage failed)
        fwd: list[queue.SimpleQueue[int | None]] = [queue.SimpleQueue() for _ in range(n)]
        bwd: list[queue.SimpleQueue[int | None]] = [queue.SimpleQueue() for _ in range(n)]
        if self.schedule == "Sequential" or n == 1:
            for s in range(n):
                self._forward(s, exe, fwd)
            for s in reversed(range(n)):
                self._backward(s, bwd)
        else:
            if self._stage_pool is None:
                self._stage_pool = ThreadPoolExecutor(n, thread_name_prefix="ipu-stage")
            futures = [self._stage_pool.submit(self._stage, s, exe, fwd, bwd) for s in range(n)]
            errors = [f.exception() for f in futures]
            real = [e for e in errors if e is not None and not isinstance(e, _Failed)]
            if real:
                raise real[0]
        for k, (start, stop) in enumerate(self.spec.grad_pieces):
            t = self.tracer.now()
            self.stats.grads_out_bytes += (stop - start) * self.dtype.itemsize
            if on_grad is not None:
                on_grad(start, stop)
            self.tracer.add(trace.GRADS, "grad piece", t, k, (stop - start) * self.dtype.itemsize)
        self.stats.stage_busy_s = tuple(self._busy)
        self.stats.link_bytes = sum(self._links)
        self.stats.compute_s += time.perf_counter() - t0
        self.stats.flops += exe.flops_per_run
        self.stats.steps += 1
        return float(exe.losses.mean())

    train_batch = train_step  # all K micro-batches in flight at once

    def close(self) -> None:
        if self._stage_pool is not None:
            self._stage_pool.shutdown()
            self._stage_pool = None
        super().close()
