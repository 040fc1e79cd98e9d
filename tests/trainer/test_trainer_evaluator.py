"""The evaluator role: TensorFlow's sidecar evaluator over the chief's checkpoint directory.

Real checkpoints from a real (single-worker) training run; the evaluator must evaluate every one
of them on the whole test split, agree with the chief's own evaluation of the last one, and end
exactly when the chief's marker says training finished.
"""

from __future__ import annotations

import io
import json
import threading

import numpy as np
import pytest

from ringtrain import events
from ringtrain.errors import CheckpointError, InvalidSpec
from ringtrain_trainer import evaluator as ev_mod
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.export import read_keras
from ringtrain_trainer.telemetry.metrics import TrainerMetrics
from ringtrain_trainer.worker import Trainer
from ringtrain_trainer.worker_main import main as worker_main

EVALUATOR_TF_CONFIG = '{"cluster":{"worker":["127.0.0.1:1"]},"task":{"type":"evaluator","index":0}}'


def _train(tmp_path, mnist5k, *extra: str) -> dict:
    cfg = TrainerConfig.from_args(
        [
            "--dataset",
            "mnist-5k",
            "--steps",
            "6",
            "--batch-size",
            "32",
            "--checkpoint-dir",
            str(tmp_path),
            "--checkpoint-every",
            "2",
            "--json",
            *extra,
        ],
        {},
    )
    t = Trainer(cfg, LocalCollective(), dataset=mnist5k, out=io.StringIO())
    try:
        return t.run()
    finally:
        t.close()


def _evaluator(tmp_path, mnist5k, out=None, model="cnn", **kw) -> ev_mod.Evaluator:
    cfg = TrainerConfig.from_args(
        ["--dataset", "mnist-5k", "--model", model, "--checkpoint-dir", str(tmp_path), "--json"],
        {"TF_CONFIG": EVALUATOR_TF_CONFIG},
    )
    return ev_mod.Evaluator(cfg, TrainerMetrics(), out or io.StringIO(), dataset=mnist5k, **kw)


def test_every_checkpoint_is_evaluated_and_the_last_agrees_with_the_chief(tmp_path, mnist5k):
    final = _train(tmp_path, mnist5k)
    assert ev_mod.read_done(tmp_path).steps == final["steps"] == 6
    out = io.StringIO()
    e = _evaluator(tmp_path, mnist5k, out)
    result = e.run()
    lines = [events.parse_line(x) for x in out.getvalue().splitlines()]
    assert [x.step for x in lines if isinstance(x, events.Evaluation)] == [2, 4, 6]
    assert result == lines[-1] and isinstance(result, events.Final)
    assert (result.steps, result.evaluations, result.terminated) == (6, 3, False)
    assert result.test_accuracy == pytest.approx(final["test_accuracy"], abs=1e-6)
    assert result.checkpoint.endswith("ckpt-0000000006.json")
    assert 0 < result.test_loss < 3
    m = e.metrics
    assert m.registry.get_sample_value("ringtrain_evaluations_total") == 3
    assert m.registry.get_sample_value("ringtrain_evaluated_step") == 6
    assert m.registry.get_sample_value("ringtrain_test_loss") == pytest.approx(
        result.test_loss, abs=1e-6
    )
    assert m.status()["test_loss"] == pytest.approx(result.test_loss, abs=1e-6)
    assert m.status()["phase"] == "Succeeded"


def test_the_loss_is_the_mean_cross_entropy_of_the_whole_test_split(tmp_path, mnist5k):
    _train(tmp_path, mnist5k)
    e = _evaluator(tmp_path, mnist5k)
    state = e.ckpt.load(e.ckpt.manifests()[-1])
    loss, acc = e.evaluate(state)
    from ringtrain_trainer.engine import model as model_mod

    n = len(mnist5k.test)
    prog = model_mod.Program(e.spec, n, train=False)
    prog.x[:] = mnist5k.test.images.reshape(prog.x.shape) / np.float32(255)
    logits = prog.forward(e.spec.views(state.params)).astype(np.float64)
    logp = (
        logits
        - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True))
        - logits.max(1, keepdims=True)
    )
    assert loss == pytest.approx(-logp[np.arange(n), mnist5k.test.labels].mean(), rel=1e-5)
    assert acc == np.mean(logits.argmax(1) == mnist5k.test.labels)


