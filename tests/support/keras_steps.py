"""ringtrain and Keras trained side by side from one ``.keras`` file on the same batches: the
loop the Keras comparison tests share (the model is compiled by the caller, as its user would)."""

from __future__ import annotations

import io

import numpy as np

from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine import model as M
from ringtrain_trainer.worker import Trainer


def train_beside_keras(km, x, y, tmp_path, steps: int, batch: int, n_train: int | None = None):
    """Save the compiled Keras model ``km`` and ``x``/``y`` (the first ``n_train`` examples
    for training, default three quarters), start a 1-worker :class:`Trainer` on them, and take
    ``steps`` steps on both sides, each on the batch the trainer's sharder picks. ``x`` may be
    a dict by input name (a model with several inputs: ``x_train_<input>`` in the file, the
    dict given to Keras). Returns both losses per step and the trainer (the caller closes it)."""
    km.save(tmp_path / "m.keras")
    n = len(y) * 3 // 4 if n_train is None else n_train
    if isinstance(x, dict):
        xs = {f"x_{split}_{k}": v[sl] for k, v in x.items() for split, sl in _splits(n)}
    else:
        xs = {"x_train": x[:n], "x_test": x[n:]}
    np.savez(tmp_path / "d.npz", **xs, y_train=y[:n], y_test=y[n:])
    args = ["--model", str(tmp_path / "m.keras"), "--data", str(tmp_path / "d.npz")]
    args += ["--steps", str(steps), "--batch-size", str(batch), "--ipu-host-threads", "1"]
    args += ["--json", "--checkpoint-dir", str(tmp_path / "ck")]
    t = Trainer(TrainerConfig.from_args(args, {}), LocalCollective(), out=io.StringIO())
    ours, theirs = [], []
    try:
        for _ in range(steps):
            pos = t.position
            idx = t.sharder.indices(pos.epoch, pos.batch).copy()
            ours.append(t.train_one_step()[0])
            xb = {k: v[idx] for k, v in x.items()} if isinstance(x, dict) else x[idx]
            got = km.train_on_batch(xb, y[idx])  # [loss, *metrics] where compiled with some
            theirs.append(float(got[0] if isinstance(got, list) else got))
    except BaseException:
        t.close()
        raise
    return ours, theirs, t


def _splits(n: int) -> list[tuple[str, slice]]:
    return [("train", slice(None, n)), ("test", slice(n, None))]


def logits(t, x, training: bool = False) -> np.ndarray:
    """What trainer ``t``'s model outputs for ``x`` in inference (its IPU program, outside
    training: no dropout, noise or augmentation), before the softmax the loss folds in;
    ``training``: its training program's forward at seed 1, step 0 (the random layers drawn)."""
    prog = M.Program(t.spec, len(x), training, state=t.ipu.state)
    prog.x[:] = x.reshape(prog.x.shape)
    if training:
        prog.ctx.update(seed=1, step=0, example0=0)
    return prog.forward(t.spec.views(t.params)).copy()


def softmax(z: np.ndarray) -> np.ndarray:
    """Rows of ``z`` as Keras' predict returns a softmax model's output."""
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


def exports_predict(config: dict, weights: list, x: np.ndarray, want: np.ndarray, tmp_path):
    """The ``.keras`` export reloaded by Keras and the ONNX export run by onnxruntime both
    predict ``want`` for ``x`` (atol 2e-5); returns the reloaded Keras model."""
    import keras
    import onnxruntime as ort

    from ringtrain_trainer.export import write_keras, write_onnx

    back = keras.saving.load_model(write_keras(tmp_path / "out.keras", config, weights))
    np.testing.assert_allclose(back.predict(x, verbose=0), want, atol=2e-5)
    write_onnx(tmp_path / "m.onnx", config, weights)
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    (got,) = sess.run(None, {"input": x})
    np.testing.assert_allclose(got, want, atol=2e-5)
    return back


def follows_keras(ours, theirs, weights, km, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """ringtrain's losses per step equal Keras' (``rtol``) and its weights after them equal
    the Keras model's ``get_weights()`` (``rtol``, ``atol``)."""
    np.testing.assert_allclose(ours, theirs, rtol=rtol)
    for a, b in zip(weights, km.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=atol)
