"""What the option table generates: the worker's parser and checks, the pod arguments, the CRD.

Pipeline position: ``ringtrain.options`` holds the table (:class:`~ringtrain.options.Option`,
``GROUPS`` and what derives from it); this module turns it into the worker's argument parser and
its checks (:func:`parser`, :func:`check`, read by ``ringtrain_trainer.config``), the operator's
pod arguments (:func:`worker_args`, ``ringtrain_operator.manifests``), option values from a
defaulted ``spec.trainer`` (:func:`from_crd`, ``ringtrain_operator.spec``) and the CRD's
``spec.trainer`` schema (:func:`trainer_schema`, written into both CRD files by ``hack/gen-crd``).
Part of the shared contract: it imports neither the trainer nor the operator.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from typing import Any

from ringtrain import optionrules
from ringtrain.errors import InvalidSpec
from ringtrain.options import BY_NAME, CRD, CRD_OBJECTS, GROUPS, WORKER, Option

# --- the worker's side -----------------------------------------------------------------------


def parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The worker's flags, grouped as in the table."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    exclusive: dict[frozenset[str], argparse._MutuallyExclusiveGroup] = {}
    for g in GROUPS:
        section = p.add_argument_group(g.title)
        for o in g.options:
            if not o.cli_flag:
                continue
            into = section
            if o.exclusive_with:
                key = frozenset((o.name, o.exclusive_with))
                if key not in exclusive:
                    exclusive[key] = section.add_mutually_exclusive_group()
                into = exclusive[key]
            if o.type is bool:
                into.add_argument(
                    o.cli_flag,
                    dest=o.name,
                    help=o.help,
                    action="store_false" if o.default else "store_true",
                )
            else:
                into.add_argument(
                    o.cli_flag,
                    *o.aliases,
                    dest=o.name,
                    type=o.type,
                    default=o.default,
                    choices=o.choices or None,
                    metavar=o.metavar,
                    help=o.help,
                )
    return p


def check(values: Mapping[str, Any]) -> None:
    """Refuse values below an option's minimum, the way the table states it, and values the
    rules of :mod:`ringtrain.optionrules` refuse (the operator's spec check runs the same)."""
    for o in WORKER:
        if (why := o.bound_error(values.get(o.name))) is not None:
            raise InvalidSpec(why)
    for name, why in optionrules.errors(values):
        raise InvalidSpec(f"{BY_NAME[name].cli_flag} {why}")


# --- the operator's side ---------------------------------------------------------------------


def format_value(value: Any) -> str:
    """A flag's argument: ``30`` not ``30.0``, and never rounded (``repr`` round-trips)."""
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def worker_args(values: Mapping[str, Any]) -> list[str]:
    """``ringtrain worker`` flags for the given option values, in table order.

    Options absent from ``values`` or None are left to the worker's default; a boolean is a flag
    only when it differs from the default.
    """
    args: list[str] = []
    for o in WORKER:
        value = values.get(o.name)
        if value is None or o.cli_flag is None:
            continue
        if o.type is bool:
            if value != o.default:
                args.append(o.cli_flag)
        else:
            args += [o.cli_flag, format_value(value)]
    return args


def from_crd(trainer: Mapping[str, Any]) -> dict[str, Any]:
    """Option values from a defaulted spec.trainer (absent optional fields are None)."""
    out = {}
    for o in CRD:
        node: Any = trainer
        for part in (o.crd or "").split("."):
            node = node.get(part) if isinstance(node, Mapping) else None
        if o.type is float and node is not None:
            node = float(node)
        elif o.or_object and isinstance(node, Mapping):
            node = json.dumps(node, separators=(",", ":"))
        out[o.name] = node
    return out


_JSON_TYPES = {int: "integer", float: "number", str: "string", bool: "boolean", dict: "object"}


def field_schema(o: Option) -> dict[str, Any]:
    """One spec.trainer field's openAPIV3Schema."""
    s: dict[str, Any] = {"description": o.description or o.help, "type": _JSON_TYPES[o.type]}
    if o.choices:
        s["enum"] = list(o.choices)
    if o.minimum is not None:
        s["minimum"] = o.minimum
        if o.exclusive_minimum:
            s["exclusiveMinimum"] = True
    if o.maximum is not None:
        s["maximum"] = o.maximum
    s.update(o.schema)
    if o.or_object:  # a string or an object: structural schemas allow no type only like this
        del s["type"]
        s.pop("pattern", None)
        s["x-kubernetes-preserve-unknown-fields"] = True
    if o.schema_default is not None:
        s["default"] = o.schema_default
    return s


def trainer_schema() -> dict[str, Any]:
    """The CRD's ``spec.trainer``: objects from :data:`CRD_OBJECTS`, fields in table order."""
    root = {**CRD_OBJECTS[""], "properties": {}}
    for o in CRD:
        *parents, leaf = (o.crd or "").split(".")
        node, path = root, ""
        for part in parents:
            path = f"{path}.{part}" if path else part
            node = node["properties"].setdefault(part, {**CRD_OBJECTS[path], "properties": {}})
        node["properties"][leaf] = field_schema(o)
    return root
