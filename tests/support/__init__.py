"""The one home of the tests' helpers (on pytest's ``pythonpath``: ``from support.ports import
free_ports``): ports, worker processes, sockets, single-worker reference runs and pod discovery.

Tests import their helpers from here and not from the shipped packages' test-like corners
(``ringtrain_bench`` is the benchmarks', not the tests'); the rules the helpers follow come from
the shared contract (``ringtrain.ports``), so tests, ``ringtrain run`` and the trainer agree.
"""
