"""The emulated IPU: fixed memory, compile-once programs, counted host streams, replicas.

Pipeline position: the worker owns the host buffers (flat parameters and gradients); the IPU
*compiles* a program for a batch size — planning every byte it needs against its fixed memory
and failing early with :class:`IPUCompileError` if it does not fit — and then runs it every
step. With ``variables_on_host`` (default, as the seeds run) the weights are streamed in at the
start of each step and the optimizer state never touches the device; otherwise weights and
optimizer state are resident and count against device memory.

Backward streams each layer's gradient to the host the moment it is ready (last layer first)
through the ``on_grad(start, stop)`` callback, so the host can reduce it while the device
carries on. With ``replicas`` > 1 the per-worker batch is split across that many emulated IPUs
(each with its own memory and workspace); they run backward in lock step, layer by layer, and
their gradients are averaged into the host buffer before the callback fires — the result is the
gradient of the whole per-worker batch, because each replica's loss is a mean over its slice.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

from trainer.errors import InvalidSpec, IPUCompileError
from trainer.model import ModelSpec, Program

MB = 1 << 20


@dataclass(frozen=True)
class IPUConfig:
    memory_bytes: int = 900 * MB
    variables_on_host: bool = True
    replicas: int = 1
    #: bytes of optimizer state the program must hold when variables are *not* on the host
    optimizer_state_bytes: int = 0


@dataclass(frozen=True)
class MemoryPlan:
    """What one IPU holds while running a program, in bytes."""

    weights: int
    gradients: int
    activations: int
    workspace: int
    data: int
    optimizer_state: int
    capacity: int

    @property
    def total(self) -> int:
        return (self.weights + self.gradients + self.activations + self.workspace + self.data
                + self.optimizer_state)

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:,}" for k, v in asdict(self).items() if k != "capacity")
        return f"{self.total:,} bytes needed ({parts}), {self.capacity:,} available"


@dataclass
class IPUStats:
    """Cumulative counters, read by the metrics exporter."""

    compiles: int = 0
    recompiles: int = 0
    weights_in_bytes: int = 0
    grads_out_bytes: int = 0
    data_in_bytes: int = 0
    compute_s: float = 0.0
    flops: int = 0
    steps: int = 0


@dataclass
class Executable:
    """A compiled program: one :class:`Program` per replica plus its memory plan."""

    batch: int
    train: bool
    plan: MemoryPlan
    programs: list[Program]
    grads: list[list[dict[str, np.ndarray]]] = field(default_factory=list)
    flops_per_run: int = 0


class IPU:
    """One worker's emulated IPU(s), bound to the host's flat parameter and gradient buffers."""

    def __init__(self, spec: ModelSpec, config: IPUConfig, host_params: np.ndarray,
                 host_grads: np.ndarray):
        if config.replicas < 1:
            raise InvalidSpec(f"--ipus-per-worker must be at least 1, got {config.replicas}")
        if host_params.shape != (spec.num_params,) or host_grads.shape != host_params.shape:
            raise InvalidSpec(f"host buffers must have shape ({spec.num_params},)")
        self.spec, self.config = spec, config
        self.host_params, self.host_grads = host_params, host_grads
        self.dtype = host_params.dtype
        # Device-side weights: a separate copy streamed in each step, or the host buffer itself
        # when resident (the optimizer then updates it "on device").
        self.weights = np.zeros_like(host_params) if config.variables_on_host else host_params
        self.weight_views = spec.views(self.weights)
        self.stats = IPUStats()
        self._cache: dict[tuple[int, bool], Executable] = {}
        self._current: tuple[int, bool] | None = None
        self._replica_grads = [np.zeros_like(host_grads) for _ in range(config.replicas - 1)]

    def plan(self, batch: int, train: bool) -> MemoryPlan:
        """The memory one IPU needs for ``batch`` examples *per replica*."""
        item = self.dtype.itemsize
        b = Program.buffer_bytes(self.spec, batch, train, item)
        params = self.spec.num_params * item
        return MemoryPlan(
            weights=params,
            gradients=params if train else 0,
            activations=b["activations"],
            workspace=b["workspace"],
            data=b["data"],
            optimizer_state=0 if self.config.variables_on_host or not train
            else self.config.optimizer_state_bytes,
            capacity=self.config.memory_bytes,
        )

    def compile(self, batch: int, train: bool = True) -> Executable:
        """Plan and allocate a program for a per-worker ``batch``; cached, recompiles counted."""
        key = (batch, train)
        exe = self._cache.get(key)
        if exe is not None:
            return exe
        r = self.config.replicas if train else 1
        if batch % r:
            raise InvalidSpec(
                f"--batch-size {batch} does not divide evenly across --ipus-per-worker {r}"
            )
        per = batch // r
        plan = self.plan(per, train)
        if plan.total > plan.capacity:
            raise IPUCompileError(
                f"model {self.spec.name!r} with batch {per} per IPU does not fit the IPU: "
                f"{plan.describe()} (raise --ipu-memory-mb or lower --batch-size)"
            )
        programs = [Program(self.spec, per, train, self.dtype) for _ in range(r)]
        grads = []
        if train:
            grads = [self.spec.views(self.host_grads)]
            grads += [self.spec.views(g) for g in self._replica_grads]
        exe = Executable(batch, train, plan, programs, grads,
                         self.spec.flops_per_example(train) * batch)
        if self.stats.compiles:
            self.stats.recompiles += 1
        self.stats.compiles += 1
        self._cache[key] = exe
        return exe

    def _load(self, exe: Executable, images: np.ndarray) -> None:
        per = exe.programs[0].batch
        for i, p in enumerate(exe.programs):
            np.copyto(p.x, images[i * per:(i + 1) * per].reshape(p.x.shape))
        self.stats.data_in_bytes += images.nbytes

    def _stream_weights(self) -> None:
        if self.config.variables_on_host:
            np.copyto(self.weights, self.host_params)
            self.stats.weights_in_bytes += self.weights.nbytes

    def train_step(self, exe: Executable, images: np.ndarray, labels: np.ndarray,
                   on_grad: Callable[[int, int], None] | None = None) -> float:
        """Forward + backward on one per-worker batch; returns the mean loss.

        Gradients land in the host gradient buffer; ``on_grad(start, stop)`` fires per layer.
        """
        t0 = time.perf_counter()
        self._stream_weights()
        self._load(exe, images)
        per = exe.programs[0].batch
        loss = 0.0
        for i, p in enumerate(exe.programs):
            np.copyto(p.labels, labels[i * per:(i + 1) * per])
            self.stats.data_in_bytes += p.labels.nbytes
            loss += p.loss_and_dlogits(p.forward(self.weight_views))
        r = len(exe.programs)
        walkers = [p.backward_layers(self.weight_views, g) for p, g in zip(exe.programs, exe.grads)]
        ranges = self.spec.layer_ranges
        for layer in walkers[0]:
            for w in walkers[1:]:
                next(w)
            start, stop = ranges[layer]
            if r > 1:
                out = self.host_grads[start:stop]
                for g in self._replica_grads:
                    np.add(out, g[start:stop], out=out)
                np.multiply(out, self.dtype.type(1.0 / r), out=out)
            self.stats.grads_out_bytes += (stop - start) * self.dtype.itemsize
            if on_grad is not None:
                on_grad(start, stop)
        self.stats.compute_s += time.perf_counter() - t0
        self.stats.flops += exe.flops_per_run
        self.stats.steps += 1
        return loss / r

    def predict(self, exe: Executable, images: np.ndarray) -> np.ndarray:
        """Logits of one batch (a view into the program's buffer, valid until the next call)."""
        t0 = time.perf_counter()
        self._stream_weights()
        self._load(exe, images)
        out = exe.programs[0].forward(self.weight_views)
        self.stats.compute_s += time.perf_counter() - t0
        self.stats.flops += exe.flops_per_run
        return out

    def evaluate(self, images_u8: np.ndarray, labels: np.ndarray, batch: int = 500) -> float:
        """Accuracy over a whole split, batch by batch (the last batch padded)."""
        exe = self.compile(batch, train=False)
        x = np.zeros((batch,) + self.spec.input_shape, self.dtype)
        correct = 0
        for s in range(0, len(labels), batch):
            n = min(batch, len(labels) - s)
            np.multiply(images_u8[s:s + n].reshape((n,) + self.spec.input_shape),
                        self.dtype.type(1.0 / 255.0), out=x[:n])
            logits = self.predict(exe, x)
            correct += int(np.count_nonzero(np.argmax(logits[:n], axis=1) == labels[s:s + n]))
        return correct / max(1, len(labels))
