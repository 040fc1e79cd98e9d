"""ringtrain's trainer: an emulated IPU, a host-side optimizer and a ring allreduce."""
