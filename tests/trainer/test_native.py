"""The engine's compiled kernels (``engine._native``): built by the install, and the same
arithmetic as the numpy path they replace.

The C kernel fuses the seeds' first layer (Conv2D 3x3 on one channel, 2x2 max-pool, bias,
ReLU). Its sums run in another order than BLAS's, so values agree to float32 rounding; with
integer inputs every sum is exact, so there the two paths must agree bit for bit, ties
included (a pooled gradient goes to the window's *first* maximum, TensorFlow's rule).
"""

from __future__ import annotations

import numpy as np
import pytest

from ringtrain_trainer.engine import native
from ringtrain_trainer.engine.ops.fused import ConvPool


def test_the_extension_is_built_by_the_install():
    """CI must never pass on the numpy fallback by accident: the install builds the kernels."""
    assert native.kernels is not None, native.describe()
    assert native.describe().startswith("native C (")


def _run(layer, x, kernel, bias, dout, use_native, monkeypatch, need_dx=False):
    if not use_native:
        monkeypatch.setattr(native, "kernels", None)
    b = x.shape[0]
    bufs = layer.buffers(b, True, need_dx)
    ws = {
        k: np.zeros(s, {"f": np.float32, "?": np.bool_, "u": np.uint8}[t])
        for k, (s, t) in bufs.items()
    }
    layer.bind(ws, b)
    monkeypatch.undo()
    assert ws["native_dx" if need_dx else "native"] is use_native
    out = layer.forward(ws, x, kernel, bias).copy()
    layer.backward_local(ws, dout.copy())
    gk, gb = np.zeros_like(kernel), np.zeros_like(bias)
    layer.backward_weights(ws, dout, "kernel", gk, (0, layer.kk))
    layer.backward_weights(ws, dout, "bias", gb, (0, 1))
    if need_dx:
        return out, gk, gb, layer.backward_input(ws, dout, kernel, bias).copy()
    return out, gk, gb


@pytest.mark.parametrize("integers", [True, False], ids=["exact-ties", "random"])
@pytest.mark.parametrize(
    "cin,need_dx,filters",
    [(1, False, 16), (1, False, 32), (1, False, 64), (1, False, 24), (8, True, 16)],
    ids=["first-layer-16", "first-layer-32", "first-layer-64", "first-layer-24", "input-gradient"],
)
def test_fused_conv_pool_relu_matches_the_numpy_path(
    integers, cin, need_dx, filters, monkeypatch, kernel_set
):
    """A first layer runs wholly compiled (3x3 with 16, 32 or 64 filters on the register-held
    kernel path, other multiples of 8 on the general one); a later one (input channels a
    multiple of 8) runs numpy's forward and kernel gradient and the compiled input gradient
    from the winners."""
    rng = np.random.default_rng(3)
    layer = ConvPool((14, 13, cin), filters)
    shape = (5, 14, 13, cin)
    if integers:  # pixels 0..3 and kernel -1..1: many exactly tied windows, exact sums
        x = rng.integers(0, 4, shape).astype(np.float32)
        kernel = rng.integers(-1, 2, (3, 3, cin, filters)).astype(np.float32)
        bias = rng.integers(-2, 3, filters).astype(np.float32)
    else:
        x = rng.random(shape, dtype=np.float32)
        kernel = rng.standard_normal((3, 3, cin, filters)).astype(np.float32)
        bias = 0.1 * rng.standard_normal(filters).astype(np.float32)
    dout = rng.standard_normal((5, 6, 5, filters)).astype(np.float32)
    if integers:
        dout = np.round(dout * 4)  # exact sums of the gradient too
    fast = _run(layer, x, kernel, bias, dout, True, monkeypatch, need_dx)
    slow = _run(layer, x, kernel, bias, dout, False, monkeypatch, need_dx)
    names = ("output", "kernel gradient", "bias gradient", "input gradient")
    for f, s, what in zip(fast, slow, names[: len(fast)], strict=True):
        if integers:
            np.testing.assert_array_equal(f, s, err_msg=what)
        else:
            np.testing.assert_allclose(f, s, rtol=1e-5, atol=1e-5, err_msg=what)
    assert (fast[0] == 0).any() and (fast[0] > 0).any(), "the ReLU both stopped and passed"


