"""Run one engine op through its protocol outside a Program, as the Program would: buffers
planned once, ``bind``, ``forward``, ``backward_local``, ``backward_input``,
``backward_weights`` (whole and in row blocks); and check it against finite differences with
the suite's one helper (``support.gradcheck``)."""

from __future__ import annotations

import itertools

import numpy as np

from support.gradcheck import gradcheck


def compile_op(op, b: int, train: bool = True, dtype=np.float64) -> dict:
    ws = {
        k: np.zeros(s, dtype if t == "f" else np.bool_)
        for k, (s, t) in op.buffers(b, train, need_dx=train).items()
    }
    ws["ctx"] = {"seed": 5, "step": 2, "example0": 4}
    op.bind(ws, b)
    return ws


def forward(op, x: np.ndarray, params: dict, dtype=np.float64) -> np.ndarray:
    """The op's evaluation-program output for ``x`` (a copy)."""
    ws = compile_op(op, x.shape[0], train=False, dtype=dtype)
    return np.array(
        op.forward(ws, x.astype(dtype), **{k: v.astype(dtype) for k, v in params.items()})
    )


def random_params(op, rng) -> dict[str, np.ndarray]:
    return {p.name: rng.normal(0.0, 0.5, p.shape) for p in op.params(0)}


def check_gradients(op, rng, b: int = 2, samples: int = 24, x=None, params=None) -> None:
    """Input and weight gradients of ``sum(out * w)`` against finite differences (float64),
    and every weight gradient cut in row blocks equal to the whole."""
    ws = compile_op(op, b)
    x = rng.normal(size=(b, *op.in_shape)) if x is None else x
    params = random_params(op, rng) if params is None else params
    w = rng.normal(size=(b, *op.out_shape))

    def loss() -> float:
        return float(np.sum(op.forward(ws, x, **params) * w))

    loss()
    op.backward_local(ws, w)
    dx = np.array(op.backward_input(ws, w, **params))
    grads = {}
    for p in op.params(0):
        grads[p.name] = np.zeros(p.shape)
        op.backward_weights(ws, w, p.name, grads[p.name], (0, p.rows))
        blocks = np.full(p.shape, np.nan)
        cut = [0, *sorted({max(1, p.rows // 3), max(1, 2 * p.rows // 3)}), p.rows]
        for lo, hi in itertools.pairwise(cut):
            if hi > lo:
                op.backward_weights(ws, w, p.name, blocks, (lo, hi))
        np.testing.assert_allclose(blocks, grads[p.name], rtol=1e-12, atol=1e-14)
    gradcheck(loss, x, dx, rng=rng, samples=samples, what=f"{type(op).__name__} input")
    for name, g in grads.items():
        gradcheck(
            loss, params[name], g, rng=rng, samples=samples, what=f"{type(op).__name__} {name}"
        )
