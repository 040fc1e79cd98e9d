"""examples/pipelined-model.yaml end to end (issue 23 item 3): a model the compile step refuses
on one 900 MB IPU trains pipelined over two under `ringtrain run`, and its export opens in real
Keras and its ONNX export runs in onnxruntime, predicting what ringtrain predicts."""

from __future__ import annotations

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

pytestmark = [
    pytest.mark.slow,  # two workers at batch 256 through five convolutions: ~40 s on 2 cores
    pytest.mark.filterwarnings(
        "ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning"
    ),
]

import keras  # noqa: E402  (never skipped: the issue requires the comparison with Keras)
import onnxruntime as ort  # noqa: E402

from ringtrain_trainer.checkpoint.store import CheckpointManager  # noqa: E402
from ringtrain_trainer.data import dataset as data_mod  # noqa: E402
from ringtrain_trainer.engine import model as model_mod  # noqa: E402
from ringtrain_trainer.keras import load as keras_load  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pipelined-model.yaml"
RUN = [*CLI, "run"]


def _probabilities(manifest: str, x: np.ndarray) -> np.ndarray:
    state = CheckpointManager(Path(manifest).parent).load(manifest)
    spec = keras_load.build(state.model)
    prog = model_mod.Program(spec, len(x), train=False, state=state.model_state)
    np.copyto(prog.x, x.reshape(prog.x.shape))
    logits = prog.forward(spec.views(state.params)).astype(np.float64)
    e = np.exp(logits - logits.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def test_refused_on_one_ipu_the_example_trains_pipelined_and_exports(tmp_path):
    doc = yaml.safe_load(EXAMPLE.read_text())
    unpipelined = json.loads(json.dumps(doc))
    del unpipelined["spec"]["trainer"]["pipeline"]
    # the step's 4 micro-batches of 64 as one batch of 256 on one IPU
    unpipelined["spec"]["trainer"].update(
        ipusPerWorker=1, batchSize=256, gradientAccumulationSteps=1
    )
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump(unpipelined))
    refused = subprocess.run(
        [*RUN, str(one), "--json", "--run-dir", str(tmp_path / "one")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert refused.returncode != 0
    assert "does not fit the IPU" in refused.stderr and "943,718,400 available" in refused.stderr

    proc = subprocess.run(
        [*RUN, str(EXAMPLE), "--json", "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pipeline (Grouped schedule; Interleaved is not implemented): stage 1" in proc.stderr
    assert (
        "global batch 512 = micro-batch 64 x gradient accumulation 4 (the pipeline's depth) "
        "x replicas 1 x workers 2"
    ) in proc.stderr
    final = json.loads(proc.stdout.strip().splitlines()[-1])
    assert final["phase"] == "Succeeded" and final["steps"] == 3

    test = data_mod.load("mnist-5k").test
    x = (test.images[:64] / np.float32(255)).astype(np.float32)
    expected = _probabilities(final["checkpoint"], x)
    model = keras.saving.load_model(final["export"])
    got = model.predict(x.reshape(len(x), 28, 28), verbose=0)
    np.testing.assert_allclose(got, expected, atol=1e-4)

    onnx_path = tmp_path / "model.onnx"
    exported = subprocess.run(
        [*CLI, "export", final["checkpoint"], "-o", str(onnx_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert exported.returncode == 0, exported.stderr
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    feed = {sess.get_inputs()[0].name: x.reshape(len(x), 28, 28)}
    (onnx_out,) = sess.run(None, feed)
    np.testing.assert_allclose(onnx_out, expected, atol=1e-4)
