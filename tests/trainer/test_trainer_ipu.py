from itertools import pairwise

import numpy as np
import pytest

from ringtrain.errors import InvalidSpec, IPUCompileError
from ringtrain_trainer import optim as O
from ringtrain_trainer.ipu.device import IPU, MB, IPUConfig
from ringtrain_trainer.keras import load as keras_load


def make_ipu(name="cnn", **cfg):
    spec = keras_load.build(name)
    params = spec.init(0)
    return IPU(spec, IPUConfig(**cfg), params, np.zeros_like(params))


def batch(rng, n):
    return rng.random((n, 28, 28, 1), dtype=np.float32), rng.integers(0, 10, n)


def test_compile_fails_early_with_bytes_needed_and_available():
    ipu = make_ipu(memory_bytes=5 * MB)
    with pytest.raises(IPUCompileError, match=r"\d+ bytes needed .*5,242,880 available") as e:
        ipu.compile(64)
    assert "--ipu-memory-mb" in str(e.value) and ipu.stats.compiles == 0
    assert ipu.compile(4).plan.total <= 5 * MB  # a smaller batch fits


def test_variables_on_host_keep_optimizer_state_off_the_ipu():
    n = keras_load.build("cnn").num_params

    def total(opt, on_host):
        return (
            make_ipu(variables_on_host=on_host, optimizer_state_bytes=O.state_bytes_for(opt, n))
            .compile(64)
            .plan.total
        )

    assert total("sgd", True) == total("adam", True) == total("momentum", True)
    assert total("adam", False) == total("sgd", False) + 2 * n * 4
    assert total("adam", False) > total("adam", True)


def test_compile_once_run_many_and_count_recompiles(rng):
    ipu = make_ipu()
    exe = ipu.compile(32)
    assert ipu.compile(32) is exe
    x, y = batch(rng, 32)
    for _ in range(3):
        ipu.train_step(exe, x, y)
    assert (ipu.stats.compiles, ipu.stats.recompiles) == (1, 0)
    ipu.compile(16)  # a shape change
    assert (ipu.stats.compiles, ipu.stats.recompiles) == (2, 1)
    ipu.compile(16, train=False)  # a different program, not a recompile
    ipu.compile(8, train=False)  # but a second evaluation shape is
    assert (ipu.stats.compiles, ipu.stats.recompiles) == (4, 2)


@pytest.mark.parametrize("on_host", [True, False])
def test_host_streams_are_counted(rng, on_host):
    ipu = make_ipu(variables_on_host=on_host)
    n = ipu.spec.num_params
    exe = ipu.compile(8)
    x, y = batch(rng, 8)
    ipu.train_step(exe, x, y)
    ipu.train_step(exe, x, y)
    s = ipu.stats
    assert s.weights_in_bytes == (2 * n * 4 if on_host else 0)
    assert s.grads_out_bytes == 2 * n * 4
    assert s.data_in_bytes == 2 * (8 * 784 * 4 + 8 * 8)
    assert s.flops == 2 * 8 * ipu.spec.flops_per_example() and s.compute_s > 0


def layers_of(spec, pieces):
    """The layer each streamed (start, stop) piece belongs to."""
    return [
        next(i for i, (lo, hi) in enumerate(spec.layer_ranges) if lo <= a and b <= hi)
        for a, b in pieces
    ]


def test_gradients_stream_out_last_layer_first_as_contiguous_slices(rng):
    ipu = make_ipu("cnn2")
    seen = []
    ipu.train_step(ipu.compile(4), *batch(rng, 4), on_grad=lambda a, b: seen.append((a, b)))
    assert seen == ipu.spec.grad_pieces
    layers = layers_of(ipu.spec, seen)
    assert layers == sorted(layers, reverse=True) and set(layers) == {3, 2, 1, 0}
    assert layers.count(2) > 2  # the large dense kernel streams in row blocks
    assert seen[0][0] == 0 and seen[-1][1] == ipu.spec.num_params
    assert all(a[1] == b[0] for a, b in pairwise(seen))


@pytest.mark.parametrize("on_host", [True, False])
def test_updating_streamed_weights_at_once_does_not_change_later_gradients(rng, on_host):
    """The host optimizer may apply a piece the moment it streams out. With weights resident
    on the IPU that writes the very weights backward reads, so a layer's input gradient must
    be computed before its weight gradients stream (and with weights on the host the IPU's
    copy is untouched, so they may stream first)."""
    x, y = batch(rng, 8)
    calm, eager = (
        make_ipu("cnn2", variables_on_host=on_host),
        make_ipu("cnn2", variables_on_host=on_host),
    )
    calm.train_step(calm.compile(8), x, y)

    def update(a, b):
        eager.host_params[a:b] -= 0.5 * np.sign(eager.host_grads[a:b]) + 0.1

    eager.train_step(eager.compile(8), x, y, on_grad=update)
    np.testing.assert_array_equal(eager.host_grads, calm.host_grads)


