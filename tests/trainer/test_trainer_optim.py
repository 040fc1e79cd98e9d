import math
from itertools import pairwise

import numpy as np
import pytest

from ringtrain.errors import InvalidSpec
from ringtrain_trainer import optim as O


def reference(name, w, grads, lrs, momentum=0.9, b1=0.9, b2=0.999, eps=1e-7):
    """Textbook tf.keras update rules in float64, one whole-vector step at a time."""
    w = w.astype(np.float64).copy()
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, (g, lr) in enumerate(zip(grads, lrs, strict=True), start=1):
        g = g.astype(np.float64)
        if name == "sgd":
            w = w - lr * g
        elif name == "momentum":
            m = momentum * m - lr * g
            w = w + m
        else:
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            alpha = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
            w = w - alpha * m / (np.sqrt(v) + eps)
    return w


@pytest.mark.parametrize("name", ["sgd", "momentum", "adam"])
def test_matches_reference_when_applied_slice_by_slice(name, rng):
    n = 1000
    w0 = rng.normal(size=n).astype(np.float32)
    grads = [rng.normal(size=n).astype(np.float32) for _ in range(25)]
    schedule = O.StepDecay(0.01, 0.5, 2)
    epochs = [i // 5 for i in range(25)]  # 5 steps per epoch
    params = w0.copy()
    opt = O.build(name, params, schedule)
    cuts = [0, 10, 11, 400, 1000]  # uneven "layers", applied last first like the reducer does
    g = np.zeros(n, np.float32)
    for grad, epoch in zip(grads, epochs, strict=True):
        np.copyto(g, grad)
        opt.begin_step(epoch)
        for a, b in reversed(list(pairwise(cuts))):
            opt.apply(g, a, b)
    want = reference(name, w0, grads, [schedule(e) for e in epochs])
    np.testing.assert_allclose(params, want, rtol=2e-5, atol=2e-6)
    assert opt.iterations == 25


def test_step_decay_schedule():
    s = O.StepDecay(1e-3, 0.1, 2)
    assert [s(e) for e in range(5)] == pytest.approx([1e-3, 1e-3, 1e-4, 1e-4, 1e-5])
    assert O.StepDecay(0.5)(100) == 0.5


def test_state_is_host_side_and_sized_like_the_parameters():
    p = np.zeros(100, np.float32)
    assert O.build("sgd", p, O.StepDecay()).state_bytes == 0 == O.state_bytes_for("sgd", 100)
    momentum = O.build("momentum", p, O.StepDecay())
    assert momentum.state_bytes == 400 == O.state_bytes_for("momentum", 100)
    assert O.build("adam", p, O.StepDecay()).state_bytes == 800 == O.state_bytes_for("adam", 100)
    with pytest.raises(InvalidSpec, match="--optimizer: unknown optimizer 'lamb'"):
        O.build("lamb", p, O.StepDecay())


def test_load_state_restores_exactly(rng):
    p1 = rng.normal(size=50).astype(np.float32)
    p2 = p1.copy()
    a, b = O.build("adam", p1, O.StepDecay()), O.build("adam", p2, O.StepDecay())
    g = rng.normal(size=50).astype(np.float32)
    for _ in range(3):
        a.begin_step(0)
        a.apply(g, 0, 50)
    np.copyto(p2, p1)
    b.load_state({k: v.copy() for k, v in a.state_dict().items()}, a.iterations)
    for opt in (a, b):
        opt.begin_step(0)
        opt.apply(g, 0, 50)
    np.testing.assert_array_equal(p1, p2)
