"""ringtrain's trainer: an emulated IPU, a host-side optimizer and a gRPC ring allreduce."""

__version__ = "0.1.0"
