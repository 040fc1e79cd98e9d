"""The single-worker reference: what N workers over the ring must reproduce, trained in this
process with the trainer's own one-member collective."""

from __future__ import annotations

import io

from ringtrain_trainer import worker
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig


def single_worker_run(config: TrainerConfig, dataset=None) -> worker.Trainer:
    """A :class:`~ringtrain_trainer.worker.Trainer` of ``config`` run to its end alone and
    closed; its results (``test_accuracy``, ``params``) stay readable. Its output is dropped."""
    trainer = worker.Trainer(config, LocalCollective(), dataset, out=io.StringIO())
    try:
        trainer.run()
    finally:
        trainer.close()
    return trainer