def test_the_evaluator_waits_for_checkpoints_and_ends_with_the_chiefs_marker(tmp_path, mnist5k):
    """Started before the chief: it waits, evaluates what appears, and ends with the marker."""
    e = _evaluator(tmp_path, mnist5k, poll_s=0.05)
    result: list = []
    t = threading.Thread(target=lambda: result.append(e.run()))
    t.start()
    t.join(0.3)
    assert t.is_alive() and e.evaluated == []
    _train(tmp_path, mnist5k)
    t.join(30)
    assert not t.is_alive() and result[0].steps == 6 and result[0].evaluations >= 1
    assert e.evaluated[-1].step == 6


def test_a_stopped_evaluator_ends_terminated_and_a_new_run_clears_the_old_marker(tmp_path, mnist5k):
    e = _evaluator(tmp_path, mnist5k, poll_s=0.05)
    e.stop_requested.set()
    assert e.run().terminated is True
    ev_mod.write_done(tmp_path, events.Final(steps=99))
    cfg = TrainerConfig.from_args(
        ["--dataset", "mnist-5k", "--steps", "1", "--checkpoint-dir", str(tmp_path)], {}
    )
    t = Trainer(cfg, LocalCollective(), dataset=mnist5k, out=io.StringIO())
    t.stop_requested.set()  # stopped: no marker of its own
    try:
        t.run()
    finally:
        t.close()
    assert ev_mod.read_done(tmp_path) is None


def test_an_evaluator_without_a_checkpoint_dir_is_refused(mnist5k):
    cfg = TrainerConfig.from_args(["--dataset", "mnist-5k"], {"TF_CONFIG": EVALUATOR_TF_CONFIG})
    with pytest.raises(InvalidSpec, match="needs --checkpoint-dir"):
        ev_mod.Evaluator(cfg, dataset=mnist5k)


def test_the_worker_command_runs_the_evaluator_for_an_evaluator_task(
    tmp_path, mnist5k, monkeypatch, capsys
):
    _train(tmp_path / "ck", mnist5k)
    monkeypatch.setenv("TF_CONFIG", EVALUATOR_TF_CONFIG)
    log = tmp_path / "termination-log"
    assert (
        worker_main(
            [
                "--dataset",
                "mnist-5k",
                "--checkpoint-dir",
                str(tmp_path / "ck"),
                "--termination-log",
                str(log),
            ]
        )
        == 0
    )
    assert "checkpoint step 6  test loss" in capsys.readouterr().out
    doc = json.loads(log.read_text())
    assert (doc["event"], doc["steps"], doc["evaluations"]) == ("final", 6, 3)


@pytest.mark.parametrize("fmt, name", [("keras", "model.keras"), ("onnx", "model.onnx")])
def test_the_chief_exports_the_trained_model_when_training_succeeds(tmp_path, mnist5k, fmt, name):
    final = _train(tmp_path, mnist5k, "--export", f"out/{name}", "--export-format", fmt)
    assert final["export"] == str(tmp_path / "out" / name)
    assert ev_mod.read_done(tmp_path).export == final["export"]
    if fmt == "keras":
        config, weights = read_keras(final["export"])
        assert config["class_name"] == "Sequential" and len(weights) == 6
    else:
        import onnx

        onnx.checker.check_model(onnx.load(final["export"]))


def test_no_export_without_the_flag_and_none_when_stopped(tmp_path, mnist5k):
    assert "export" not in _train(tmp_path / "a", mnist5k)
    cfg = TrainerConfig.from_args(
        ["--dataset", "mnist-5k", "--steps", "5", "--export", str(tmp_path / "m.keras")], {}
    )
    t = Trainer(cfg, LocalCollective(), dataset=mnist5k, out=io.StringIO())
    t.stop_requested.set()
    try:
        assert t.run()["terminated"] and not (tmp_path / "m.keras").exists()
    finally:
        t.close()