@pytest.mark.parametrize("replicas", [2, 4])
def test_replicas_compute_the_gradient_of_the_whole_batch(rng, replicas):
    x, y = batch(rng, 16)
    one, many = make_ipu(), make_ipu(replicas=replicas)
    l1 = one.train_step(one.compile(16), x, y)
    seen = []
    lr = many.train_step(
        many.compile(16), x, y, on_grad=lambda a, b: seen.append(many.host_grads[a:b].copy())
    )
    assert lr == pytest.approx(l1, rel=1e-5)
    np.testing.assert_allclose(many.host_grads, one.host_grads, rtol=1e-4, atol=1e-7)
    # what the consumer saw at each callback was already the averaged gradient
    np.testing.assert_allclose(np.concatenate(seen), one.host_grads, rtol=1e-4, atol=1e-7)
    # each replica is an IPU of its own, planned for its slice of the batch
    assert many.compile(16).plan.activations * replicas == one.compile(16).plan.activations


def test_replicas_must_divide_the_batch():
    with pytest.raises(
        InvalidSpec, match="--batch-size 64 does not divide evenly across --ipus-per-worker 3"
    ):
        make_ipu(replicas=3).compile(64)


def test_evaluate_counts_correct_predictions(mnist5k):
    ipu = make_ipu()
    test = mnist5k.test
    acc = ipu.evaluate(test.images[:700], test.labels[:700], batch=500, scale=test.scale)
    assert 0.0 <= acc <= 0.3  # untrained: about chance, and the padded last batch is ignored


@pytest.mark.parametrize("replicas, threads", [(1, 2), (2, 2), (1, 3)])
def test_host_threads_split_the_batch_and_give_the_same_gradient(rng, replicas, threads):
    x, y = batch(rng, 24)
    one, par = make_ipu(), make_ipu(replicas=replicas, host_threads=threads)
    try:
        l1 = one.train_step(one.compile(24), x, y)
        seen = []
        exe = par.compile(24)
        lp = par.train_step(exe, x, y, on_grad=lambda a, b: seen.append((a, b)))
        assert len(exe.programs) == replicas * threads and len(exe.groups) == threads
        assert lp == pytest.approx(l1, rel=1e-5)
        np.testing.assert_allclose(par.host_grads, one.host_grads, rtol=1e-4, atol=1e-7)
        assert seen == par.spec.grad_pieces
        # the plan is per IPU, whatever the host does
        assert exe.plan == par.plan(24 // replicas, True)
        acc = (
            one.evaluate((x[..., 0] * 255).astype(np.uint8), y, batch=12, scale=1 / 255),
            par.evaluate((x[..., 0] * 255).astype(np.uint8), y, batch=12, scale=1 / 255),
        )
        assert acc[0] == acc[1]
    finally:
        par.close()


def test_a_failing_shard_fails_the_step_and_leaves_no_thread_running(rng):
    ipu = make_ipu(host_threads=2)
    try:
        exe = ipu.compile(8)
        exe.programs[1].dlogits = None  # break shard 1 only, inside its host thread
        x, y = batch(rng, 8)
        with pytest.raises(TypeError):
            ipu.train_step(exe, x, y)
    finally:
        ipu.close()


def test_resident_weights_train_exactly_like_streamed_ones(mnist5k, monkeypatch):
    """With --no-variables-on-host the optimizer updates the very weights the IPU computes
    with, layer by layer during backward; that must change nothing."""
    import io

    from ringtrain_trainer import worker
    from ringtrain_trainer.collective import LocalCollective
    from ringtrain_trainer.config import TrainerConfig
    from ringtrain_trainer.worker import Trainer

    monkeypatch.setattr(worker, "MIN_SHARD_FLOPS", 0)  # this small batch: still two shards

    params = []
    for on_host in (True, False):
        t = Trainer(
            TrainerConfig(
                dataset="mnist-5k",
                steps=20,
                batch_size=32,
                lr=0.01,
                variables_on_host=on_host,
                ipu_host_threads=2,
            ),
            LocalCollective(),
            mnist5k,
            out=io.StringIO(),
        )
        try:
            t.run()
        finally:
            t.close()
        params.append(t.params.copy())
        streamed = t.ipu.stats.weights_in_bytes
        assert streamed >= 20 * t.params.nbytes if on_host else streamed == 0
    np.testing.assert_array_equal(params[0], params[1])


def test_a_batch_too_small_to_pay_for_two_shards_runs_on_one(rng):
    """``min_shard_flops``: a shard costs numpy's per-op overhead whatever its size, so a batch
    with less work than that per shard runs on fewer host threads — same gradient either way."""
    x, y = batch(rng, 24)
    per_example = keras_load.build("cnn").flops_per_example(True)
    small = make_ipu(host_threads=2, min_shard_flops=per_example * 12 + 1)
    big = make_ipu(host_threads=2, min_shard_flops=per_example * 12)
    assert len(small.compile(24).programs) == 1 and len(big.compile(24).programs) == 2
    assert len(small.compile(48).programs) == 2  # twice the batch: worth two shards
    small.train_step(small.compile(24), x, y)
    big.train_step(big.compile(24), x, y)
    np.testing.assert_allclose(small.host_grads, big.host_grads, rtol=1e-4, atol=1e-7)
