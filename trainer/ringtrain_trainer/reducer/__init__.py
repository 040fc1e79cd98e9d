"""Gradient reducer, in parts (DDP's comm hook plus ``_hook_then_optimizer``).

- :mod:`.buckets`: bucket assignment from the model's streamed pieces, and readiness
- :mod:`.comm`: the communication thread (one collective per ready bucket, in order)
- :mod:`.hook`: the on-reduced callback, the one place that steps the optimizer
- :mod:`.stopvote`: the stop vote's control element in the reduced buffer
- :mod:`.switch`: the GIL switch interval while a communication thread runs
- :mod:`.pipeline`: :class:`Reducer`, which wires them for the worker's step loop
"""

from ringtrain_trainer.reducer.buckets import (
    DEFAULT_BUCKET_BYTES,
    FIRST_BUCKET_BYTES,
    Bucket,
    Readiness,
    assign_buckets,
)
from ringtrain_trainer.reducer.pipeline import Reducer, StepCommStats
from ringtrain_trainer.reducer.stopvote import StopVote
from ringtrain_trainer.reducer.switch import COMM_SWITCH_INTERVAL_S

__all__ = [
    "COMM_SWITCH_INTERVAL_S",
    "DEFAULT_BUCKET_BYTES",
    "FIRST_BUCKET_BYTES",
    "Bucket",
    "Readiness",
    "Reducer",
    "StepCommStats",
    "StopVote",
    "assign_buckets",
]
