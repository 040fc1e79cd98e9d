"""Arithmetic written on Keras tensors (``x + 3.0``, ``x * y``, ``x / 6``) in a Functional model.

Keras 3 records such an expression as a node of an *operation* of ``keras.src.ops.numpy``
(``{"module": "keras.src.ops.numpy", "class_name": "Add", "config": {"name": "add"}}``) whose
call arguments hold the tensors and constants — MobileNetV3's hard-sigmoid is
``ReLU(6.0)(x + 3.0) * (1.0 / 6.0)``. Its class names collide with the merge *layers*, so
:func:`as_layer` rewrites each such node, before parsing, into the layer that computes the same:
a tensor and a number → ``Rescaling(scale, offset)`` (``x * scale + offset``), two tensors →
the merge layer of that name (with Keras' broadcasting). The export then writes that layer, which
Keras loads and evaluates to the same values. Any other operation is refused by name.
"""

from __future__ import annotations

from typing import Any

from ringtrain.errors import InvalidSpec

#: operation class → the merge layer computing it on two tensors
MERGES = {"Add": "Add", "Subtract": "Subtract", "Multiply": "Multiply"}
#: operation class → (scale, offset) of ``x (op) c`` and of ``c (op) x`` (None: not affine)
AFFINE = {
    "Add": (lambda c: (1.0, c), lambda c: (1.0, c)),
    "Subtract": (lambda c: (1.0, -c), lambda c: (-1.0, c)),
    "Multiply": (lambda c: (c, 0.0), lambda c: (c, 0.0)),
    "TrueDivide": (lambda c: (1.0 / c, 0.0), None),
    "Divide": (lambda c: (1.0 / c, 0.0), None),
}
SUPPORTED = "tensor + - * / number, number + - * tensor, tensor + - * tensor"


def is_operation(layer: dict) -> bool:
    return str(layer.get("module") or "").startswith("keras.src.ops")


def _is_tensor(v: Any) -> bool:
    return isinstance(v, dict) and v.get("class_name") == "__keras_tensor__"


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def as_layer(layer: dict) -> dict:
    """The layer computing what the operation node ``layer`` computes (see the module doc)."""
    cls, name = layer.get("class_name"), str(layer.get("name") or "?")
    nodes = layer.get("inbound_nodes") or []
    node = nodes[0] if len(nodes) == 1 and isinstance(nodes[0], dict) else {}
    args = list(node.get("args") or [])

    def refuse(why: str) -> InvalidSpec:
        return InvalidSpec(
            f"model: operation {name!r} ({layer.get('module')}.{cls}) {why} "
            f"(supported: {SUPPORTED})"
        )

    if node.get("kwargs") or len(args) != 2 or len(nodes) != 1:
        raise refuse(f"with call arguments {args!r} {node.get('kwargs')!r} is not supported")
    base: dict[str, Any] = {
        "name": name,
        "inbound_nodes": [],
        "registered_name": None,
        "module": "keras.layers",
    }
    if all(map(_is_tensor, args)) and cls in MERGES:
        return {
            **base,
            "class_name": MERGES[cls],
            "config": {"name": name},
            "inbound_nodes": [{"args": [args], "kwargs": {}}],
        }
    for k in (0, 1):
        if _is_tensor(args[k]) and _number(args[1 - k]) and cls in AFFINE:
            rule = AFFINE[cls][k]
            if rule is not None and not (cls in ("TrueDivide", "Divide") and args[1] == 0):
                scale, offset = rule(float(args[1 - k]))
                return {
                    **base,
                    "class_name": "Rescaling",
                    "config": {"name": name, "scale": scale, "offset": offset},
                    "inbound_nodes": [{"args": [args[k]], "kwargs": {}}],
                }
    raise refuse("is not supported")
