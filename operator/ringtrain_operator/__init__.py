"""ringtrain's Kubernetes operator (kopf). Not named ``operator``: that is the standard library."""

__version__ = "0.1.0"
