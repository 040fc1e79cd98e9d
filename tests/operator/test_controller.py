"""The work queue and the pod informer's cache (issue 22): events for one job coalesce, one
reconcile of a job at a time, and only changes the fold can see wake a job."""

from __future__ import annotations

import asyncio
import threading

from kubernetes import client

from ringtrain_operator.controller import Controller, WorkQueue
from ringtrain_operator.informer import JobInformer, PodInformer
from ringtrain_operator.kube import Kube


def test_keys_coalesce_and_a_key_added_while_handled_is_handled_again_after():
    async def scenario():
        q = WorkQueue()
        for key in ["a", "b", "a", "a"]:
            q.add(key)
        assert len(q) == 2
        first = await q.get()
        q.add(first)  # an event while "a" is being reconciled: not a second worker on it
        assert len(q) == 1 and await q.get() == "b"
        q.done("b")
        assert len(q) == 0
        q.done(first)  # ... but handled again right after
        assert len(q) == 1 and await q.get() == "a"

    asyncio.run(scenario())


def test_a_later_look_replaces_the_earlier_timer_and_forget_cancels_it():
    async def scenario():
        q = WorkQueue()
        q.add_after("a", 0.01)
        q.add_after("a", 30)  # the last reconcile's decision stands, as the daemon's timeout did
        q.add_after("b", 0.01)
        assert await asyncio.wait_for(q.get(), 5) == "b"
        q.add_after("c", 0.01)
        q.forget("c")
        await asyncio.sleep(0.05)
        return len(q)

    assert asyncio.run(scenario()) == 0


def test_the_pool_bounds_reconciles_and_never_runs_one_key_twice_at_once():
    running: dict[str, int] = {}
    peak = {"all": 0, "same": 0}
    lock = threading.Lock()
    gate = threading.Event()

    def handle(key):
        with lock:
            running[key] = running.get(key, 0) + 1
            peak["all"] = max(peak["all"], sum(running.values()))
            peak["same"] = max(peak["same"], running[key])
        gate.wait(5)
        with lock:
            running[key] -= 1

    async def ready():
        return None

    async def scenario():
        ctl = Controller(handle, lambda key, result: None, ready, workers=3)
        ctl.start()
        for i in range(10):
            ctl.queue.add(f"job-{i}")
        await asyncio.sleep(0.2)
        ctl.queue.add("job-0")
        gate.set()
        while len(ctl.queue) or any(running.values()):
            await asyncio.sleep(0.01)
        await ctl.stop()

    asyncio.run(scenario())
    assert peak == {"all": 3, "same": 1}


def pod(name, job="j", phase="Pending", conditions=()):
    return {
        "metadata": {
            "name": name,
            "namespace": "ns",
            "labels": {
                "ringtrain.io/job-name": job,
                "ringtrain.io/replica-type": "worker",
                "ringtrain.io/replica-index": name[-1],
            },
        },
        "status": {"phase": phase, "conditions": list(conditions)},
    }


def test_only_pod_changes_the_fold_reads_wake_the_job():
    woken = []
    inf = PodInformer(Kube(client.ApiClient()), ["ns"], woken.append)
    inf.apply("ADDED", pod("j-worker-0"))
    inf.apply("ADDED", pod("j-worker-1"))
    unschedulable = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}
    inf.apply("MODIFIED", pod("j-worker-0", conditions=[unschedulable]))  # nothing for the fold
    inf.apply("MODIFIED", pod("j-worker-1", phase="Running"))
    inf.apply("ADDED", pod("k-worker-0", job="k"))
    assert [p.name for p in inf.pods("ns", "j")] == ["j-worker-0", "j-worker-1"]
    assert inf.pods("ns", "j")[1].phase == "Running"
    inf.apply("DELETED", pod("j-worker-0"))
    assert [p.name for p in inf.pods("ns", "j")] == ["j-worker-1"]
    # added, added, (unschedulable: no), running
    assert woken == [("ns", "j")] * 3 + [("ns", "k"), ("ns", "j")]


def job(name, generation, uid="u1"):
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid, "generation": generation}}


def test_new_jobs_and_spec_changes_wake_a_job_and_status_writes_do_not():
    """A job is woken when it appears (or is listed after a restart), when its spec changes (a
    new generation) and when it is created again under its name (a new uid); not for the
    status the operator writes (same generation). A relist forgets jobs deleted meanwhile."""
    woken = []
    inf = JobInformer(Kube(client.ApiClient()), ["ns"], lambda key, gone: woken.append((key, gone)))
    inf._replace("ns", {("ns", "a"): ("u1", 1), ("ns", "b"): ("u2", 1)})  # start-up list
    inf.apply("MODIFIED", job("a", 1))  # our status write
    inf.apply("MODIFIED", job("a", 2))  # a new spec
    inf.apply("DELETED", job("a", 2))
    inf.apply("ADDED", job("a", 1, uid="u3"))  # created again
    assert inf.uid(("ns", "a")) == "u3"
    inf._replace("ns", {("ns", "a"): ("u3", 1)})  # b deleted while the watch was down
    a, b = ("ns", "a"), ("ns", "b")
    assert woken == [(a, False), (b, False), (a, False), (a, True), (a, False), (b, True)]
    assert inf.uid(b) is None


