"""The trainer's Prometheus metrics (served by :mod:`.server`).

Pipeline position: the step loop calls :meth:`TrainerMetrics.observe_step` once per step and
:meth:`TrainerMetrics.observe_eval` after an evaluation; the ring reports each collective itself
to :class:`RingMetrics` (:meth:`TrainerMetrics.watch_ring`); Prometheus scrapes ``/metrics`` and the
operator reads ``/status`` (JSON) to show progress without giving pods API permissions.
Names follow Prometheus conventions (``ringtrain_`` prefix, base units, ``_total`` counters);
the registry is injectable so tests read values with ``get_sample_value``.
"""

from __future__ import annotations

import dataclasses
import threading

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from ringtrain import events
from ringtrain_trainer.ipu import memory
from ringtrain_trainer.ipu.device import IPUStats
from ringtrain_trainer.ipu.memory import KINDS, MemoryPlan
from ringtrain_trainer.reducer import StepCommStats
from ringtrain_trainer.ring.observer import ERROR_KINDS, RingObserver

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
#: One bucket's allreduce (kilobytes) up to a whole model's at 64 MiB on a slow link.
RING_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    10.0,
)


class RingMetrics(RingObserver):
    """The ring's own figures for one data path (``transport`` = grpc+tcp | grpc+shm | grpc),
    bound to their label children once the ring is connected and knows which path runs
    (``data_path``), so that a collective only adds numbers to existing series.
    The control plane's reports (peers still missing at start-up, stalls) go to the metrics
    and to ``/status``."""

    def __init__(self, metrics: TrainerMetrics, transport: str | None = None) -> None:
        self._metrics = metrics
        if transport is not None:
            self.data_path(transport)

    def data_path(self, transport: str) -> None:
        metrics = self._metrics
        self._stalls = metrics.ring_stalls.labels(transport=transport)
        self._sent = metrics.ring_bytes.labels(direction="sent", transport=transport)
        self._received = metrics.ring_bytes.labels(direction="received", transport=transport)
        self._seconds = metrics.ring_allreduce.labels(transport=transport)
        self._errors = {
            k: metrics.ring_errors.labels(kind=k, transport=transport) for k in ERROR_KINDS
        }

    def collective(self, kind: str, seconds: float, sent_bytes: int, received_bytes: int) -> None:
        self._sent.inc(sent_bytes)
        self._received.inc(received_bytes)
        if kind == "allreduce":
            self._seconds.observe(seconds)

    def error(self, kind: str) -> None:
        self._errors[kind].inc()

    def waiting(self, names: list[str]) -> None:
        m = self._metrics
        for name in set(m.waiting_names) | set(names):
            m.ring_peer_missing.labels(peer=name).set(1 if name in names else 0)
        m.waiting_names = list(names)
        m.update_status(waiting_for=list(names) or None)

    def stalled(self, report: dict | None) -> None:
        if report is not None:
            self._stalls.inc()
        self._metrics.update_status(stalled=report)


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.step_duration = Histogram(
            "ringtrain_step_duration_seconds",
            "Wall time of one training step",
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.steps = Counter("ringtrain_steps", "Optimizer steps completed", registry=r)
        self.samples_per_s = Gauge(
            "ringtrain_samples_per_second", "Training throughput of this worker", registry=r
        )
        self.loss = Gauge("ringtrain_loss", "Training loss of the last step", registry=r)
        self.test_accuracy = Gauge(
            "ringtrain_test_accuracy_ratio",
            "Accuracy on the test split at the last evaluation",
            registry=r,
        )
        self.test_loss = Gauge(
            "ringtrain_test_loss",
            "Loss on the test split at the evaluator's last evaluation",
            registry=r,
        )
        self.evaluations = Counter(
            "ringtrain_evaluations", "Checkpoints the evaluator evaluated", registry=r
        )
        self.evaluated_step = Gauge(
            "ringtrain_evaluated_step",
            "Training step of the checkpoint the evaluator evaluated last",
            registry=r,
        )
        stream = Counter(
            "ringtrain_ipu_stream_bytes",
            "Bytes streamed between host and IPU",
            ["direction"],
            registry=r,
        )
        self._stream = {
            d: stream.labels(direction=d) for d in ("weights_in", "grads_out", "data_in")
        }
        mem = Gauge(
            "ringtrain_ipu_memory_bytes",
            "IPU memory planned by the training "
            "program, per IPU, by kind (sum without kind: the total)",
            ["kind"],
            registry=r,
        )
        self._ipu_memory = {k: mem.labels(kind=k) for k in KINDS}
        self._host_state = Gauge(
            "ringtrain_host_memory_bytes",
            "Host memory the trainer holds "
            "beside the model, by kind (optimizer_state: on the host unless "
            "--no-variables-on-host)",
            ["kind"],
            registry=r,
        ).labels(kind="optimizer_state")
        self.ipu_stage_memory = Gauge(
            "ringtrain_ipu_stage_memory_bytes",
            "IPU memory planned for each pipeline stage, by its IPU, stage and kind",
            ["ipu", "stage", "kind"],
            registry=r,
        )
        self.ipu_link_bytes = Counter(
            "ringtrain_ipu_link_bytes",
            "Bytes over the inter-IPU links between pipeline stages",
            registry=r,
        )
        self.ipu_stage_busy = Counter(
            "ringtrain_ipu_stage_busy_seconds",
            "Seconds each pipeline stage's IPU spent computing, by its IPU and stage",
            ["ipu", "stage"],
            registry=r,
        )
        self.ipu_capacity = Gauge(
            "ringtrain_ipu_memory_capacity_bytes", "Emulated IPU memory size", registry=r
        )
        self.ipu_compute = Counter(
            "ringtrain_ipu_compute_seconds", "Seconds the IPU spent computing", registry=r
        )
        self.ipu_flops = Counter(
            "ringtrain_ipu_flops", "Floating point operations executed", registry=r
        )
        self.recompiles = Counter(
            "ringtrain_ipu_recompiles", "Program recompilations (shape changes)", registry=r
        )
        self.allreduce = Counter(
            "ringtrain_allreduce_seconds", "Seconds spent in gradient allreduce", registry=r
        )
        self.allreduce_hidden = Counter(
            "ringtrain_allreduce_hidden_seconds",
            "Allreduce seconds that ran while backward was still "
            "computing here and were not spent waiting for a peer",
            registry=r,
        )
        self.allreduce_peer_wait = Counter(
            "ringtrain_allreduce_peer_wait_seconds",
            "Allreduce seconds spent blocked on a peer (never counted as hidden)",
            registry=r,
        )
        self.overlap = Gauge(
            "ringtrain_allreduce_overlap_ratio",
            "Fraction of the last step's allreduce hidden behind backward "
            "(hidden seconds / allreduce seconds; peer waiting is exposed)",
            registry=r,
        )
        self.ring_bytes = Counter(
            "ringtrain_ring_bytes",
            "Bytes this worker's ring member sent to its right neighbour or received from its left",
            ["direction", "transport"],
            registry=r,
        )
        self.ring_allreduce = Histogram(
            "ringtrain_ring_allreduce_seconds",
            "Wall time of one ring allreduce (barriers excluded)",
            ["transport"],
            buckets=RING_BUCKETS,
            registry=r,
        )
        self.ring_errors = Counter(
            "ringtrain_ring_errors",
            "Times the ring broke, by kind (timeout, link, interrupted)",
            ["kind", "transport"],
            registry=r,
        )
        self.ring_stalls = Counter(
            "ringtrain_ring_stalls",
            "Times a collective waited past the stall threshold (each report)",
            ["transport"],
            registry=r,
        )
        self.ring_peer_missing = Gauge(
            "ringtrain_ring_peer_missing",
            "1 while this worker waits at start-up for the ring member named by peer",
            ["peer"],
            registry=r,
        )
        self.rejoins = Gauge(
            "ringtrain_ring_rejoins",
            "Times this container's worker rejoined "
            "the ring in place after a peer's failure (carried across its "
            "re-execs)",
            registry=r,
        )
        self.data_wait = Counter(
            "ringtrain_data_wait_seconds",
            "Seconds steps waited for their batch's data (reading not hidden behind the "
            "previous step)",
            registry=r,
        )
        self.waiting_names: list[str] = []
        self._last = IPUStats()
        self._status = events.Status()
        self._lock = threading.Lock()

    def watch_ring(self, collective) -> None:
        """Export ``collective``'s ring statistics, if it is the ring (a single worker and
        Open MPI have none)."""
        transport = getattr(collective, "transport", None)
        if isinstance(getattr(collective, "observer", None), RingMetrics):
            return  # already reporting here (the worker hands it to ring.connect)
        if hasattr(collective, "observer") and transport is not None:
            collective.observer = RingMetrics(self, transport.name)

    def set_plan(
        self, plan: MemoryPlan, host_state_bytes: int = 0, baseline=None, stages=None
    ) -> None:
        """The training program's memory report: metrics by kind and ``/status``'s
        ``ipu_memory`` (the per-layer table too); with pipelining each stage's IPU as
        ``ringtrain_ipu_stage_memory_bytes{ipu,stage,kind}``."""
        for kind, n in plan.kinds().items():
            self._ipu_memory[kind].set(n)
        for s, p in enumerate(stages or ()):
            for kind, n in p.kinds().items():
                self.ipu_stage_memory.labels(ipu=str(s), stage=str(s + 1), kind=kind).set(n)
        self._host_state.set(host_state_bytes)
        self.ipu_capacity.set(plan.capacity)
        self.update_status(
            ipu_memory=memory.status_doc(plan, host_state_bytes, baseline=baseline, stages=stages)
        )

    def observe_step(
        self,
        step: int,
        epoch: int,
        seconds: float,
        loss: float,
        samples_per_s: float,
        ipu: IPUStats,
        comm: StepCommStats,
        data_wait_s: float = 0.0,
    ) -> None:
        """One step done: its time, loss and throughput, the IPU's and the ring's counters, and
        how long it waited for its batch (``data.feed``), in one ``/status`` update."""
        self.step_duration.observe(seconds)
        self.data_wait.inc(data_wait_s)
        self.steps.inc()
        self.loss.set(loss)
        self.samples_per_s.set(samples_per_s)
        last = self._last
        self._stream["weights_in"].inc(ipu.weights_in_bytes - last.weights_in_bytes)
        self._stream["grads_out"].inc(ipu.grads_out_bytes - last.grads_out_bytes)
        self._stream["data_in"].inc(ipu.data_in_bytes - last.data_in_bytes)
        self.ipu_compute.inc(max(0.0, ipu.compute_s - last.compute_s))
        self.ipu_flops.inc(ipu.flops - last.flops)
        self.recompiles.inc(ipu.recompiles - last.recompiles)
        self.ipu_link_bytes.inc(ipu.link_bytes - last.link_bytes)
        before = last.stage_busy_s or (0.0,) * len(ipu.stage_busy_s)
        for s, (now, then) in enumerate(zip(ipu.stage_busy_s, before, strict=True)):
            self.ipu_stage_busy.labels(ipu=str(s), stage=str(s + 1)).inc(max(0.0, now - then))
        self._last = IPUStats(**vars(ipu))
        if comm.allreduce_s > 0:
            self.allreduce.inc(comm.allreduce_s)
            self.allreduce_hidden.inc(comm.hidden_s)
            self.allreduce_peer_wait.inc(comm.peer_wait_s)
            self.overlap.set(comm.overlap_fraction)
        self.update_status(
            step=step,
            epoch=epoch,
            loss=loss,
            samples_per_s=samples_per_s,
            phase="Training",
            data_wait_s=round(data_wait_s, 6),
        )

    def observe_eval(self, accuracy: float, metric: str = "accuracy") -> None:
        """The chief's evaluation: ``accuracy``, or the MAE (``metric="mae"``: a regression
        loss's, in ``/status`` only)."""
        if metric == "mae":
            self.update_status(test_mae=accuracy)
            return
        self.test_accuracy.set(accuracy)
        self.update_status(test_accuracy=accuracy)

    def observe_evaluation(
        self, step: int, loss: float, accuracy: float, metric: str = "accuracy"
    ) -> None:
        """The evaluator evaluated the checkpoint of ``step``."""
        self.evaluations.inc()
        self.evaluated_step.set(step)
        self.test_loss.set(loss)
        if metric == "mae":
            self.update_status(step=step, test_loss=loss, test_mae=accuracy)
            return
        self.test_accuracy.set(accuracy)
        self.update_status(step=step, test_loss=loss, test_accuracy=accuracy)

    def update_status(self, **fields) -> None:
        with self._lock:
            self._status = dataclasses.replace(self._status, **fields)

    def status(self) -> dict:
        """The ``/status`` document (:class:`ringtrain.events.Status`)."""
        with self._lock:
            return self._status.to_dict()
