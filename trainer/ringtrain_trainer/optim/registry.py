"""Which optimizer runs: the model's ``compile_config``, or the flags that override it.

Pipeline position: ``keras.compile.read`` calls :func:`from_compile_config` while it validates
the model (so ``render``, ``run`` and the operator refuse an unsupported optimizer before
anything runs, naming the field: ``compile_config.optimizer.config.loss_scale_factor``); the
worker calls :func:`resolve` with its flags and builds the optimizer with :func:`build`.

An :class:`OptimizerSpec` is the effective optimizer as Keras serializes it (every argument,
defaults filled in): the start-up line, ``/status``, the checkpoint and the export all say that
one record, and real Keras can deserialize it (``keras.optimizers.deserialize``).

Precedence: the model's compile settings are the default; ``--optimizer`` replaces the whole
optimizer, ``--lr`` its learning rate (schedule included), ``--lr-decay`` adds the step decay;
each only when given. Built-in presets (and a model without compile settings) run the flags'
defaults, Adam at 1e-3, as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from ringtrain import options
from ringtrain.errors import CheckpointError, InvalidSpec
from ringtrain_trainer.engine.ops.embedding import Embedding
from ringtrain_trainer.engine.ranges import POSITIVE
from ringtrain_trainer.optim import limits, schedules
from ringtrain_trainer.optim.adadelta import Adadelta
from ringtrain_trainer.optim.adafactor import Adafactor
from ringtrain_trainer.optim.adagrad import Adagrad
from ringtrain_trainer.optim.adam import Adam, AdamW
from ringtrain_trainer.optim.adamax import Adamax
from ringtrain_trainer.optim.base import Optimizer
from ringtrain_trainer.optim.clip import KINDS, Clip
from ringtrain_trainer.optim.ftrl import Ftrl
from ringtrain_trainer.optim.lamb import Lamb
from ringtrain_trainer.optim.lion import Lion
from ringtrain_trainer.optim.nadam import Nadam
from ringtrain_trainer.optim.rmsprop import RMSprop
from ringtrain_trainer.optim.sgd import SGD, Momentum

#: Keras' BaseOptimizer arguments and defaults (keras 3.x ``get_config``)
BASE = {
    "learning_rate": 0.001,
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}
#: arguments accepted only at their default (what ringtrain does not implement)
UNSUPPORTED = ("loss_scale_factor", "gradient_accumulation_steps")
#: tf.keras 2.11+ arguments that change nothing at these values (Keras 3 has none of them):
#: dropped from the record; any other value is refused
TF_KERAS_NEUTRAL = {"decay": (0, 0.0, None), "is_legacy_optimizer": (False,)}
#: tf.keras 2 arguments that only steer its own loop: dropped whatever their value
TF_KERAS_EXECUTION = ("jit_compile",)
#: Keras class name -> (ringtrain class, class arguments with Keras' defaults, base overrides)
KERAS: dict[str, tuple[type[Optimizer], dict[str, Any], dict[str, Any]]] = {
    "SGD": (SGD, {"momentum": 0.0, "nesterov": False}, {"learning_rate": 0.01}),
    "Adam": (Adam, {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "amsgrad": False}, {}),
    "AdamW": (
        AdamW,
        {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7, "amsgrad": False},
        {"weight_decay": 0.004},
    ),
    "RMSprop": (RMSprop, {"rho": 0.9, "momentum": 0.0, "epsilon": 1e-7, "centered": False}, {}),
    "Adagrad": (Adagrad, {"initial_accumulator_value": 0.1, "epsilon": 1e-7}, {}),
    "Adadelta": (Adadelta, {"rho": 0.95, "epsilon": 1e-7}, {}),
    "Nadam": (Nadam, {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}, {}),
    "Adamax": (Adamax, {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}, {}),
    "Lion": (Lion, {"beta_1": 0.9, "beta_2": 0.99}, {}),
    "Lamb": (Lamb, {"beta_1": 0.9, "beta_2": 0.999, "epsilon": 1e-7}, {}),
    "Adafactor": (
        Adafactor,
        {
            "beta_2_decay": -0.8,
            "epsilon_1": 1e-30,
            "epsilon_2": 1e-3,
            "clip_threshold": 1.0,
            "relative_step": True,
        },
        {},
    ),
    "Ftrl": (
        Ftrl,
        {
            "learning_rate_power": -0.5,
            "initial_accumulator_value": 0.1,
            "l1_regularization_strength": 0.0,
            "l2_regularization_strength": 0.0,
            "l2_shrinkage_regularization_strength": 0.0,
            "beta": 0.0,
        },
        {},
    ),
}
#: Keras' string shortcuts (``compile(optimizer="adam")`` in a tf.keras 2 config)
ALIASES = {c.lower(): c for c in KERAS}
#: ``--optimizer`` choices as Keras optimizers
FLAGS = {"sgd": ("SGD", {}), "momentum": ("SGD", {"momentum": 0.9}), "adam": ("Adam", {})}
WHERE = "compile_config.optimizer"


@dataclass(frozen=True)
class OptimizerSpec:
    """The optimizer that runs: its Keras serialization, where it came from, and the CLI's
    epoch step decay (``(decay, every_epochs)``; Keras has no epoch schedule)."""

    name: str  # ringtrain's label (checkpoints before this record carry only it)
    keras: dict
    source: str
    step_decay: tuple[float, int] | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def class_name(self) -> str:
        return self.keras["class_name"]

    @property
    def config(self) -> dict:
        return self.keras["config"]

    def record(self) -> dict:
        """What the checkpoint, ``/status`` and the export say (JSON)."""
        out = {"name": self.name, "keras": self.keras, "source": self.source}
        if self.step_decay:
            out["step_decay"] = {"decay": self.step_decay[0], "every_epochs": self.step_decay[1]}
        return json.loads(json.dumps(out))

    @classmethod
    def from_record(cls, record: dict) -> OptimizerSpec:
        """The spec a checkpoint's :meth:`record` describes."""
        decay = record.get("step_decay")
        step_decay = (decay["decay"], decay["every_epochs"]) if decay else None
        return cls(record["name"], record["keras"], record.get("source", "checkpoint"), step_decay)

    def same_run(self, record: dict | None) -> bool:
        """Whether a checkpoint's record is this optimizer (its source may differ)."""
        if record is None:
            return True
        mine = self.record()
        return all(mine.get(k) == record.get(k) for k in ("keras", "step_decay"))

    def describe(self) -> str:
        """One line: ``SGD(learning_rate=ExponentialDecay(...), momentum=0.9, ...)``."""
        _, own, _ = KERAS[self.class_name]
        shown = []
        for k, v in self.config.items():
            if k == "name" or (k not in own and k != "learning_rate" and v == BASE.get(k)):
                continue
            if isinstance(v, dict):
                args = ", ".join(f"{a}={_fmt(b)}" for a, b in v["config"].items() if a != "name")
                v = f"{v['class_name']}({args})"
            else:
                v = _fmt(v)
            shown.append(f"{k}={v}")
        text = f"{self.class_name}({', '.join(shown)})"
        if self.step_decay:
            text += f" x {self.step_decay[0]:g} every {self.step_decay[1]} epoch(s)"
        return f"{text} [{self.source}{''.join('; ' + n for n in self.notes)}]"


