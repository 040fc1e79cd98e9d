"""ringtrain's optimizers and schedules against real Keras on the same gradients.

Each case is a real ``keras.optimizers.X(...)`` serialized as ``model.compile`` stores it in a
``.keras`` file's ``compile_config``; ringtrain reads that (``from_compile_config``), and the
record it will run deserializes back into Keras. Both then take the same gradient sequence
(ringtrain's slice by slice, in uneven pieces that cut a tensor, as the reducer does) and must
end at the same weights within float32 rounding.
"""

import copy
import itertools
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras

from ringtrain.errors import InvalidSpec
from ringtrain_trainer import optim
from ringtrain_trainer.optim import schedules

S = keras.optimizers.schedules
SHAPES = [(6, 4), (4,), (3,)]  # two "layers": a kernel, its bias, another bias
STEPS = 12
#: where the reducer's buckets cut the flat buffer in these tests: mid-kernel, mid-bias
CUTS = [0, 9, 24, 26, 31]

CASES = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "sgd-momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd-nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.8, nesterov=True),
    "sgd-weight-decay": lambda: keras.optimizers.SGD(0.05, weight_decay=0.1),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adam-args": lambda: keras.optimizers.Adam(0.02, beta_1=0.8, beta_2=0.95, epsilon=1e-4),
    "adam-amsgrad": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01),
    "adamw-decay": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.05, beta_1=0.7),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "rmsprop-momentum": lambda: keras.optimizers.RMSprop(0.01, rho=0.8, momentum=0.5),
    "rmsprop-centered": lambda: keras.optimizers.RMSprop(0.01, centered=True, momentum=0.3),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adagrad-args": lambda: keras.optimizers.Adagrad(
        0.05, initial_accumulator_value=0.5, epsilon=1e-3
    ),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "nadam-args": lambda: keras.optimizers.Nadam(0.02, beta_1=0.8, beta_2=0.95, epsilon=1e-4),
    "nadam-decay-clipnorm": lambda: keras.optimizers.Nadam(0.01, weight_decay=0.05, clipnorm=0.5),
    "adadelta": lambda: keras.optimizers.Adadelta(0.5),
    "adadelta-args": lambda: keras.optimizers.Adadelta(1.0, rho=0.8, epsilon=1e-4),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    "lamb-args-clipnorm": lambda: keras.optimizers.Lamb(
        0.02, beta_1=0.8, epsilon=1e-4, clipnorm=0.5
    ),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "adamax-args": lambda: keras.optimizers.Adamax(0.02, beta_1=0.7, beta_2=0.9, epsilon=1e-3),
    "lion": lambda: keras.optimizers.Lion(0.01),
    "lion-args": lambda: keras.optimizers.Lion(0.005, beta_1=0.8, beta_2=0.95, weight_decay=0.1),
    "lion-exponential-clipvalue": lambda: keras.optimizers.Lion(
        S.ExponentialDecay(0.01, 3, 0.7), clipvalue=0.3
    ),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1),
    "ftrl-args": lambda: keras.optimizers.Ftrl(
        0.05,
        learning_rate_power=-0.7,
        initial_accumulator_value=0.3,
        l1_regularization_strength=0.01,
        l2_regularization_strength=0.02,
        l2_shrinkage_regularization_strength=0.03,
        beta=0.1,
    ),
    "sgd-clipvalue": lambda: keras.optimizers.SGD(0.1, momentum=0.5, clipvalue=0.3),
    "adam-clipnorm": lambda: keras.optimizers.Adam(0.01, clipnorm=0.5),
    "sgd-global-clipnorm": lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.7),
    "adamw-cosine-clipnorm": lambda: keras.optimizers.AdamW(
        S.CosineDecay(0.02, 10, alpha=0.1), clipnorm=1.0
    ),
    "sgd-nesterov-exponential": lambda: keras.optimizers.SGD(
        S.ExponentialDecay(0.1, 4, 0.5, staircase=True), momentum=0.9, nesterov=True
    ),
    "rmsprop-exponential": lambda: keras.optimizers.RMSprop(S.ExponentialDecay(0.01, 3, 0.7)),
    "sgd-piecewise": lambda: keras.optimizers.SGD(
        S.PiecewiseConstantDecay([3, 7], [0.1, 0.05, 0.01])
    ),
    "adam-polynomial-cycle": lambda: keras.optimizers.Adam(
        S.PolynomialDecay(0.01, 5, 0.001, power=2.0, cycle=True)
    ),
}


