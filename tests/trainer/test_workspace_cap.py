"""Graphcore's availableMemoryProportion (issue 23 item 5): conv workspaces capped at a share of
the IPU's memory by running the op over the batch in serial chunks — the same weights as the
whole-batch workspaces, a smaller plan, and a refusal naming the option when one example's
workspace does not fit."""

from __future__ import annotations

import io

import numpy as np
import pytest
from pipe_models import conv_stack, sgd_on_ipu, text

from ringtrain.errors import InvalidSpec, IPUCompileError
from ringtrain_trainer import report
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.engine.ops.conv import Conv
from ringtrain_trainer.ipu.device import IPU, MB, IPUConfig
from ringtrain_trainer.ipu.pipeline import PipelinedIPU
from ringtrain_trainer.keras import load as keras_model

MEM = 64 * MB


def _train(proportion, steps=2, batch=16, lr=0.05, dropout=True):
    spec = keras_model.from_config(conv_stack(3, 4, dropout=dropout), "m")
    cfg = IPUConfig(
        memory_bytes=MEM, host_threads=1, seed=1, available_memory_proportion=proportion
    )
    params, losses, exe, _ = sgd_on_ipu(spec, cfg, steps, batch, lr)
    return params, losses, exe, spec


def _proportion_for(examples: int) -> float:
    """The proportion that lets the largest conv of the test model hold ``examples``."""
    spec = keras_model.from_config(conv_stack(3, 4), "m")
    convs = [(i, layer) for i, layer in enumerate(spec.layers) if isinstance(layer, Conv)]
    need = max(
        layer.fixed_elems() + examples * layer.chunk_elems(1, True, spec.need_dx[i])
        for i, layer in convs
    )
    return need * 4 / MEM


def test_capped_workspaces_give_the_same_weights_and_a_smaller_plan():
    a, la, base, _ = _train(None)
    b, lb, exe, spec = _train(_proportion_for(5))
    np.testing.assert_allclose(lb, la, rtol=1e-6)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    assert exe.plan.workspace < base.plan.workspace
    pieces = {r.name: r.pieces for r in exe.plan.by_layer}
    assert max(pieces.values()) == 4  # 16 examples, at most 5 per chunk: 4 chunks of 4
    assert pieces["conv1"] < pieces["conv2"]  # one input channel: a smaller workspace
    assert all(r.pieces == 1 for r in base.plan.by_layer)
    assert all(layer.chunk is not None for layer in spec.layers if isinstance(layer, Conv))


def test_an_uneven_last_chunk_and_evaluation_run_the_same():
    a, la, _, _ = _train(None, batch=14, dropout=False)
    b, lb, exe, _ = _train(_proportion_for(4), batch=14, dropout=False)  # 4, 4, 4, 2
    assert max(r.pieces for r in exe.plan.by_layer) == 4
    np.testing.assert_allclose(lb, la, rtol=1e-6)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


def test_a_workspace_one_example_cannot_fit_is_refused_naming_the_option():
    with pytest.raises(
        IPUCompileError,
        match=r"layer 'conv\d' \(conv\).*--available-memory-proportion "
        r"\(spec.trainer.availableMemoryProportion\)",
    ):
        _train(_proportion_for(1) * 0.5)


@pytest.mark.parametrize(
    "extra",
    [{"recompute": True}, {"replicas": 2}, {"host_threads": 2}, {"replicas": 2, "accumulation": 2}],
)
def test_the_cap_composes_with_recompute_replicas_host_threads_and_pipelining(extra):
    spec = keras_model.from_config(conv_stack(3, 4), "m")
    out = []
    for proportion in (None, _proportion_for(3)):
        params = spec.init(5)
        grads = np.zeros_like(params)
        kw = {"host_threads": 1, "seed": 1, "memory_bytes": MEM, **extra}
        cfg = IPUConfig(available_memory_proportion=proportion, **kw)
        if "accumulation" in extra:  # two pipeline stages, micro-batches through them
            ipu = PipelinedIPU(spec, cfg, params, grads, stages="conv3")
        else:
            ipu = IPU(spec, cfg, params, grads)
        exe = ipu.compile(16)
        rng = np.random.default_rng(2)
        for step in range(2):
            x = rng.random((exe.batch, 28, 28, 1), np.float32)  # pipelined: K micro-batches
            ipu.train_step(exe, x, rng.integers(0, 10, exe.batch), step=step)
            params -= 0.05 * grads
        images = rng.random((20, 28, 28, 1), np.float32)
        score = ipu.evaluate(images, rng.integers(0, 10, 20), batch=10)
        ipu.close()
        out.append((params, score))
    np.testing.assert_allclose(out[1][0], out[0][0], rtol=1e-5, atol=1e-7)
    assert out[1][1] == out[0][1]


def test_the_option_reaches_the_memory_report_from_the_command_line(tmp_path):
    model = tmp_path / "m.json"
    model.write_text(text(conv_stack(3, 4)))
    args = ["--model", str(model), "--batch-size", "16", "--ipu-memory-mb", "64"]
    shown = {}
    for extra in ([], ["--available-memory-proportion", f"{_proportion_for(5):.6f}"]):
        out = io.StringIO()
        report.report(TrainerConfig.from_args([*args, *extra], env={}), out)
        shown[bool(extra)] = out.getvalue()
    assert "serial pieces" not in shown[False]
    line = next(x for x in shown[True].splitlines() if "serial pieces" in x)
    assert "conv2 x4" in line and "conv3 x4" in line
    with pytest.raises(InvalidSpec, match="--available-memory-proportion must be positive"):
        TrainerConfig.from_args([*args, "--available-memory-proportion", "0"], env={})
    above = TrainerConfig.from_args([*args, "--available-memory-proportion", "1.5"], env={})
    with pytest.raises(IPUCompileError, match=r"--available-memory-proportion .* \(0, 1\]"):
        report.report(above, io.StringIO())