def _fmt(v: Any) -> str:
    """A value for the log line: float32 artefacts (0.10000000149011612) as 0.1."""
    return format(v, ".7g") if isinstance(v, float) else repr(v)


def _serialized(class_name: str, config: dict) -> dict:
    return {
        "module": "keras.optimizers",
        "class_name": class_name,
        "config": config,
        "registered_name": None,
    }


def from_compile_config(compile_config: dict | None) -> OptimizerSpec | None:
    """The model's compile optimizer, every argument checked; None where there is none."""
    doc = (compile_config or {}).get("optimizer")
    if doc is None:
        return None
    if isinstance(doc, str):
        doc = {"class_name": ALIASES.get(doc.lower(), doc), "config": {}}
    if not isinstance(doc, dict):
        raise InvalidSpec(f"model: {WHERE}: {doc!r} is not an optimizer")
    cls_name = doc.get("class_name")
    if cls_name not in KERAS or doc.get("registered_name") not in (None, cls_name):
        raise InvalidSpec(
            f"model: {WHERE}.class_name: optimizer {cls_name!r} is not supported "
            f"(supported: {', '.join(KERAS)})"
        )
    _, own, base = KERAS[cls_name]
    defaults = {**BASE, **base, **own}
    given = dict(doc.get("config") or {})
    name = given.pop("name", None) or cls_name.lower()
    for k in TF_KERAS_EXECUTION:
        given.pop(k, None)
    for k, neutral in TF_KERAS_NEUTRAL.items():
        if k in given and given.pop(k) not in neutral:
            raise InvalidSpec(
                f"model: {WHERE}.config.{k}={doc['config'][k]!r} is not supported "
                f"(supported: {neutral[0]!r})"
            )
    for k, v in given.items():
        where = f"{WHERE}.config.{k}"
        if k not in defaults:
            raise InvalidSpec(f"model: {where}: argument {k!r} of {cls_name} is not supported")
        if k in UNSUPPORTED and v != defaults[k]:
            raise InvalidSpec(f"model: {where}={v!r} is not supported (supported: {defaults[k]!r})")
    config = {"name": name, **defaults, **given}
    limits.check(config, f"{WHERE}.config")
    if sum(config[k] is not None for k in KINDS) > 1:
        raise InvalidSpec(
            f"model: {WHERE}.config: only one of clipnorm, clipvalue and global_clipnorm "
            "can be set (as in Keras)"
        )
    lr = config["learning_rate"]
    if isinstance(lr, dict):
        schedules.from_keras(lr, f"{WHERE}.config.learning_rate")  # refuses here, not later
    elif POSITIVE.fails(lr):
        raise InvalidSpec(
            f"model: {WHERE}.config.learning_rate={lr!r} is not supported (supported: "
            f"{POSITIVE.text}, or a schedule)"
        )
    return OptimizerSpec(cls_name.lower(), _serialized(cls_name, config), "model compile_config")