def run_both(make, rng):
    """(ringtrain's flat weights, Keras' weights flattened the same way) after STEPS steps."""
    k_opt = make()
    compile_config = {"optimizer": keras.optimizers.serialize(k_opt)}
    spec = optim.from_compile_config(compile_config)
    again = keras.optimizers.deserialize(
        copy.deepcopy(spec.keras)
    )  # what checkpoint and export record
    # Keras 3.15's own deserialize cannot rebuild a Lamb (it returns the class name)
    assert (again if isinstance(again, str) else type(again).__name__) == type(k_opt).__name__
    w0 = [rng.normal(size=s).astype(np.float32) for s in SHAPES]
    grads = [[rng.normal(size=s).astype(np.float32) for s in SHAPES] for _ in range(STEPS)]
    variables = [keras.Variable(w) for w in w0]
    for gs in grads:
        k_opt.apply_gradients(zip(gs, variables, strict=True))
    want = np.concatenate([np.asarray(v.numpy()).ravel() for v in variables])

    params = np.concatenate([w.ravel() for w in w0])
    sizes = np.cumsum([0] + [int(np.prod(s)) for s in SHAPES])
    tensors = list(itertools.pairwise(sizes))
    opt = optim.build_spec(spec, params, tensors)
    g = np.zeros_like(params)
    for gs in grads:
        np.copyto(g, np.concatenate([x.ravel() for x in gs]))
        opt.begin_step(0)
        for a, b in reversed(list(itertools.pairwise(CUTS))):  # last layer first
            opt.apply(g, a, b)
    assert opt.iterations == STEPS
    return params, want


@pytest.mark.parametrize("case", list(CASES))
def test_weights_match_keras_after_steps(case, rng):
    got, want = run_both(CASES[case], rng)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


SCHEDULES = [
    S.ExponentialDecay(0.1, 7, 0.5),
    S.ExponentialDecay(0.1, 7, 0.5, staircase=True),
    S.InverseTimeDecay(0.1, 5, 0.5),
    S.InverseTimeDecay(0.1, 5, 0.5, staircase=True),
    S.PiecewiseConstantDecay([10, 20, 35], [1.0, 0.5, 0.1, 0.01]),
    S.PolynomialDecay(0.1, 30),
    S.PolynomialDecay(0.1, 13, 0.01, power=0.5, cycle=True),
    S.CosineDecay(0.1, 40),
    S.CosineDecay(0.1, 40, alpha=0.2),
    S.CosineDecay(0.0, 30, warmup_target=0.2, warmup_steps=10),
    S.CosineDecayRestarts(0.1, 8),
    S.CosineDecayRestarts(0.1, 8, t_mul=1.0, m_mul=0.5, alpha=0.1),
    S.CosineDecayRestarts(0.1, 5, t_mul=1.5, m_mul=0.8),
]


@pytest.mark.parametrize("schedule", SCHEDULES, ids=lambda s: type(s).__name__)
def test_schedule_values_match_keras(schedule):
    ours = schedules.from_keras(keras.saving.serialize_keras_object(schedule), "lr")
    steps = list(range(120))
    want = [float(schedule(s)) for s in steps]
    np.testing.assert_allclose(
        [ours(s) for s in steps], want, rtol=2e-6, atol=1e-8
    )  # float32 near 0


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (
            lambda: keras.optimizers.SGD(loss_scale_factor=128.0),
            "compile_config.optimizer.config.loss_scale_factor",
        ),
        (
            lambda: keras.optimizers.Adam(gradient_accumulation_steps=4),
            "compile_config.optimizer.config.gradient_accumulation_steps",
        ),
        (lambda: keras.optimizers.Muon(), "compile_config.optimizer.class_name"),
        (
            lambda: keras.optimizers.Lion(use_ema=True, ema_overwrite_frequency=0),
            "compile_config.optimizer.config.ema_overwrite_frequency",
        ),
        (
            lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
            "compile_config.optimizer.class_name",
        ),
    ],
)
def test_unsupported_compile_settings_are_refused_by_field(make, field):
    doc = keras.optimizers.serialize(make())
    with pytest.raises(InvalidSpec, match=field.replace(".", r"\.")):
        optim.from_compile_config({"optimizer": doc})


