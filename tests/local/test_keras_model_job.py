"""examples/keras-model.yaml end to end: an inline Keras model trained by `ringtrain run`, its
export opened by real Keras. The one module of tests/local that imports TensorFlow (~10 s);
refusals of an inline model before anything runs are here too."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml
from support.procs import CLI

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")

pytestmark = pytest.mark.filterwarnings(
    "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
)

import keras  # noqa: E402  (never skipped: the issue requires the comparison with Keras)

from ringtrain_trainer.checkpoint.store import CheckpointManager  # noqa: E402
from ringtrain_trainer.collective import LocalCollective  # noqa: E402
from ringtrain_trainer.config import TrainerConfig  # noqa: E402
from ringtrain_trainer.data import dataset as data_mod  # noqa: E402
from ringtrain_trainer.engine import model as model_mod  # noqa: E402
from ringtrain_trainer.keras import load as keras_load  # noqa: E402
from ringtrain_trainer.worker import Trainer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "keras-model.yaml"
RUN = [*CLI, "run"]


def _ringtrain_probabilities(manifest: str, x: np.ndarray) -> np.ndarray:
    """What ringtrain predicts from the checkpoint: its forward gives logits (the model's final
    softmax is folded into the loss), so the softmax is applied here."""
    state = CheckpointManager(Path(manifest).parent).load(manifest)
    spec = keras_load.build(state.model)  # the inline config, as the checkpoint recorded it
    prog = model_mod.Program(spec, len(x), train=False, state=state.model_state)
    np.copyto(prog.x, x.reshape(prog.x.shape))
    logits = prog.forward(spec.views(state.params)).astype(np.float64)
    e = np.exp(logits - logits.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def test_the_keras_model_example_trains_and_keras_loads_what_it_exports(tmp_path):
    proc = subprocess.run(
        [*RUN, str(EXAMPLE), "--json", "--run-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    assert final["phase"] == "Succeeded" and final["steps"] == 40
    assert final["export"] == str(tmp_path / "checkpoints" / "model.keras")
    assert final["test_accuracy"] >= 0.5  # chance is 0.10

    test = data_mod.load("mnist-5k").test
    x = (test.images[:200] / np.float32(255)).astype(np.float32)  # what the trainer fed it
    expected = _ringtrain_probabilities(final["checkpoint"], x)
    model = keras.saving.load_model(final["export"])
    assert [type(layer).__name__ for layer in model.layers] == [
        "Reshape",
        "Conv2D",
        "MaxPooling2D",
        "Conv2D",
        "MaxPooling2D",
        "Flatten",
        "Dense",
        "Dense",
    ]
    got = model.predict(x.reshape(len(x), 28, 28), verbose=0)
    assert np.abs(got - expected).max() <= 1e-4 * max(1.0, float(np.abs(expected).max()))
    assert (got.argmax(1) == expected.argmax(1)).all()

    # Round trip: the exported file given back as the model starts from exactly its weights,
    # which are the chief's final checkpoint.
    state = CheckpointManager(Path(final["checkpoint"]).parent).load(final["checkpoint"])
    again = Trainer(
        TrainerConfig(model=final["export"], dataset="mnist-5k", steps=1, batch_size=16),
        LocalCollective(),
        out=io.StringIO(),
    )
    try:
        np.testing.assert_array_equal(again.params, state.params)
    finally:
        again.close()


def test_ringtrain_run_refuses_an_unsupported_inline_model_before_starting_anything(tmp_path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    dense = doc["spec"]["trainer"]["model"]["config"]["layers"][-2]["config"]
    dense["kernel_regularizer"] = {"class_name": "OrthogonalRegularizer", "config": {}}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(doc))
    proc = subprocess.run(
        [*RUN, str(bad), "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "spec.trainer.model: layer 'dense' (Dense): kernel_regularizer=" in proc.stderr
    assert not (tmp_path / "run" / "pods").exists()  # no process was started
