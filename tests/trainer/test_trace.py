"""The step timeline (``--trace-steps``): the tracer's units, then one real two-worker
``ringtrain run`` whose trace is checked as data and opened in Perfetto's UI in headless
Chromium (hack/lib/perfetto.py)."""

from __future__ import annotations

import json
import struct
import threading
from collections import defaultdict
from pathlib import Path

import perfetto
import pytest
import yaml
from support.procs import ringtrain

from ringtrain import events
from ringtrain.errors import InvalidSpec
from ringtrain_operator import observe
from ringtrain_operator import spec as jobspec
from ringtrain_trainer import trace
from ringtrain_trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parents[2]
WINDOW = (3, 5)
#: clock reads of the reducer and of the tracer are a few µs apart, and the trace is in whole µs
SLACK_S = 50e-6


# ---- units ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, window", [("3-5", (3, 5)), ("7", (7, 7)), (" 1 - 2 ", (1, 2))])
def test_trace_steps_parse(text, window):
    assert trace.parse_steps(text) == window
    assert TrainerConfig.from_args(["--trace-steps", text], env={}).trace_window == window


@pytest.mark.parametrize("text", ["0-3", "5-4", "a-b", "3-", "1-1001"])
def test_bad_trace_steps_are_refused_at_the_edge(text):
    with pytest.raises(InvalidSpec, match="--trace-steps"):
        TrainerConfig.from_args(["--trace-steps", text], env={})


def test_outside_the_window_nothing_is_recorded():
    tr = trace.Tracer((2, 2), rank=3)
    for step in (1, 3):
        tr.begin_step(step)
        assert tr.now() == 0 and tr.laps(trace.FORWARD, ["x"]) is None
        with tr.span(trace.DATA, "load batch"):
            pass
        tr.add(trace.ALLREDUCE, "allreduce bucket", 0, 1, 10)
    assert not tr.recorded and not tr.due(3, finished=True)
    assert [e for e in tr.chrome()["traceEvents"] if e["ph"] == "X"] == []
    assert trace.OFF._rows.size == 0, "a worker without --trace-steps allocates no table"


def test_slices_nest_and_carry_their_step_and_args():
    tr = trace.Tracer((1, 1), rank=1)
    tr.begin_step(1)
    with tr.span(trace.ALLREDUCE, "allreduce bucket", 0, 4096):
        lap = tr.laps(trace.ALLREDUCE, ["reduce-scatter", "allgather"])
        lap(0)
        lap(1)
    tr.end_step(tr.now(), hidden_s=0.5)
    doc = json.loads(json.dumps(tr.chrome()))
    xs = {e["name"]: e for e in doc["traceEvents"] if e["ph"] == "X"}
    outer = xs["allreduce bucket 0"]
    assert outer["args"] == {"step": 1, "bytes": 4096} and outer["pid"] == 1
    for inner in ("reduce-scatter", "allgather"):
        e = xs[inner]
        assert outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"]
    assert xs["step 1"]["args"]["hidden_s"] == 0.5
    names = {
        (e["tid"], e["args"]["name"])
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name"
    }
    assert names == {(trace.ALLREDUCE, "allreduce"), (trace.STEP, "step")}


def test_a_full_table_drops_and_counts_instead_of_growing():
    tr = trace.Tracer((1, 1), events_per_step=2)
    tr.begin_step(1)
    for _ in range(5):
        tr.add(trace.DATA, "load batch", tr.now())
    doc = tr.chrome()
    assert len([e for e in doc["traceEvents"] if e["ph"] == "X"]) == 2
    assert doc["otherData"]["ringtrain"]["dropped"] == 3


def test_gather_hands_every_ranks_bytes_to_every_rank_exactly(thread_group):
    group = thread_group(3)
    payloads = [bytes(range(256)) * 3 + b"odd", b"", "ünïcode µs".encode() * 1000]
    results: list = [None] * 3

    def run(c):
        results[c.rank] = trace.gather(c, payloads[c.rank])

    threads = [threading.Thread(target=run, args=(c,)) for c in group.collectives()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == [payloads] * 3


def test_final_event_and_job_status_name_the_trace():
    final = events.Final(steps=8, trace="/checkpoints/trace.json")
    assert events.parse(json.loads(final.to_json())).trace == "/checkpoints/trace.json"
    assert observe.read_progress(final.to_dict())["trace"] == "/checkpoints/trace.json"


# ---- a real two-worker run -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced_run(tmp_path_factory):
    """``ringtrain run`` of two workers tracing steps 3-5 (a checkpoint after step 4)."""
    tmp = tmp_path_factory.mktemp("traced")
    job = {
        "apiVersion": jobspec.API_VERSION,
        "kind": jobspec.KIND,
        "metadata": {"name": "tr"},
        "spec": {
            "replicaSpecs": {"Worker": {"replicas": 2}},
            "trainer": {
                "dataset": "mnist-5k",
                "steps": 7,
                "batchSize": 64,
                "evalEvery": 0,
                "checkpoint": {"everySteps": 4},
                "trace": {"steps": f"{WINDOW[0]}-{WINDOW[1]}"},
            },
        },
    }
    manifest = tmp / "job.yaml"
    manifest.write_text(yaml.safe_dump(job))
    out = ringtrain("run", str(manifest), "--json", "--run-dir", str(tmp / "run"), cwd=tmp)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.splitlines()[-1])
    return summary, json.loads(Path(summary["trace"]).read_text())


