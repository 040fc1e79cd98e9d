"""The control plane's questions about a model, answered by the trainer in a child process.

Pipeline position: the operator, ``ringtrain render`` and ``ringtrain run`` ask two things of
``spec.trainer.model`` before any pod exists — can it run (parsed, checked against the memory
budget and built exactly as the worker will), and what does one IPU hold while training it
(:func:`ringtrain_trainer.ipu.memory.plan_memory`, the plan the worker compiles). Answering them
needs numpy and the engine; the operator must not load either (a control plane of ~40 MB, not
a trainer), and a tenant's model must not be able to exhaust the operator's memory. So
``ringtrain_operator.modelcheck`` runs ``python -m ringtrain_trainer.sizing`` with a memory
and time limit, writes one JSON request on stdin and reads one JSON answer on stdout:

- ``{"check": {"model": <str|object>, "capacity": <bytes>, "per_ipu": <n>}}`` →
  ``{"error": <why it cannot run, or null>}``
- ``{"plan": {"model": <str|object>, "per_ipu": <n>, "capacity": <bytes>, "optimizer":
  <name|null>, "on_host": <bool>}}`` → ``{"plan": <one IPU's bytes, or null when the pod must
  plan it: a file, or free input dimensions>, "params": <n>, "slots": <optimizer state arrays>}``

The arithmetic is the worker's, unchanged: one function each (``keras.load.from_config`` with the
budget, ``ipu.memory.plan_memory``), so the operator's answer and the worker's cannot differ.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from ringtrain.errors import InvalidSpec
from ringtrain_trainer import optim
from ringtrain_trainer.ipu import memory
from ringtrain_trainer.keras import load as keras_load
from ringtrain_trainer.keras.config import free_input_shape

#: float32: the plan's item size
ITEMSIZE = 4
#: state arrays per parameter when ``optimizer`` is unset (the model's compile settings): the
#: most any optimizer the trainer maps keeps (Adam or RMSprop with amsgrad/centered: 3)
MAX_SLOTS = 3


def check(model: Any, capacity: int, per_ipu: int) -> str | None:
    """Why an inline Keras config cannot run, or None: parsed and built as the worker will,
    the memory budget first. Where an input dimension is free, its weights alone are held to
    the budget here (they do not depend on it); the worker checks the activations once its
    data fixes the dimension."""
    free = free_input_shape(dict(model)) is not None
    try:
        keras_load.from_config(
            dict(model),
            "inline",
            (capacity, 0 if free else per_ipu),
            data=keras_load.any_length,
        )
    except InvalidSpec as e:
        return str(e).removeprefix("model: ")
    except (AttributeError, KeyError, TypeError, ValueError, IndexError, ArithmeticError) as e:
        return f"not a Keras model config that model.to_json() writes ({type(e).__name__}: {e})"
    return None


def _source(model: Any) -> str | None:
    """``--model``'s text when it can be planned here: a preset's name or an inline config's
    JSON; None for a file in the pod or a model with None input dimensions."""
    doc = model
    if isinstance(model, str) and model.lstrip().startswith("{"):
        try:
            doc = json.loads(model)
        except ValueError:
            doc = None
    if isinstance(doc, dict) and free_input_shape(doc) is not None:
        return None
    if not isinstance(model, str):
        model = json.dumps(model, separators=(",", ":"))
    return model if model in keras_load.PRESETS or model.lstrip().startswith("{") else None


def slots(optimizer: str | None) -> int:
    """Parameter-sized state arrays of ``optimizer`` (``optim.state_bytes_for``'s count)."""
    return MAX_SLOTS if optimizer is None else optim.state_bytes_for(optimizer, 1, 1)


def plan(
    model: Any, per_ipu: int, capacity: int, optimizer: str | None, on_host: bool
) -> dict[str, Any]:
    """One IPU's planned bytes of training ``model`` on ``per_ipu`` examples, its parameters
    and the optimizer's state arrays per parameter."""
    source = _source(model)
    n = slots(optimizer)
    if source is None:
        return {"plan": None, "params": 0, "slots": n}
    spec = keras_load.load(source, (capacity, per_ipu))
    device_state = 0 if on_host else n * spec.num_params * ITEMSIZE
    p = memory.plan_memory(spec, per_ipu, True, ITEMSIZE, capacity, device_state)
    return {"plan": p.total, "params": spec.num_params, "slots": n}


def answer(request: dict[str, Any]) -> dict[str, Any]:
    """The answer to one request (the module docstring's protocol)."""
    if "check" in request:
        q = request["check"]
        return {"error": check(q["model"], int(q["capacity"]), int(q["per_ipu"]))}
    q = request["plan"]
    try:
        return plan(
            q["model"], int(q["per_ipu"]), int(q["capacity"]), q["optimizer"], bool(q["on_host"])
        )
    except InvalidSpec as e:
        return {"error": str(e)}


def main() -> int:
    try:
        out = answer(json.loads(sys.stdin.read()))
    except MemoryError:
        out = {"error": "MemoryError"}
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