def test_the_kernel_is_deterministic_and_refuses_what_it_does_not_compute(monkeypatch):
    rng = np.random.default_rng(4)
    layer = ConvPool((12, 12, 1), 8)
    x = rng.random((3, 12, 12, 1), dtype=np.float32)
    kernel = rng.standard_normal((3, 3, 1, 8)).astype(np.float32)
    bias = np.zeros(8, np.float32)
    dout = rng.standard_normal((3, 5, 5, 8)).astype(np.float32)
    a = _run(layer, x, kernel, bias, dout, True, monkeypatch)
    b = _run(layer, x, kernel, bias, dout, True, monkeypatch)
    for u, v in zip(a, b, strict=True):
        assert u.tobytes() == v.tobytes()
    assert not ConvPool((12, 12, 1), 4).native(False), "filters not a multiple of 8: numpy"
    assert not layer.native(True), "an input gradient: numpy"
    with pytest.raises(ValueError, match="multiple of 8"):
        native.kernels.convpool_forward(
            x,
            kernel[..., :4].copy(),
            bias[:4],
            np.zeros((3, 5, 5, 4), np.float32),
            np.zeros((3, 5, 5, 4), np.uint8),
            3,
            12,
            12,
            1,
            3,
            4,
        )
    with pytest.raises(ValueError, match="out: "):
        native.kernels.convpool_forward(
            x,
            kernel,
            bias,
            np.zeros((3, 5, 5, 7), np.float32),
            np.zeros(1, np.uint8),
            3,
            12,
            12,
            1,
            3,
            8,
        )


def test_a_float64_program_runs_the_numpy_path():
    """The gradient checks run in float64: the float32 kernel must not take them."""
    layer = ConvPool((8, 8, 1), 8)
    bufs = layer.buffers(2, True, False)
    ws = {
        k: np.zeros(s, {"f": np.float64, "?": np.bool_, "u": np.uint8}[t])
        for k, (s, t) in bufs.items()
    }
    layer.bind(ws, 2)
    assert ws["native"] is False and ws["cols"].dtype == np.float64
    x = np.random.default_rng(5).random((2, 8, 8, 1))
    out = layer.forward(ws, x, np.ones((3, 3, 1, 8)), np.zeros(8))
    assert out.dtype == np.float64 and out.shape == (2, 3, 3, 8)


@pytest.mark.parametrize("weight_decay", [None, 0.01], ids=["adam", "adamw"])
def test_the_one_pass_adam_step_gives_the_numpy_steps_bits(weight_decay, kernel_set):
    """Same float32 operations in the same order per element: bit-identical over steps."""
    from ringtrain_trainer.optim.adam import Adam
    from ringtrain_trainer.optim.schedules import StepDecay

    rng = np.random.default_rng(6)
    w0 = rng.standard_normal(10_001).astype(np.float32)
    runs = []
    for fused in (True, False):
        w = w0.copy()
        opt = Adam(w, StepDecay(3e-3), weight_decay=weight_decay)
        assert opt.fused is not None
        if not fused:
            opt.fused = None
        for step in range(4):
            g = np.random.default_rng(step).standard_normal(w.size).astype(np.float32)
            opt.begin_step(0)
            opt.apply(g, 0, 6_000)
            opt.apply(g, 6_000, w.size)
        runs.append((w, opt.state["m"], opt.state["v"]))
    for a, b in zip(*runs, strict=True):
        assert a.tobytes() == b.tobytes()
    assert not np.array_equal(runs[0][0], w0)


def test_adam_split_over_threads_changes_no_bit(kernel_set):
    """A large slice runs on several threads; elementwise, so the bits are those of one."""
    rng = np.random.default_rng(7)
    n = 300_001
    g = rng.standard_normal(n).astype(np.float32)
    start = [rng.standard_normal(n).astype(np.float32) for _ in range(3)]
    out = []
    for threads in (1, 2, 3):
        w, m, v = (a.copy() for a in start)
        v = np.abs(v)
        native.kernels.adam_update(g, w, m, v, 0.1, 0.001, 1e-7, 0.01, threads)
        out.append(w.tobytes() + m.tobytes() + v.tobytes())
    assert out[0] == out[1] == out[2]
    assert not np.array_equal(np.frombuffer(out[0][: 4 * n], np.float32), start[0])


@pytest.mark.parametrize("filters", [8, 32])
def test_a_non_finite_input_stays_non_finite_as_in_numpy(filters, monkeypatch, kernel_set):
    """An overflow (float16's inf) must reach the non-finite check: NaN survives the max and
    the ReLU, as numpy's maximum keeps it, and inf stays inf."""
    rng = np.random.default_rng(8)
    layer = ConvPool((8, 8, 1), filters)
    x = rng.random((2, 8, 8, 1), dtype=np.float32)
    x[0, 2, 2, 0], x[1, 5, 5, 0] = np.inf, np.nan
    kernel = rng.standard_normal((3, 3, 1, filters)).astype(np.float32)
    bias = np.zeros(filters, np.float32)
    dout = np.ones((2, 3, 3, filters), np.float32)
    fast = _run(layer, x, kernel, bias, dout, True, monkeypatch)[0]
    with np.errstate(invalid="ignore"):
        slow = _run(layer, x, kernel, bias, dout, False, monkeypatch)[0]
    np.testing.assert_array_equal(np.isnan(fast), np.isnan(slow))
    np.testing.assert_allclose(fast[np.isfinite(slow)], slow[np.isfinite(slow)], rtol=1e-5)
    assert np.isnan(fast).any() and not np.isfinite(fast[0]).all()