def slices(doc: dict, rank: int, step: int | None = None) -> list[dict]:
    return [
        e
        for e in doc["traceEvents"]
        if e["ph"] == "X" and e["pid"] == rank and (step is None or e["args"]["step"] == step)
    ]


def test_the_summary_names_one_merged_file_with_one_process_per_rank(traced_run):
    summary, doc = traced_run
    path = Path(summary["trace"])
    assert path.name == "trace.json" and path.parent == Path(summary["run_dir"]) / "checkpoints"
    for r in (0, 1):
        own = json.loads((path.parent / f"trace-rank{r}.json").read_text())
        assert {e["pid"] for e in own["traceEvents"]} == {r}
    processes = {
        e["pid"]: e["args"]["name"]
        for e in doc["traceEvents"]
        if e["ph"] == "M" and e["name"] == "process_name"
    }
    assert processes == {0: "rank", 1: "rank"}
    assert {e["pid"] for e in doc["traceEvents"]} == {0, 1}
    assert all(r["dropped"] == 0 for r in doc["otherData"]["ringtrain"]["ranks"])


def test_every_rank_has_every_lane_for_every_step_of_the_window(traced_run):
    _, doc = traced_run
    lanes = {
        "step",
        "data loading",
        "weights in",
        "forward",
        "backward",
        "gradients out",
        "allreduce",
        "optimizer",
    }
    for rank in (0, 1):
        assert {e["args"]["step"] for e in slices(doc, rank)} == set(
            range(WINDOW[0], WINDOW[1] + 1)
        )
        for step in range(WINDOW[0], WINDOW[1] + 1):
            got = slices(doc, rank, step)
            assert lanes <= {e["cat"] for e in got}, (rank, step)
            names = {e["name"] for e in got}
            assert {
                f"step {step}",
                "reduce-scatter",
                "allgather",
                "wait for rank " + str(1 - rank),
                "forward L0 convpool",
                "backward L2 dense",
            } <= names
    assert [e["args"]["step"] for e in slices(doc, 0) if e["cat"] == "checkpoint"] == [4]


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def test_allreduce_overlaps_backward_exactly_where_the_reducer_says(traced_run):
    """Per step, the allreduce slices' overlap with the computation (before the reducer's
    "wait for allreduce"), less the "wait for rank" slices in it (blocked on a peer hides
    nothing), is the reducer's own ``hidden_s``; the same measured against the backward slices
    differs from it at most by the gap between backward's end and that wait."""
    _, doc = traced_run
    for rank in (0, 1):
        for step in range(WINDOW[0], WINDOW[1] + 1):
            got = slices(doc, rank, step)
            span = lambda e: (e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6)  # noqa: E731
            stats = next(e for e in got if e["name"] == f"step {step}")["args"]
            buckets = [span(e) for e in got if e["name"].startswith("allreduce bucket")]
            compute_end = next(span(e) for e in got if e["name"] == "wait for allreduce")[0]
            waits = [span(e) for e in got if e["name"].startswith("wait for rank")]
            backward = [span(e) for e in got if e["cat"].startswith("backward")]
            tol = SLACK_S * (len(buckets) + len(waits) + 1)
            assert sum(b - a for a, b in buckets) == pytest.approx(stats["allreduce_s"], abs=tol)
            before = (0.0, compute_end)
            hidden = sum(overlap(b, before) for b in buckets) - sum(
                overlap(w, before) for w in waits
            )
            assert hidden == pytest.approx(stats["hidden_s"], abs=tol), (rank, step)
            gap = compute_end - max(b for _, b in backward)
            assert gap >= -SLACK_S, "backward ends before the reducer waits"
            merged = merge_spans(backward)
            with_backward = sum(overlap(b, w) for b in buckets for w in merged) - sum(
                overlap(x, w) for x in waits for w in merged
            )
            # one communication thread: its buckets are sequential, so at most the whole gap
            assert -tol <= stats["hidden_s"] - with_backward <= max(gap, 0.0) + tol


def merge_spans(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def test_ring_phases_and_waits_nest_inside_their_bucket(traced_run):
    _, doc = traced_run
    for rank in (0, 1):
        ring = defaultdict(list)
        for e in slices(doc, rank):
            if e["cat"] == "allreduce":
                ring[e["args"]["step"]].append(e)
        for step, es in ring.items():
            outer = [e for e in es if e["name"].startswith("allreduce bucket")]
            for e in es:
                assert any(
                    o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"] for o in outer
                ), (rank, step, e)


# ---- in a real viewer ----------------------------------------------------------------------------


def test_perfettos_ui_loads_the_merged_trace_without_error(traced_run, tmp_path):
    summary, _ = traced_run
    png = tmp_path / "trace.png"
    seen = perfetto.screenshot(summary["trace"], png, width=1200, height=900)
    assert (seen["loading_errors"], seen["stats_errors"], seen["console_errors"]) == ([], [], [])
    assert seen["tracks"] >= 2 * 9, "two ranks with their lanes"
    head = png.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", head[16:24])[0] == 1200
    assert png.stat().st_size > 20_000, "a blank page compresses to a few KB"