#: Reshape → Conv2D → BatchNormalization → Flatten → Dense; momentum 0.5 so that six steps move
#: the moving statistics far from their initial (0, 1)
BN_MODEL = json.dumps(
    {
        "class_name": "Sequential",
        "config": {
            "name": "bn",
            "layers": [
                {"class_name": "InputLayer", "config": {"batch_input_shape": [None, 28, 28]}},
                {"class_name": "Reshape", "config": {"name": "r", "target_shape": [28, 28, 1]}},
                {
                    "class_name": "Conv2D",
                    "config": {"name": "c", "filters": 4, "kernel_size": 3, "strides": 2},
                },
                {"class_name": "BatchNormalization", "config": {"name": "bn", "momentum": 0.5}},
                {"class_name": "Flatten", "config": {"name": "f"}},
                {"class_name": "Dense", "config": {"name": "d", "units": 10}},
            ],
        },
    }
)


def _direct(spec, state, stats, split) -> tuple[float, float]:
    """(mean loss, accuracy) of one in-process forward pass over the whole split."""
    from ringtrain_trainer.engine import model as model_mod

    prog = model_mod.Program(spec, len(split), train=False, state=stats.copy())
    prog.x[:] = split.inputs().reshape(prog.x.shape)
    logits = prog.forward(spec.views(state.params))
    loss = ev_mod.cross_entropy(logits, split.labels) / len(split)
    return loss, float(np.mean(logits.argmax(1) == split.labels))


def test_the_evaluator_evaluates_with_the_checkpoints_moving_statistics(tmp_path, mnist5k):
    """It once evaluated a BatchNormalization model with fresh statistics (≈10 % for a 74 %
    model): its numbers must be those of the trained statistics, which differ from fresh."""
    final = _train(tmp_path, mnist5k, "--model", BN_MODEL)
    e = _evaluator(tmp_path, mnist5k, model=BN_MODEL)
    state = e.ckpt.load(e.ckpt.manifests()[-1])
    fresh = e.spec.init_state()
    assert state.model_state.shape == fresh.shape
    assert np.abs(state.model_state - fresh).max() > 0.1  # the statistics moved
    loss, acc = e.evaluate(state)
    trained = _direct(e.spec, state, state.model_state, mnist5k.test)
    untrained = _direct(e.spec, state, fresh, mnist5k.test)
    assert (loss, acc) == pytest.approx(trained, rel=1e-5)
    assert abs(untrained[0] - loss) > 0.05 * loss  # so this test can fail
    assert e.run().test_accuracy == pytest.approx(final["test_accuracy"], abs=1e-6)


def test_a_checkpoint_without_the_models_state_is_refused_naming_file_and_entry(tmp_path, mnist5k):
    """Evaluator, resume and export alike: no silent fallback to fresh moving statistics."""
    from ringtrain_trainer.checkpoint.store import CheckpointManager, TrainingState
    from ringtrain_trainer.data.dataset import Position
    from ringtrain_trainer.export import cli as export_cli

    e = _evaluator(tmp_path, mnist5k, model=BN_MODEL)
    CheckpointManager(tmp_path).save(
        TrainingState(1, Position(0, 1, 32), e.spec.init(0), "sgd", model=BN_MODEL)
    )
    state = e.ckpt.load(e.ckpt.manifests()[-1])
    want = r"ckpt-0000000001\.npz: no 'model_state' array, but model .* needs 8 values .*"
    want += r"bn\.moving_mean, bn\.moving_variance"
    with pytest.raises(CheckpointError, match=want):
        e.evaluate(state)
    with pytest.raises(CheckpointError, match=want):
        export_cli.export_state(state, tmp_path / "m.keras")
    assert not (tmp_path / "m.keras").exists()
    state.model_state = np.zeros(3, np.float32)
    with pytest.raises(CheckpointError, match=r"'model_state' of shape \(3,\), but model"):
        e.evaluate(state)
    with pytest.raises(CheckpointError, match=want):
        _train(tmp_path, mnist5k, "--model", BN_MODEL, "--optimizer", "sgd")
