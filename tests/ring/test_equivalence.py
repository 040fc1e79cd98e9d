"""N synchronous workers with per-worker batch B train exactly like one worker with batch N·B.

The test that proves the whole pipeline: data sharding, loss scaling, gradient streaming,
bucketing, the ring's mean allreduce over real processes and TCP on loopback, the initial
broadcast and the host-side optimizer. A global batch of 12 lets N = 2, 3 and 4 share one
single-worker reference per optimizer (B = 12 / N).
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from trainer.cluster import build
from trainer.ring.bench import free_ports

GLOBAL_BATCH = 12
STEPS = 50
LR = {"sgd": 0.01, "adam": 0.001}


def train(tmp_path, name: str, world: int, optimizer: str) -> np.ndarray:
    """Run ``world`` real worker processes to ``STEPS`` and return the final flat weights."""
    out = tmp_path / name
    addrs = [f"127.0.0.1:{p}" for p in free_ports(world)]
    procs = []
    for i in range(world):
        env = dict(os.environ, RINGTRAIN_TOKEN="equivalence")
        env.pop("TF_CONFIG", None)
        if world > 1:
            env["TF_CONFIG"] = build({"worker": addrs}, "worker", i)
        cmd = [sys.executable, "-m", "trainer.cli", "worker", "--dataset", "mnist-5k",
               "--steps", str(STEPS), "--batch-size", str(GLOBAL_BATCH // world),
               "--optimizer", optimizer, "--lr", str(LR[optimizer]), "--seed", "7",
               "--bucket-mb", "0.25", "--checkpoint-dir", str(out), "--json",
               "--termination-log", str(tmp_path / f"{name}-{i}.json")]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outputs = []
    for i, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, f"{name} worker {i}: {stderr[-2000:]}"
        outputs.append(stdout)
    final = json.loads(outputs[0].strip().splitlines()[-1])  # the chief's result
    assert final["event"] == "final" and final["steps"] == STEPS and final["world_size"] == world
    with np.load(final["checkpoint"].removesuffix(".json") + ".npz") as z:
        return z["params"].copy()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_n_workers_match_one_worker_with_the_global_batch(tmp_path, optimizer):
    reference = train(tmp_path, "n1", 1, optimizer)
    for world in (2, 3, 4):
        weights = train(tmp_path, f"n{world}", world, optimizer)
        diff = np.abs(weights - reference)
        bad = ~np.isclose(weights, reference, rtol=1e-4, atol=1e-6)
        assert not bad.any(), (f"{optimizer}, {world} workers: {bad.sum()} of {bad.size} "
                               f"weights differ, max |diff| {diff.max():.3g}")