def resolve(
    compiled: OptimizerSpec | None,
    optimizer: str | None = None,
    lr: float | None = None,
    lr_decay: float | None = None,
    lr_decay_epochs: int | None = None,
) -> OptimizerSpec:
    """The optimizer to run: the model's, overridden by each flag given (None: not given)."""
    if optimizer is not None or compiled is None:
        flag = optimizer or "adam"
        cls_name, args = FLAGS[flag]
        _, own, base = KERAS[cls_name]
        config = {"name": flag, **BASE, **base, **own, **args, "learning_rate": lr or 1e-3}
        notes: tuple[str, ...] = ()
        if compiled is not None:
            notes = (f"replaces the model's {compiled.describe().split(' [')[0]}",)
        source = "--optimizer" if optimizer else "default"
        spec = OptimizerSpec(flag, _serialized(cls_name, config), source, notes=notes)
    else:
        spec = compiled
        if lr is not None:
            config = {**spec.config, "learning_rate": lr}
            note = f"--lr {lr:g} replaces the model's learning_rate"
            spec = replace(spec, keras=_serialized(spec.class_name, config), notes=(note,))
    if (lr_decay is not None and lr_decay != 1.0) or lr_decay_epochs is not None:
        if isinstance(spec.config["learning_rate"], dict):
            raise InvalidSpec(
                f"--lr-decay: the model's {WHERE}.config.learning_rate is a schedule "
                f"({spec.config['learning_rate'].get('class_name')}); give --lr as well to "
                "replace it, or drop --lr-decay"
            )
        decay = (1.0 if lr_decay is None else lr_decay, lr_decay_epochs or 1)
        spec = replace(spec, step_decay=decay, notes=(*spec.notes, "--lr-decay"))
    return spec


def for_run(cfg, model) -> OptimizerSpec:
    """The optimizer a worker configured by ``cfg`` (a ``TrainerConfig``) runs for ``model``
    (a ``ModelSpec``): the model's compile settings unless it is a built-in preset."""
    config = model.config
    compiled = None if model.name in options.MODELS else getattr(config, "optimizer", None)
    spec = resolve(compiled, cfg.optimizer, cfg.lr, cfg.lr_decay, cfg.lr_decay_epochs)
    _refuse_clipped_embedding(spec, model)
    _refuse_abs_embedding(spec, model)
    return spec


#: optimizers whose Keras update takes a per-token-occurrence value of an Embedding's
#: ``IndexedSlices`` that :mod:`.sparse_rows` (squares of ``g`` only) does not reproduce
_PER_OCCURRENCE = {
    "Adamax": "each token occurrence's |gradient|",
    "Adadelta": "the square of each token occurrence's update",
}