def _kernel_outputs(rng) -> list[bytes]:
    """Every kernel on random float32 inputs: first layers on both conv paths, an input
    gradient, an Adam step."""
    k = native.kernels
    out = []
    for filters in (8, 16, 32, 64):
        x = rng.random((3, 12, 11, 1), dtype=np.float32)
        w = rng.standard_normal((3, 3, 1, filters)).astype(np.float32)
        bias = 0.1 * rng.standard_normal(filters).astype(np.float32)
        y, idx = np.zeros((3, 5, 4, filters), np.float32), np.zeros((3, 5, 4, filters), np.uint8)
        k.convpool_forward(x, w, bias, y, idx, 3, 12, 11, 1, 3, filters)
        dout = rng.standard_normal(y.shape).astype(np.float32)
        dw, db = np.zeros_like(w), np.zeros_like(bias)
        k.convpool_backward(x, dout, idx, dw, db, 3, 12, 11, 1, 3, filters)
        out += [y.tobytes(), idx.tobytes(), dw.tobytes(), db.tobytes()]
    kt = rng.standard_normal((3, 3, 8, 8)).astype(np.float32)
    dx = np.zeros((3, 12, 11, 8), np.float32)
    k.convpool_input_grad(kt, dout[..., :8].copy(), idx[..., :8].copy(), dx, 3, 12, 11, 8, 3, 8)
    g, w, m, v = (rng.standard_normal(5_003).astype(np.float32) for _ in range(4))
    v = np.abs(v)
    k.adam_update(g, w, m, v, 0.1, 0.001, 1e-7, 0.01)
    out += [dx.tobytes(), w.tobytes(), m.tobytes(), v.tobytes()]
    for n in (6, 16, 48, 64):  # the GEMM: plain, transposed-A and transposed-B products
        a = rng.standard_normal((37, 300)).astype(np.float32)
        b = rng.standard_normal((300, n)).astype(np.float32)
        c, ct = np.zeros((37, n), np.float32), np.zeros((300, n), np.float32)
        k.gemm(a, native.offsets((37, 300)), native.offsets((300, 1)), b, c, n)
        k.gemm(a, native.offsets((300, 1)), native.offsets((37, 300)), c, ct, n)
        w_nt, c_nt = rng.standard_normal((n, 40)).astype(np.float32), np.zeros((37, n), np.float32)
        out += [c.tobytes(), ct.tobytes()]
        if n % 16 == 0:
            k.gemm_nt(a[:, :40].copy(), w_nt, c_nt, 37, n, 40)
            out.append(c_nt.tobytes())
    conv = rng.standard_normal((4, 30, 16)).astype(np.float32)
    pooled, win = np.zeros((30, 16), np.float32), np.zeros((30, 16), np.uint8)
    k.pool_relu(conv, bias[:16].copy(), pooled, win, 30, 16)
    dconv = np.zeros_like(conv)
    k.unpool(pooled, win, dconv, 30, 16)
    out += [pooled.tobytes(), win.tobytes(), dconv.tobytes()]
    for c, mult in ((8, 1), (3, 2)):  # depthwise: the vectorised and the general loop
        dims = (2, 9, 8, c, mult, 3, 3, 1, 1, 1, 1, 7, 6)
        xp = rng.standard_normal((2, 9, 8, c)).astype(np.float32)
        w = rng.standard_normal((3, 3, c, mult)).astype(np.float32)
        z, dz = np.zeros((2, 7, 6, c * mult), np.float32), rng.standard_normal((2, 7, 6, c * mult))
        k.depthwise_forward(xp, w, z, dims)
        dw, dxp = np.zeros_like(w), np.zeros_like(xp)
        k.depthwise_backward(xp, dz.astype(np.float32), w, dw, dxp, dims)
        out += [z.tobytes(), dw.tobytes(), dxp.tobytes()]
    acc = rng.standard_normal(1_003).astype(np.float32)
    k.add_scale(acc, rng.standard_normal(1_003).astype(np.float32), 0.37)
    return [*out, acc.tobytes()]