def test_unknown_schedule_and_argument_are_refused_by_field():
    doc = keras.optimizers.serialize(keras.optimizers.SGD(0.1))
    doc["config"]["learning_rate"] = {"class_name": "OneCycle", "config": {}}
    with pytest.raises(InvalidSpec, match=r"compile_config\.optimizer\.config\.learning_rate"):
        optim.from_compile_config({"optimizer": doc})
    doc = keras.optimizers.serialize(keras.optimizers.SGD(0.1))
    doc["config"]["lookahead"] = 5
    with pytest.raises(InvalidSpec, match=r"compile_config\.optimizer\.config\.lookahead"):
        optim.from_compile_config({"optimizer": doc})


@pytest.mark.parametrize("make", [CASES["nadam"], CASES["adamax"], CASES["lion"], CASES["ftrl"]])
def test_a_resumed_optimizer_continues_as_if_never_stopped(make, rng):
    """Nadam's momentum-schedule product is recomputed from ``iterations``, not stored."""
    spec = optim.from_compile_config({"optimizer": keras.optimizers.serialize(make())})
    w0 = rng.normal(size=20).astype(np.float32)
    grads = [rng.normal(size=20).astype(np.float32) for _ in range(8)]
    straight, first = w0.copy(), w0.copy()
    a = optim.build_spec(spec, straight)
    b = optim.build_spec(spec, first)
    for i, g in enumerate(grads):
        a.begin_step(0)
        a.apply(g, 0, 20)
        if i < 4:
            b.begin_step(0)
            b.apply(g, 0, 20)
    resumed = optim.build_spec(spec, first)
    resumed.load_state(b.state_dict(), b.iterations)
    for g in grads[4:]:
        resumed.begin_step(0)
        resumed.apply(g, 0, 20)
    np.testing.assert_array_equal(first, straight)
    assert optim.state_bytes_for(spec, 20) == 4 * 20 * len(a.state_names)


#: optimizers whose moment a zero gradient decays (compiled Adam, and three numpy updates):
#: the name of that moment in Keras and in ringtrain, and a gradient that puts it near the
#: denormals (RMSprop's moment holds the gradient squared)
DECAYING = {
    "adam": (lambda: keras.optimizers.Adam(0.01), "momentum", "m", 1e-36),
    "adam-amsgrad": (lambda: keras.optimizers.Adam(0.01, amsgrad=True), "momentum", "m", 1e-36),
    "sgd-momentum": (
        lambda: keras.optimizers.SGD(0.01, momentum=0.9),
        "momentum",
        "momentum",
        1e-36,
    ),
    "rmsprop": (lambda: keras.optimizers.RMSprop(0.01, rho=0.5), "velocity", "velocity", 1e-18),
}


@pytest.mark.parametrize("case", list(DECAYING))
def test_denormals_are_flushed_to_zero_as_keras_on_tensorflow_does(case):
    """TensorFlow runs its CPU kernels with denormals flushed to zero, Keras' optimizers
    included: where a moment's decay would give a denormal it gives zero (IEEE arithmetic keeps
    decaying it, through slow denormals). ringtrain's updates, compiled or numpy, flush as
    TensorFlow does: the same moments, bit for bit, with a tiny gradient that then stops."""
    make, keras_name, ours, tiny_g = DECAYING[case]
    k_opt = make()
    spec = optim.from_compile_config({"optimizer": keras.optimizers.serialize(k_opt)})
    w0 = np.array([0.5, -0.25, 1.0, 2.0], np.float32)
    first = np.array([tiny_g, -0.3 * tiny_g, 0.5, 1e-3], np.float32)
    later = np.array([0.0, 0.0, 0.1, 0.0], np.float32)
    variable, params = keras.Variable(w0.copy()), w0.copy()
    opt = optim.build_spec(spec, params, [(0, 4)])
    if case == "adam":
        assert opt.fused is not None  # the compiled step, the one a float32 model runs
    g = np.zeros_like(params)
    for step in range(12):  # IEEE would still hold denormals, not yet underflowed to zero
        np.copyto(g, first if step == 0 else later)
        k_opt.apply_gradients([(g.copy(), variable)])
        opt.begin_step(0)
        opt.apply(g, 0, 4)
    moment = next(v for v in k_opt.variables if v.path.endswith(keras_name)).numpy()
    tiny = np.abs(moment[:2])
    assert ((tiny == 0) | (tiny >= np.finfo(np.float32).tiny)).all()  # Keras: no denormal
    assert opt.state[ours][:2].tobytes() == moment[:2].tobytes()
    np.testing.assert_allclose(opt.state[ours], moment, rtol=1e-5)
    np.testing.assert_allclose(params, variable.numpy(), rtol=1e-5)