def _refuse_abs_embedding(spec: OptimizerSpec, model) -> None:
    """Keras' Adamax takes ``|g|`` of an Embedding's ``IndexedSlices`` per token occurrence
    before duplicate ids are summed (the rule :mod:`.sparse_rows` implements for squares), and
    Adadelta squares its per-occurrence update; ringtrain has only the summed gradient there:
    refused, not approximated."""
    what = _PER_OCCURRENCE.get(spec.class_name)
    if what and any(isinstance(layer, Embedding) for layer in model.layers):
        raise InvalidSpec(
            f"model: {WHERE}.class_name={spec.class_name!r} is not supported with an "
            f"Embedding layer (Keras takes {what} before summing duplicate ids; ringtrain "
            "reduces the summed gradient)"
        )


def _refuse_clipped_embedding(spec: OptimizerSpec, model) -> None:
    """Keras clips an Embedding's ``IndexedSlices`` gradient per token occurrence (the norm,
    the value) before duplicate ids are summed; ringtrain reduces the summed gradient, so it
    cannot clip the same way: refused, not approximated (README, "Decisions and known limits":
    1e-2 to 1.3 relative weight differences measured in 3 steps)."""
    kind = next((k for k in KINDS if spec.config.get(k) is not None), None)
    if kind and any(isinstance(layer, Embedding) for layer in model.layers):
        raise InvalidSpec(
            f"model: {WHERE}.config.{kind}={spec.config[kind]!r} is not supported with an "
            "Embedding layer (Keras clips each token occurrence's gradient before summing "
            "duplicate ids; ringtrain reduces the summed gradient)"
        )


def check_resume(spec: OptimizerSpec, optimizer: Optimizer, state, where: str) -> str | None:
    """Whether a checkpoint's ``TrainingState`` may continue in this optimizer: only in the
    same class with the same state slots (else :class:`CheckpointError` naming both). Other
    arguments (a new ``--lr``, say) may change: the returned line says how."""
    rec = state.optimizer_config
    was = state.optimizer if rec is None else OptimizerSpec.from_record(rec).describe()
    same_class = rec is None or rec["keras"]["class_name"] == spec.class_name
    # the dynamic loss scale rides beside the slots (``optim.loss_scale.STATE_KEY``)
    slots = set(state.optimizer_state) - {"loss_scale"} == set(optimizer.state_names)
    if state.optimizer != optimizer.name or not same_class or not slots:
        raise CheckpointError(
            f"{where}: checkpoint used optimizer {was}, this run {spec.describe()}"
        )
    if spec.same_run(rec):
        return None
    return f"resuming a checkpoint trained with optimizer {was}; this run: {spec.describe()}"


def _schedule(spec: OptimizerSpec):
    lr = spec.config["learning_rate"]
    if isinstance(lr, dict):
        return schedules.from_keras(lr, f"{WHERE}.config.learning_rate")
    decay, every = spec.step_decay or (1.0, 1)
    return schedules.StepDecay(float(lr), decay, every)


def build(spec: OptimizerSpec, params, tensors=None) -> Optimizer:
    """The optimizer over ``params``; ``tensors`` are the Keras variables' (start, stop)
    ranges of the flat buffer (clipnorm is per variable), the whole buffer by default."""
    cls, own, _ = KERAS[spec.class_name]
    if spec.name == "momentum":
        cls = Momentum
    c = spec.config
    opt = cls(params, _schedule(spec), **{k: c[k] for k in own}, weight_decay=c["weight_decay"])
    kind = next((k for k in KINDS if c[k] is not None), None)
    if kind is not None or opt.whole_tensors:
        value = c[kind] if kind is not None else 0.0
        opt.set_clip(Clip(kind, value, tensors or [(0, params.size)], opt.whole_tensors))
    if c.get("use_ema"):
        opt.set_ema(c["ema_momentum"], c["ema_overwrite_frequency"])
    return opt


def state_arrays(spec: OptimizerSpec) -> int:
    """How many parameter-sized state buffers the optimizer keeps."""
    c = spec.config
    n = {
        "SGD": lambda: int(c["momentum"] != 0),
        "Adam": lambda: 2 + bool(c["amsgrad"]),
        "AdamW": lambda: 2 + bool(c["amsgrad"]),
        "RMSprop": lambda: 1 + (c["momentum"] > 0) + bool(c["centered"]),
        "Adagrad": lambda: 1,
        "Adadelta": lambda: 2,
        "Nadam": lambda: 2,
        "Adamax": lambda: 2,
        "Lion": lambda: 1,
        "Lamb": lambda: 2,
        "Ftrl": lambda: 2,
        "Adafactor": lambda: 1,  # at most: r + c of a matrix are far smaller than it
    }
    return n[spec.class_name]() + bool(c.get("use_ema"))
