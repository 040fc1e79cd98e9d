"""Checkpoints: what a run writes so it can resume, and who may write it.

``store`` (``.npz`` arrays plus a checksummed JSON manifest, atomic, the last K kept) and
``owner`` (one job per checkpoint directory).
"""
