"""Shared layers (one layer called on several tensors: Siamese towers, a Dense applied twice)
as one graph node per call, and folded back into one layer for the export.

Why a config pass: the graph wants one node per op application, Keras writes one layer with
several ``inbound_nodes`` and reads its calls as ``keras_history = [layer, call, 0]``.
:func:`expand` gives every call after the first its own layer, named ``<layer>@<call>``, that
reads its own node's tensors, and rewires each read of ``[layer, call, 0]`` to it. ``config``
marks those copies (``LayerSpec.shares``): they own no weights (``archive.weights_of_layer``),
the trainer runs them on the first call's weights and sums every call's weight gradient before
streaming it (``engine.ops.shared``), and :func:`fold_node` puts each back as an inbound node of
its layer so Keras loads one shared layer. Only Keras 3 configs are read this way; a tf.keras 2
layer called twice stays refused by name.
"""

from __future__ import annotations

import copy
from typing import Any

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.engine.ops.shared import Shared, Tied

SEP = "@"


def _remap(v: Any, calls: dict[str, int]) -> Any:
    if isinstance(v, dict):
        if v.get("class_name") == "__keras_tensor__":
            out = copy.deepcopy(v)
            h = (out.get("config") or {}).get("keras_history")
            if isinstance(h, list) and len(h) == 3 and int(h[1]) and str(h[0]) in calls:
                out["config"]["keras_history"] = [f"{h[0]}{SEP}{int(h[1])}", 0, h[2]]
            return out
        return {k: _remap(x, calls) for k, x in v.items()}
    if isinstance(v, list):
        return [_remap(x, calls) for x in v]
    return v


def expand(model: dict) -> tuple[dict, dict[str, str]]:
    """``model`` (a Functional config) with every later call of a shared layer as a layer of
    its own, and those copies' names → the layer whose weights they use."""
    cfg = model.get("config") or {}
    layers = cfg.get("layers")
    if model.get("class_name") == "Sequential" or not isinstance(layers, list):
        return model, {}
    many = {
        str(x.get("name") or (x.get("config") or {}).get("name")): len(x["inbound_nodes"])
        for x in layers
        if isinstance(x, dict)
        and len(x.get("inbound_nodes") or []) > 1
        and all(isinstance(n, dict) for n in x["inbound_nodes"])
    }
    if not many:
        return model, {}
    out, copies = [], {}
    for x in layers:
        if not isinstance(x, dict):
            out.append(x)
            continue
        name = str(x.get("name") or (x.get("config") or {}).get("name"))
        x = {**x, "inbound_nodes": _remap(x.get("inbound_nodes") or [], many)}
        if name not in many:
            out.append(x)
            continue
        if (x.get("class_name") or "") == "BatchNormalization":
            raise InvalidSpec(
                f"model: layer {name!r} (BatchNormalization) is called {many[name]} times: a "
                "shared BatchNormalization is not supported (supported: shared layers without "
                "moving statistics)"
            )
        first, *rest = x["inbound_nodes"]
        out.append({**x, "inbound_nodes": [first]})
        for j, node in enumerate(rest, 1):
            twin = copy.deepcopy(x)
            twin["name"] = twin.setdefault("config", {})["name"] = f"{name}{SEP}{j}"
            twin["inbound_nodes"] = [node]
            out.append(twin)
            copies[twin["name"]] = name
    ends = {k: _remap(cfg.get(k), many) for k in ("input_layers", "output_layers")}
    return {**model, "config": {**cfg, "layers": out, **ends}}, copies


def call_of(name: str) -> int:
    """The call index of a copy ``<layer>@<call>``."""
    return int(name.rsplit(SEP, 1)[1])


def fold(layers: list[dict], specs) -> list[dict]:
    """Exported layer items (one per spec, in order) with each copy's inbound node appended to
    its layer's, in call order, and the copy removed."""
    by_name = {s.name: item for s, item in zip(specs, layers, strict=True)}
    calls: dict[str, dict[int, Any]] = {}
    kept = []
    for s, item in zip(specs, layers, strict=True):
        if s.shares is None:
            kept.append(item)
        else:
            calls.setdefault(s.shares, {})[call_of(s.name)] = item["inbound_nodes"][0]
    for name, nodes in calls.items():
        by_name[name]["inbound_nodes"] += [nodes[j] for j in sorted(nodes)]
    return kept


def history(name: str, shares: str | None) -> list:
    """The ``keras_history`` of a layer's output in the export."""
    return [shares, call_of(name), 0] if shares else [name, 0, 0]


def tie(ops: list, graph, groups: list[list], specs, calls) -> dict[int, int]:
    """Wrap each shared layer's ops (``engine.ops.shared``): the call first in forward owns
    the weights, the others are tied to it; returns tied op → owning op."""
    pos = {n: k for k, n in enumerate(graph.order)}
    ties: dict[int, int] = {}
    for name, group in zip(calls, groups, strict=True):
        group = [i for i in group if i is not None]
        if len(group) < 2 or not ops[group[0]].params(0):
            continue  # folded away, or nothing to share
        if any(specs[i].frozen for i in calls[name]):
            raise InvalidSpec(
                f"model: layer {name!r} is shared and trainable=False: not supported "
                "(supported: a shared layer that trains, or a frozen layer called once)"
            )
        first = min(group, key=pos.__getitem__)
        ops[first] = Shared(ops[first])
        for i in group:
            if i != first:
                ops[i], ties[i] = Tied(ops[i]), first
    return ties
