"""The one home of the tests' helpers, on pytest's ``pythonpath`` (``from support.ports import
free_ports``): ``ports`` (free loopback ports by the ring's rule), ``procs`` (ring members and
other processes), ``sockets`` (a stranger's raw connection), ``reference`` (the single-worker
run N workers must match), ``prometheus`` and ``pod_discovery`` (a real Prometheus and the
Kubernetes discovery Debian's lacks).

Tests import their helpers from here, not from the shipped packages (``ringtrain_bench`` is the
benchmarks'), and load no module by file path; the rules the helpers follow come from the shared
contract (``ringtrain.ports``), so the tests, ``ringtrain run`` and the trainer agree.
"""