def test_a_reconcile_reads_the_job_it_last_wrote_only_while_the_watch_agrees():
    """The status patch's answer stands in for the next GET (issue 22), but never once the
    watch reports another spec (generation) or uid, and never after the job was dropped. A new
    job's ADDED event stands in for its first GET; a later event of the watch never does."""
    import json

    inf = JobInformer(Kube(client.ApiClient()), ["ns"], lambda key, gone: None)
    key = ("ns", "a")
    managed = {**job("a", 1), "status": {}}
    managed["metadata"] = {**managed["metadata"], "managedFields": [{"manager": "kubectl"}]}
    inf.apply("ADDED", managed)
    assert inf.object(key) == {**job("a", 1), "status": {}}  # as created, managedFields left out
    written = {**job("a", 1), "status": {"state": "Created"}}
    inf.remember(key, json.dumps(written).encode())
    assert inf.object(key) == written
    inf.apply("MODIFIED", job("a", 1))  # our own write's event: still ours
    assert inf.object(key) == written
    inf.apply("MODIFIED", job("a", 2))  # a new spec: read it
    assert inf.object(key) is None
    inf.remember(key, json.dumps(job("a", 2)).encode())
    assert inf.object(key) == job("a", 2)
    inf.drop(key)
    assert inf.object(key) is None
    inf.apply("MODIFIED", {**job("a", 2), "status": {"state": "Old"}})  # never from an update
    assert inf.object(key) is None
    inf.remember(key, json.dumps(job("a", 2)).encode())
    inf.apply("DELETED", job("a", 2))
    assert inf.object(key) is None
    inf.apply("ADDED", job("a", 2, uid="u9"))  # created again under the name: its own object
    assert inf.object(key) == job("a", 2, uid="u9")


def test_the_start_up_list_stands_in_for_gets_and_the_kept_objects_are_bounded_in_bytes(
    monkeypatch,
):
    """A restarted operator reconciles every job from its first list without a GET, as far as
    RECENT_BYTES holds them (the first listed, which are queued first); a relist (a write of
    ours may fall inside it) keeps nothing; the watch's new jobs evict the oldest entries."""
    import json

    from ringtrain_operator import informer

    one = len(json.dumps(job("j-00", 1), separators=(",", ":")))
    monkeypatch.setattr(informer, "RECENT_BYTES", 3 * one)
    inf = JobInformer(Kube(client.ApiClient()), ["ns"], lambda key, gone: None)
    listed: dict = {}
    inf._read("ns", [job(f"j-{i:02d}", 1, uid=f"u{i}") for i in range(5)], listed)
    inf._replace("ns", listed)
    inf._synced["ns"].set()
    kept = [i for i in range(5) if inf.object(("ns", f"j-{i:02d}")) is not None]
    assert kept == [0, 1, 2]
    assert inf._recent_bytes <= 3 * one
    inf.drop(("ns", "j-00"))
    inf._read("ns", [job("j-00", 1, uid="u0")], {})  # a relist
    assert inf.object(("ns", "j-00")) is None
    inf.apply("ADDED", job("j-05", 1, uid="u5"))
    inf.apply("ADDED", job("j-06", 1, uid="u6"))  # j-01, the oldest, makes room
    assert inf.object(("ns", "j-01")) is None
    assert inf.object(("ns", "j-06")) == job("j-06", 1, uid="u6")
    assert inf._recent_bytes <= 3 * one


def test_each_request_is_counted_by_verb_and_resource():
    """The benchmark's requests per job by verb and resource (issue 22) come from this."""
    from ringtrain_operator.kube import request_kind

    h = "https://10.0.0.1:6443"
    tj = f"{h}/apis/ringtrain.io/v1alpha1/namespaces/ns/trainingjobs"
    assert request_kind("PATCH", f"{tj}/a/status") == ("PATCH", "trainingjobs/status")
    assert request_kind("GET", f"{tj}/a") == ("GET", "trainingjobs")
    assert request_kind("GET", tj, [("limit", 500)]) == ("LIST", "trainingjobs")
    watch = [("watch", True), ("resourceVersion", "7")]
    assert request_kind("GET", f"{h}/api/v1/namespaces/ns/pods", watch) == ("WATCH", "pods")
    assert request_kind("GET", f"{h}/api/v1/pods", watch) == ("WATCH", "pods")
    assert request_kind("POST", f"{h}/api/v1/namespaces/ns/events") == ("POST", "events")
    assert request_kind("DELETE", f"{h}/api/v1/namespaces/ns/pods/p") == ("DELETE", "pods")
    path = "/apis/networking.k8s.io/v1/namespaces/ns/networkpolicies"
    assert request_kind("POST", f"{h}{path}") == ("POST", "networkpolicies")
