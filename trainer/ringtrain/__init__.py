"""ringtrain's shared contract: what the trainer, the operator and ``ringtrain run`` agree on.

TF_CONFIG (``cluster``), the errors and their exit codes (``errors``), and the ``ringtrain``
command line (``cli``). Both sides import this package; it imports neither of them.
"""

__version__ = "0.1.0"
