"""Memory the pod informer keeps per job (issue 22): it must keep only what the fold reads."""

from __future__ import annotations

import json
import tracemalloc

from operator_jobs import job
from test_observe import pod_obj

from ringtrain_operator.observe import ObservedPod

JOBS = 1000


def test_observed_pods_of_1000_jobs_cost_under_600_bytes_per_job() -> None:
    raw = [
        json.dumps(pod_obj(j, "worker", index, phase="Pending", ip=""))
        for j in (job(name=f"j{n}") for n in range(JOBS))
        for index in (0, 1)
    ]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        cache = [ObservedPod.from_pod(json.loads(r)) for r in raw]
        per_job = (tracemalloc.get_traced_memory()[0] - before) / JOBS
    finally:
        tracemalloc.stop()
    assert all(p is not None for p in cache)
    assert cache[0].phase is cache[-1].phase and cache[0].role is cache[2].role
    assert per_job < 600, f"{per_job:.0f} bytes of observed pods per job"
