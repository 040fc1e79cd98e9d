import gc
import itertools
import math
import tracemalloc

import numpy as np
import pytest
from support.gradcheck import check_model

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine import model as M
from ringtrain_trainer.engine.ops import fused
from ringtrain_trainer.keras import load as keras_load


def loss_fn(prog, views):
    return prog.loss_and_dlogits(prog.forward(views))


def backward(prog, params, grads, on_piece=None):
    """The production path, drained: ``Program.backward_pieces``."""
    for piece in prog.backward_pieces(params, grads):
        if on_piece is not None:
            on_piece(*piece)


def layer_backward(layer, ws, dout, kernel, dkernel, dbias):
    """One layer's backward as whole products: its local gradient, each weight gradient in one
    piece, then the input gradient (None without an input-gradient buffer)."""
    layer.backward_local(ws, dout)
    layer.backward_weights(ws, dout, "bias", dbias, (0, 1))
    layer.backward_weights(ws, dout, "kernel", dkernel, (0, dkernel.size // dkernel.shape[-1]))
    return layer.backward_input(ws, dout, kernel, None) if "dx" in ws else None


@pytest.mark.parametrize("name", ["cnn", "cnn2"])
def test_gradients_match_finite_differences(name, rng):
    """Central differences in float64 on every parameter tensor (a sample of entries each)."""
    spec = keras_load.build(name)
    flat = spec.init(3, np.float64) + rng.normal(0, 0.02, spec.num_params)  # nonzero biases
    grad = np.zeros_like(flat)
    views, gviews = spec.views(flat), spec.views(grad)
    prog = M.Program(spec, 3, True, np.float64)
    prog.x[:] = rng.random(prog.x.shape)
    prog.labels[:] = [1, 7, 3]
    loss_fn(prog, views)
    backward(prog, views, gviews)
    check_model(spec, flat, grad, lambda: loss_fn(prog, views), rng, samples=12)


def test_float32_program_matches_float64(rng):
    spec = keras_load.build("cnn")
    p64 = spec.init(0, np.float64)
    g64, g32 = np.zeros_like(p64), np.zeros(spec.num_params, np.float32)
    a, b = M.Program(spec, 8, True, np.float64), M.Program(spec, 8, True, np.float32)
    a.x[:] = b.x[:] = rng.random(a.x.shape)
    a.labels[:] = b.labels[:] = rng.integers(0, 10, 8)
    la = loss_fn(a, spec.views(p64))
    lb = loss_fn(b, spec.views(p64.astype(np.float32)))
    backward(a, spec.views(p64), spec.views(g64))
    backward(b, spec.views(p64.astype(np.float32)), spec.views(g32))
    assert lb == pytest.approx(la, rel=1e-5)
    np.testing.assert_allclose(g32, g64, rtol=1e-3, atol=1e-6)


def test_parameters_are_views_in_reverse_layer_order():
    spec = keras_load.build("cnn")
    order = [(s.spec.layer, s.spec.name) for s in spec.slots]
    assert order == [
        (2, "bias"),
        (2, "kernel"),
        (1, "bias"),
        (1, "kernel"),
        (0, "bias"),
        (0, "kernel"),
    ]
    assert spec.num_params == 32 * 9 + 32 + 13 * 13 * 32 * 64 + 64 + 64 * 10 + 10
    flat = np.zeros(spec.num_params, np.float32)
    views = spec.views(flat)
    views[0]["kernel"][...] = 1
    assert flat[-32 * 9 :].sum() == 32 * 9 and flat[: -32 * 9].sum() == 0
    assert views[2]["bias"].base is flat or np.shares_memory(views[2]["bias"], flat)
    starts = [spec.layer_ranges[i] for i in (2, 1, 0)]
    assert starts[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(starts))


@pytest.mark.parametrize("name", ["cnn", "cnn2"])
def test_gradient_pieces_tile_the_flat_buffer_in_streaming_order(name):
    spec = keras_load.build(name)
    pieces = spec.grad_pieces
    assert pieces[0][0] == 0 and pieces[-1][1] == spec.num_params
    assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
    # grouped by parameter for the reducer: the same pieces, each parameter's sizes
    assert [n for p in spec.param_pieces for n in p] == [b - a for a, b in pieces]
    assert [sum(p) for p in spec.param_pieces] == [s.stop - s.start for s in spec.slots]
    # a large kernel streams in row blocks of at most GRAD_BLOCK_ELEMS, whole rows each
    dense = spec.layers[-2]
    start, stop = spec.layer_ranges[len(spec.layers) - 2]
    blocks = [(a, b) for a, b in pieces if start + dense.n_out <= a and b <= stop]
    assert len(blocks) == -(-dense.n_in * dense.n_out // M.GRAD_BLOCK_ELEMS) > 1
    assert all((b - a) % dense.n_out == 0 and b - a <= M.GRAD_BLOCK_ELEMS for a, b in blocks)


@pytest.mark.parametrize("grads_first", [False, True])
def test_streaming_in_pieces_gives_the_whole_layer_gradient(rng, grads_first):
    """Row blocks ``x[:, rows]^T dz`` and either order of dW and dX change nothing."""
    spec = keras_load.build("cnn2")
    params = spec.init(1)
    whole, pieced = np.zeros_like(params), np.zeros_like(params)
    ref, prog = M.Program(spec, 6, True), M.Program(spec, 6, True, grads_first=grads_first)
    ref.x[:] = prog.x[:] = rng.random(ref.x.shape, dtype=np.float32)
    ref.labels[:] = prog.labels[:] = rng.integers(0, 10, 6)
    views = spec.views(params)
    loss_fn(ref, views)
    loss_fn(prog, views)
    # the reference: every layer's backward in one call, as the whole matrix products
    g = ref.dlogits
    for i in reversed(range(len(spec.layers))):
        gv = spec.views(whole)[i]
        g = layer_backward(
            spec.layers[i], ref.ws[i], g, views[i]["kernel"], gv["kernel"], gv["bias"]
        )
    seen = []
    backward(
        prog,
        views,
        spec.views(pieced),
        on_piece=lambda a, b: seen.append((a, b, pieced[a:b].copy())),
    )
    assert [(a, b) for a, b, _ in seen] == spec.grad_pieces
    np.testing.assert_allclose(pieced, whole, rtol=1e-6, atol=0)
    # each piece was final when it was streamed
    np.testing.assert_array_equal(np.concatenate([g for _, _, g in seen]), pieced)


def test_glorot_uniform_init_like_keras():
    spec = keras_load.build("cnn")
    flat = spec.init(0)
    v = spec.views(flat)
    for layer, fan_in, fan_out in ((0, 9, 9 * 32), (1, 5408, 64), (2, 64, 10)):
        k = v[layer]["kernel"]
        limit = math.sqrt(6 / (fan_in + fan_out))
        assert np.abs(k).max() <= limit and np.abs(k).max() > 0.9 * limit
        assert k.std() == pytest.approx(limit / math.sqrt(3), rel=0.1)
        assert not v[layer]["bias"].any()
    np.testing.assert_array_equal(flat, spec.init(0))
    assert not np.array_equal(flat, spec.init(1))


def test_steps_allocate_nothing_proportional_to_the_model(rng):
    """Peak traced allocation per step stays tiny and does not grow with the number of steps."""
    spec = keras_load.build("cnn")
    flat, grad = spec.init(0), np.zeros(spec.num_params, np.float32)
    views, gviews = spec.views(flat), spec.views(grad)
    prog = M.Program(spec, 64, True)
    prog.x[:] = rng.random(prog.x.shape)

    def steps(n):
        for _ in range(n):
            loss_fn(prog, views)
            backward(prog, views, gviews)

    steps(2)
    peaks = []
    for n in (3, 30):
        tracemalloc.start()
        steps(n)
        peaks.append(tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    assert peaks[1] <= peaks[0] + 4096
    assert peaks[1] < 64 * 1024, peaks  # activations alone are ~10 MB


def test_unknown_model_is_invalid_spec():
    with pytest.raises(InvalidSpec, match="--model: unknown model 'vgg'"):
        keras_load.build("vgg")


def test_whole_training_step_memory_does_not_grow(mnist5k):
    """The trainer's full step (data, IPU, reducer, optimizer, metrics) at steady state."""
    import io
    import resource

    from ringtrain_trainer.collective import LocalCollective
    from ringtrain_trainer.config import TrainerConfig
    from ringtrain_trainer.worker import Trainer

    t = Trainer(
        TrainerConfig(dataset="mnist-5k", steps=10**6, batch_size=64),
        LocalCollective(),
        mnist5k,
        out=io.StringIO(),
    )
    try:
        for _ in range(3):
            t.train_one_step()
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        gc.collect()
        tracemalloc.start()
        held = []
        for n in (5, 50):
            for _ in range(n):
                t.train_one_step()
            gc.collect()
            held.append(tracemalloc.get_traced_memory()[0])
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    finally:
        t.close()
    assert held[1] - held[0] < 4096, held  # nothing accumulates from step to step
    assert peak < 256 * 1024, peak  # a step's transient Python objects; activations are ~10 MB
    assert rss_after - rss_before < 2048  # KiB: the peak RSS did not move over 55 steps


def test_max_pool_ties_send_the_gradient_to_the_first_maximum(rng):
    """TensorFlow's rule: with equal values in a window only the first (top-left) one gets the
    gradient; giving it to every tied position would double-count."""
    layer = fused.ConvPool((6, 6, 1), 4)
    ws = {
        k: np.zeros(shape, np.float64 if t == "f" else np.bool_)
        for k, (shape, t) in layer.buffers(2, True, need_dx=False).items()
    }
    layer.bind(ws, 2)
    x = np.full((2, 6, 6, 1), 0.5)  # every conv output in a window is the same
    kernel = rng.normal(size=(3, 3, 1, 4))
    bias = np.full(4, 10.0)  # keep every ReLU open
    layer.forward(ws, x, kernel, bias)
    dout = rng.normal(size=(2, 2, 2, 4))
    layer_backward(layer, ws, dout, kernel, np.zeros_like(kernel), np.zeros(4))
    d4 = ws["dconv4"]
    np.testing.assert_array_equal(d4[0], dout)
    assert not d4[1:].any()
