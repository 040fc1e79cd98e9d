"""The operator is a control plane: importing it loads neither numpy nor the trainer's engine.

Model questions (can it run, what does it hold) go to ``ringtrain_trainer.sizing`` in a bounded
child process (``ringtrain_operator.modelcheck``). This test imports every operator module in a
fresh interpreter, as ``python -m ringtrain_operator.main`` would, and prints the import time and
RSS as one JSON line (``-s`` shows it) for the record.
"""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import importlib, json, pkgutil, resource, sys, time
t = time.perf_counter()
import ringtrain_operator, ringtrain_localrun
for pkg in (ringtrain_operator, ringtrain_localrun):
    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
        importlib.import_module(m.name)
seconds = time.perf_counter() - t
print(json.dumps({
    "import_s": round(seconds, 3),
    "max_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
    "numpy": "numpy" in sys.modules,
    "trainer": sorted(m for m in sys.modules if m.startswith("ringtrain_trainer")),
}))
"""


def test_importing_the_operator_loads_no_numpy_and_no_engine():
    out = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=120
    )
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps({"measure": "operator_import", **seen}))
    assert seen["numpy"] is False
    assert not [m for m in seen["trainer"] if m.startswith("ringtrain_trainer.engine")]
    assert seen["trainer"] == [], seen["trainer"]


def test_the_model_check_runs_the_trainers_arithmetic_in_a_child():
    """A preset is planned (the worker's plan, not a guess) and an inline model's refusal
    carries the parser's words, without numpy entering this process's operator modules."""
    from ringtrain_operator import modelcheck

    planned, params, slots = modelcheck.plan("cnn", 32, 900 << 20, "adam", True)
    assert planned is not None and planned > 0
    assert params == 347146 and slots == 2
    layers = [
        {"class_name": "InputLayer", "config": {"batch_shape": [None, 4]}},
        {"class_name": "NoSuchLayer", "config": {}},
    ]
    bad = {"class_name": "Sequential", "config": {"layers": layers}}
    why = modelcheck.check(bad, 900 << 20, 32)
    assert why is not None and "NoSuchLayer" in why
