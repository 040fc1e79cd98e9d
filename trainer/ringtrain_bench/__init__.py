"""The benchmarks behind ``ringtrain bench``: ``step`` (training samples/s next to PyTorch, one
worker or a local ring) and ``allreduce`` (the ring's bandwidth next to gloo and Open MPI), with
``procs`` starting local ring members for them and for the tests. The trainer never imports
this package; it only measures the trainer from outside.
"""
