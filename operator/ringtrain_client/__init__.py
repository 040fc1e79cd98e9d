"""ringtrain's Python client: ``fit`` a compiled Keras model on several workers, locally or on a
cluster, and follow, wait for and fetch the job (docs/client.md, decision 0208)."""

from .client import Job, TrainerClient, fit
from .jobs import JobFailed, JobNotFound, JobStatus, JobTimeout, Metrics

__all__ = [
    "Job",
    "JobFailed",
    "JobNotFound",
    "JobStatus",
    "JobTimeout",
    "Metrics",
    "TrainerClient",
    "fit",
]