@pytest.mark.parametrize("transposed", ["", "a", "b"])
def test_the_gemm_is_numpys_product(transposed, kernel_set):
    """The compiled GEMM's three forms against numpy's float64 product, at widths that fill its
    vectors and widths that leave a partial one, with rows left over from its 6-row tiles; bad
    shapes are refused, not read past."""
    rng = np.random.default_rng(10)
    k = native.kernels
    for n in (16, 32, 48, 64) if transposed == "b" else (1, 6, 16, 20, 32, 48, 64, 70):
        a = rng.standard_normal((13, 200)).astype(np.float32)
        if transposed == "a":  # out (200 x n) = a^T @ d
            d = rng.standard_normal((13, n)).astype(np.float32)
            got = np.zeros((200, n), np.float32)
            k.gemm(a, native.offsets((200, 1)), native.offsets((13, 200)), d, got, n)
            want = a.T.astype(np.float64) @ d
        elif transposed == "b":  # out (13 x n) = a[:, :64] @ w^T
            w = rng.standard_normal((n, 64)).astype(np.float32)
            got = np.zeros((13, n), np.float32)
            k.gemm_nt(a[:, :64].copy(), w, got, 13, n, 64)
            want = a[:, :64].astype(np.float64) @ w.T
        else:
            b = rng.standard_normal((200, n)).astype(np.float32)
            got = np.zeros((13, n), np.float32)
            k.gemm(a, native.offsets((13, 200)), native.offsets((200, 1)), b, got, n)
            want = a.astype(np.float64) @ b
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    b = np.zeros((200, 16), np.float32)
    with pytest.raises(ValueError, match="outside a"):
        k.gemm(a, native.offsets((14, 200)), native.offsets((200, 1)), b, np.zeros((14, 16)), 16)
    with pytest.raises(ValueError, match="b: "):
        k.gemm(a, native.offsets((13, 200)), native.offsets((200, 1)), b, np.zeros((13, 8)), 8)


def test_every_kernel_set_gives_the_same_bits():
    """Replicas on different CPUs must agree bit for bit: the AVX-512, AVX2+FMA and baseline
    sets (fused multiply-adds by vfmadd or the C library's exact fmaf) give the same values,
    every kernel (the depthwise ones and add_scale too), forced as RINGTRAIN_KERNELS forces."""
    here = native.kernels.isa()
    sets = native.available()
    assert here == native.WIDEST == sets[0] and len(sets) >= 2, sets
    results = {}
    try:
        for name in sets:
            native.force(name)
            assert native.kernels.isa() == name
            results[name] = _kernel_outputs(np.random.default_rng(9))
    finally:
        native.force(here)
    assert all(any(b) for b in results[here]), "every kernel wrote something"
    for name in sets[1:]:
        pairs = zip(results[name], results[here], strict=True)
        differ = [i for i, (a, b) in enumerate(pairs) if a != b]
        assert not differ, f"{name} differs from {here} in outputs {differ}"
    with pytest.raises(ValueError, match="no kernel set"):
        native.kernels.use("sse9")


def test_the_startup_line_names_each_layers_compiled_parts():
    """Say what runs: seed 002's model names its fused first layer, the second conv-pool's
    compiled pooling and input gradient, and (where the GEMM runs here) its products."""
    from ringtrain_bench.ipu_side import IPUSide
    from ringtrain_bench.step import parser
    from ringtrain_trainer.telemetry import startup

    side = IPUSide(parser().parse_args(["--model", "cnn2", "--threads", "1", "--no-torch"]))
    try:
        line = startup.kernels_line(side.trainer.ipu.spec, side.trainer.exe)
    finally:
        side.close()
    assert line.startswith(f"compiled kernels: {native.describe()} for "), line
    assert "(conv + 2x2 max-pool + bias + ReLU fused)" in line, line
    assert "2x2 max-pool + bias + ReLU, " in line and "input gradient" in line, line
    assert ("GEMM, input read in place" in line) == native.gemm_runs(64, np.float32), line


@pytest.mark.parametrize("n", [1, 7, 8, 9, 347_146])
def test_the_finite_check_finds_every_inf_and_nan(n):
    """The step's divergence check (reducer.hook.finite) reads exponents: every inf and NaN,
    at any position (vector body or tail), on every kernel set; float32's largest finite value,
    subnormals and -0 are finite; a float64 or strided slice takes numpy's exact sum."""
    from ringtrain_trainer.engine.native import finite

    rng = np.random.default_rng(11)
    a = rng.standard_normal(n).astype(np.float32)
    a[0] = np.finfo(np.float32).max
    if n > 2:
        a[1], a[2] = -0.0, np.finfo(np.float32).smallest_subnormal
    here = native.kernels.isa()
    try:
        for name in native.available():
            native.force(name)
            assert finite(a), name
            for bad in (np.inf, -np.inf, np.nan):
                for at in {0, n // 2, n - 1}:
                    b = a.copy()
                    b[at] = bad
                    assert not finite(b), (name, bad, at)
    finally:
        native.force(here)
    assert finite(a.astype(np.float64))
    both = np.full(2 * n, np.inf, np.float32)
    both[::2] = a
    assert finite(both[::2]) and not finite(both[1::2])
