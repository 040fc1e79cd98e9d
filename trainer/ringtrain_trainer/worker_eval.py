"""A worker's share of evaluation: the test set split across workers and summed over the ring.

Split out of :mod:`ringtrain_trainer.worker` because evaluation is its own concept (its
collective tags -2 and -3, the compiled metrics' state, what the chief records); :class:`Trainer`
mixes it in and provides the attributes it reads (``data``, ``ipu``, ``spec``, ``collective``...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from ringtrain import events
from ringtrain_trainer.engine import keras_metrics
from ringtrain_trainer.engine.multiloss import MultiLossSpec
from ringtrain_trainer.telemetry.reporting import metric_fields

if TYPE_CHECKING:
    from ringtrain_trainer.collective import Collective
    from ringtrain_trainer.data.split import Dataset
    from ringtrain_trainer.ipu.device import IPU
    from ringtrain_trainer.keras.load import KerasModel
    from ringtrain_trainer.telemetry.metrics import TrainerMetrics
    from ringtrain_trainer.telemetry.reporting import Reporter
    from ringtrain_trainer.telemetry.tensorboard import TrainWriter


class SharedEvaluation:
    """Mixin: :meth:`evaluate` for the :class:`~ringtrain_trainer.worker.Trainer`."""

    # provided by the Trainer that mixes this in (declared here so they are checked)
    data: Dataset
    rank: int
    world: int
    spec: KerasModel
    ipu: IPU
    eval_batch: int
    collective: Collective
    step: int
    is_chief: bool
    metrics: TrainerMetrics
    report: Reporter
    tb: TrainWriter
    # set by evaluate (the chief's)
    test_accuracy: float | None
    test_outputs: events.Values | None

    def evaluate(self) -> float:
        """Test accuracy, computed by every worker on its contiguous share of the test set and
        summed over the collective; the chief records and reports it.

        Why not the chief alone: its peers would wait in the next step's allreduce for the
        whole evaluation, and an evaluation longer than ``--ring-step-timeout-s`` would fail
        the job with a retryable ring error. Shared, it takes 1/N of the time and no worker
        idles. The result is the same number as one worker evaluating everything (counts are
        integers, exact in float32 up to 2**24 examples). Checkpoints stay the chief's alone:
        writing a few MB takes milliseconds, far inside the step timeout."""
        test = self.data.test
        images, labels = test.images, test.labels
        lo = len(labels) * self.rank // self.world
        hi = len(labels) * (self.rank + 1) // self.world
        correct = 0.0
        # whole counts (a per-position accuracy is a fraction of each example)
        exact = (
            self.spec.loss.kind in ("sparse", "categorical")
            and getattr(self.spec.loss, "positions", 1) == 1
        )
        compiled = keras_metrics.for_model(self.spec)
        if hi > lo:
            acc = self.ipu.evaluate(
                images[lo:hi], labels[lo:hi], self.eval_batch, test.scale, compiled
            )
            correct = round(acc * (hi - lo)) if exact else acc * (hi - lo)
        self._evaluate_outputs(hi - lo)
        if self.world > 1:
            # the compiled metrics' sums and counts ride along: summed, they are one pass's
            counts = np.concatenate([[correct], compiled.state()]).astype(np.float32)
            # tag -2: never a gradient bucket's tag, so a mismatched schedule fails loudly
            self.collective.allreduce_mean_(counts, step=self.step, tag=-2)
            total = float(counts[0]) * self.world
            correct = round(total) if exact else total
            compiled.set_state(counts[1:].astype(np.float64) * self.world)
        acc = correct / max(1, len(labels))
        if self.is_chief:
            metric = self.spec.loss.metric
            self.test_accuracy = acc
            extra = compiled.results() or None
            self.metrics.observe_eval(acc, metric)
            self.metrics.update_status(test_metrics=extra)
            self.tb.test_accuracy(self.step, acc, self.ipu.stats, metric, extra)
            fields = metric_fields(metric, acc)
            self.report.emit(events.Eval(step=self.step, **fields, test_metrics=extra))
        return acc

    def _evaluate_outputs(self, n: int) -> None:
        """A model with several outputs: each one's test loss and metric, summed over the
        workers like the accuracy (tag -3), recorded and reported by the chief."""
        loss = self.spec.loss
        if not isinstance(loss, MultiLossSpec) or not loss.trained:
            return
        trained = len(loss.trained)
        own = self.ipu.eval_sums
        sums = np.array(own, np.float32) if n and own is not None else np.zeros(2 * trained)
        sums = sums.astype(np.float32)
        if self.world > 1:
            self.collective.allreduce_mean_(sums, step=self.step, tag=-3)
            sums *= self.world
        if self.is_chief:
            self.test_outputs = loss.named_eval(sums, len(self.data.test))
            self.metrics.update_status(test_outputs=self.test_outputs)
            if self.tb.on:
                self.tb.scalars(self.step, {f"test/{k}": v for k, v in self.test_outputs.items()})
