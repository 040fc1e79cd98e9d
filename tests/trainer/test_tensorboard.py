"""TensorBoard event files, read back by TensorBoard itself.

A real job (examples/evaluator.yaml through ``ringtrain run``: a chief and a worker on the ring,
and the sidecar evaluator) writes its event files; the real ``tensorboard`` server serves them and
its HTTP API must give back exactly what the trainer and the evaluator reported in their JSON
lines. TensorBoard's own reader (``EventAccumulator``) is the fast check of single-worker runs.

The reader runs in TensorBoard's TensorFlow-free mode (its ``tensorboard.compat.notf`` marker,
what ``pip install tensorboard`` without TensorFlow gets): the venv has TensorFlow for the Keras
tests, and importing it only to read event files costs 5-15 s on the shared test machine. The
server runs as installed (with TensorFlow), started before the job so that its start-up overlaps.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
import types
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from support.ports import free_port
from support.procs import ringtrain

from ringtrain import events
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.ipu.device import IPUStats
from ringtrain_trainer.keras import load as keras_load
from ringtrain_trainer.telemetry import tensorboard as tb
from ringtrain_trainer.worker import Trainer

sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CHIEF_TAGS = {
    "train/loss",
    "train/learning_rate",
    "train/samples_per_s",
    "test/accuracy",
    "step_time/total_s",
    "step_time/ipu_compute_s",
    "step_time/exposed_allreduce_s",
    "step_time/other_s",
    # what the IPU computes in (numerics), written by every chief
    "numerics/loss_scale",
    "numerics/skipped_steps",
    "numerics/gradient_accumulation_steps",
    "numerics/precision_bits",
}
RING_TAGS = {
    "allreduce/time_s",
    "allreduce/hidden_s",
    "allreduce/peer_wait_s",
    "allreduce/overlap_fraction",
    "allreduce/busbw_gbps",
}
EVAL_TAGS = {"eval/test_loss", "eval/test_accuracy"}


def scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def _train(tmp_path, mnist5k, *extra: str) -> tuple[dict, list[events.Event]]:
    cfg = TrainerConfig.from_args(
        ["--dataset", "mnist-5k", "--steps", "6", "--batch-size", "32", "--json", *extra], {}
    )
    out = io.StringIO()
    t = Trainer(cfg, LocalCollective(), dataset=mnist5k, out=out)
    try:
        final = t.run()
    finally:
        t.close()
    return final, [events.parse_line(x) for x in out.getvalue().splitlines()]


# ---- fast: TensorBoard's own reader --------------------------------------------------------------


def test_the_chief_writes_its_progress_points_under_the_checkpoint_dir(tmp_path, mnist5k):
    final, lines = _train(tmp_path, mnist5k, "--checkpoint-dir", str(tmp_path), "--eval-every", "3")
    got = scalars(tmp_path / "tensorboard" / "chief")
    assert set(got) == CHIEF_TAGS  # one worker: no allreduce, so no allreduce scalars
    progress = {e.step: e for e in lines if isinstance(e, events.Progress)}
    assert sorted(got["train/loss"]) == sorted(progress) and progress
    for step, e in progress.items():
        assert got["train/loss"][step] == pytest.approx(e.loss, abs=1e-6)
        assert got["train/samples_per_s"][step] == pytest.approx(e.samples_per_s, abs=0.06)
        assert got["train/learning_rate"][step] == pytest.approx(1e-3)
    assert got["train/loss"][6] == pytest.approx(final["loss"], abs=1e-6)
    evals = {e.step: e.test_accuracy for e in lines if isinstance(e, events.Eval)}
    assert evals.keys() == {3, 6}
    assert got["test/accuracy"] == pytest.approx(evals, abs=1e-6)
    for step in progress:
        parts = (
            got["step_time/ipu_compute_s"][step]
            + got["step_time/exposed_allreduce_s"][step]
            + got["step_time/other_s"][step]
        )
        assert got["step_time/ipu_compute_s"][step] > 0
        assert parts == pytest.approx(got["step_time/total_s"][step], rel=1e-5)


def test_a_pipelined_chief_writes_each_stage_ipus_busy_time(tmp_path, mnist5k):
    args = ["--checkpoint-dir", str(tmp_path), "--ipus-per-worker", "2"]
    args += ["--pipeline-stages", "auto", "--gradient-accumulation-steps", "2"]
    _train(tmp_path, mnist5k, *args)
    got = scalars(tmp_path / "tensorboard" / "chief")
    stages = {"pipeline/stage1_ipu0_busy_s", "pipeline/stage2_ipu1_busy_s"}
    assert set(got) == CHIEF_TAGS | stages
    for tag in stages:
        for step, busy in got[tag].items():
            assert 0 < busy <= got["step_time/ipu_compute_s"][step]


def test_the_log_dir_option_wins_and_without_any_dir_nothing_is_written(tmp_path, mnist5k):
    _train(
        tmp_path,
        mnist5k,
        "--checkpoint-dir",
        str(tmp_path / "ck"),
        "--tensorboard-dir",
        str(tmp_path / "tb"),
    )
    assert (tmp_path / "tb" / "chief").is_dir() and not (tmp_path / "ck" / "tensorboard").exists()
    assert tb.log_dir(None, None, "chief") is None
    w = tb.TrainWriter(None, 2)
    w.start(0, IPUStats())
    assert not w.on
    w.progress(1, 1.0, 1e-3, 10.0)  # off: a no-op, never an error
    w.close()


def test_tensorboardx_is_imported_without_torch():
    had_torch = "torch" in sys.modules
    assert tb.summary_writer().__module__.startswith("tensorboardX")
    assert had_torch or "torch" not in sys.modules


def test_a_resumed_chief_replaces_the_points_after_its_checkpoint(tmp_path, mnist5k):
    """tensorboardX's purge_step: TensorBoard drops the first run's points past the restore."""
    d = ["--checkpoint-dir", str(tmp_path), "--checkpoint-every", "4"]
    _train(tmp_path, mnist5k, *d)  # checkpoints at 4 and 6
    (tmp_path / "ckpt-0000000006.json").unlink()  # as if it died after step 4's checkpoint
    final, lines = _train(tmp_path, mnist5k, *d)
    got = scalars(tmp_path / "tensorboard" / "chief")["train/loss"]
    resumed = {e.step: e.loss for e in lines if isinstance(e, events.Progress)}
    assert min(resumed) == 5 and got[6] == pytest.approx(final["loss"], abs=1e-6)
    assert {s: v for s, v in got.items() if s > 4} == pytest.approx(resumed, abs=1e-6)


def test_bus_bandwidth_is_the_nccl_ring_figure():
    assert tb.bus_bandwidth(2, 1e9, 1.0) == 1e9
    assert tb.bus_bandwidth(4, 1e9, 1.0) == 1.5e9
    assert tb.bus_bandwidth(1, 1e9, 1.0) == 0.0 and tb.bus_bandwidth(2, 1e9, 0.0) == 0.0


# ---- real: a ringtrain run job, served by the tensorboard server ---------------------------------


def _get(url: str):
    with urllib.request.urlopen(url, timeout=5) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The real ``tensorboard`` server on the log dir of examples/evaluator.yaml run by
    ``ringtrain run`` (chief + worker on the ring, 30 steps, checkpoints at 10, 20, 30, and the
    evaluator). The server starts first, as a user watching the job live would start it (and
    so its start-up overlaps the job's). Yields the run's JSON lines and a reader of the
    server's scalars, once it serves every run and tag (polled against a deadline)."""
    tmp = tmp_path_factory.mktemp("tbjob")
    run_dir = tmp / "run"
    logdir = run_dir / "checkpoints" / "tensorboard"
    logdir.mkdir(parents=True)
    port = free_port()
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(logdir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load_fast",
            "false",
            "--reload_interval",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    want = {"chief": CHIEF_TAGS | RING_TAGS, "evaluator": EVAL_TAGS}
    try:
        out = ringtrain(
            "run",
            str(ROOT / "examples" / "evaluator.yaml"),
            "--json",
            "--run-dir",
            str(run_dir),
            "--progress-interval",
            "0.05",
            cwd=tmp,
            timeout_s=120,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        job = [json.loads(x) for x in out.stdout.splitlines()]

        def scalars_of(run: str, tag: str) -> dict[int, float]:
            q = urllib.parse.urlencode({"run": run, "tag": tag})
            return {
                step: value for _, step, value in _get(f"{base}/data/plugin/scalars/scalars?{q}")
            }

        def loaded() -> bool:
            """Every tag, and every point of the last one written (TensorBoard reloads the
            files in passes: a tag can be there before all its points are)."""
            return (
                all(want[r] <= set(tags.get(r, ())) for r in want)
                and len(scalars_of("evaluator", "eval/test_accuracy"))
                == len(job[-1]["evaluations"])
                and max(scalars_of("chief", "train/loss")) == job[-1]["steps"]
            )

        deadline, tags = time.monotonic() + 40, {}
        while time.monotonic() < deadline:
            assert p.poll() is None, p.stderr.read()[-2000:]
            try:
                tags = _get(f"{base}/data/plugin/scalars/tags")
                if loaded():
                    break
            except (urllib.error.URLError, ConnectionError):
                tags = {}
            time.sleep(0.2)  # polling a live server, not standing in for synchronisation
        assert {r: set(t) for r, t in tags.items()} == want
        yield job, scalars_of
    finally:
        p.kill()  # a test server: nothing to save, and no need to wait out TensorFlow's exit
        p.wait()
        p.stderr.close()


def test_the_server_shows_the_losses_the_chief_reported(served):
    job, server = served
    final = job[-1]
    loss = server("chief", "train/loss")
    reported = {e["step"]: e["loss"] for e in job if e["event"] == "progress" and e["step"]}
    assert reported and reported.keys() <= loss.keys() and max(loss) == 30
    assert {s: loss[s] for s in reported} == pytest.approx(reported, abs=1e-6)
    assert loss[30] == pytest.approx(final["loss"], abs=1e-6)
    assert server("chief", "test/accuracy") == pytest.approx({30: final["test_accuracy"]}, abs=1e-6)
    assert sorted(set(server("chief", "train/learning_rate").values())) == pytest.approx([1e-3])


def test_the_server_shows_every_evaluation_of_the_evaluator(served):
    job, server = served
    evaluations = job[-1]["evaluations"]
    assert [e["step"] for e in evaluations] == [10, 20, 30]
    assert server("evaluator", "eval/test_loss") == pytest.approx(
        {e["step"]: e["test_loss"] for e in evaluations}, abs=1e-6
    )
    assert server("evaluator", "eval/test_accuracy") == pytest.approx(
        {e["step"]: e["test_accuracy"] for e in evaluations}, abs=1e-6
    )


def test_the_allreduce_figures_agree_with_their_definitions(served):
    """busbw = 2(N-1)/N x bytes / allreduce time with N = 2: busbw x time is the bytes one
    step reduces (the cnn's gradients and the stop vote's element)."""
    server = served[1]
    nbytes = keras_load.build("cnn").num_params * 4
    time_s, hidden = server("chief", "allreduce/time_s"), server("chief", "allreduce/hidden_s")
    busbw, overlap = (
        server("chief", "allreduce/busbw_gbps"),
        server("chief", "allreduce/overlap_fraction"),
    )
    assert time_s.keys() == busbw.keys() == overlap.keys() == server("chief", "train/loss").keys()
    for step in time_s:
        assert time_s[step] > 0 and 0 <= hidden[step] <= time_s[step]
        assert overlap[step] == pytest.approx(hidden[step] / time_s[step], rel=1e-5, abs=1e-7)
        assert nbytes <= busbw[step] * 1e9 * time_s[step] <= nbytes * 1.001 + 64
