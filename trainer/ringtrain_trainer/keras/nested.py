"""Nested models (a Functional or Sequential model used as a layer) flattened into one graph,
and put back for the export.

Why at the config level: transfer learning wraps a whole ``keras.applications`` base in a new
model (``x = base(inp)``) and ConvNeXt nests ``Sequential`` blocks; the engine wants one graph.
:func:`flatten` rewrites such a config, before ``config.parse`` reads it, into one Functional
config whose layers are the nested ones renamed ``<model>/<layer>`` (addressable by that name in
``pipeline.stages`` and the reports) with each nested input wired to the tensor the model was
called on and each read of the model's output wired to its output layer. A ``trainable=False``
on a nested model is handed down to its layers, as Keras' ``Layer.trainable`` setter does.

What the flat graph loses is kept in a :class:`Nesting`: each nested model's class, name and
``trainable``, and every layer's ``model.weights.h5`` group (Keras saves a nested model's
layers under ``layers/functional/layers/conv2d``, numbered per class inside each model; a
Functional level counts its InputLayer, a Sequential one does not). :func:`nest` folds a flat
exported config back into the nested models, so Keras loads the export as the user built it.
A nested model called more than once (a Siamese tower) is expanded once per call: its layers
appear once, with one inbound node per call (call ``j`` reads and writes node ``j``), which is
exactly a shared layer for ``keras.shared`` to run (one op per call, the weight gradients
summed); :func:`nest` folds it back into one nested model with one inbound node per call.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace
from typing import Any

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.keras.entry import snake_case
from ringtrain_trainer.keras.functional import history

MODELS = ("Functional", "Model", "Sequential")
_MODULE = {"Sequential": "keras", "Functional": "keras.src.models.functional"}
Ref = tuple[str, int, int]


@dataclass(frozen=True)
class Group:
    """One nested model: its flat name prefix (``base/``), Keras class and ``trainable``."""

    prefix: str
    cls: str
    trainable: bool
    input_name: str
    #: how many times the model is called (a Siamese tower: 2)
    calls: int = 1


@dataclass(frozen=True)
class Nesting:
    """What :func:`flatten` took apart: the nested models (outermost first) and each layer's
    ``model.weights.h5`` group by flat name, with the empty groups Keras also writes."""

    groups: tuple[Group, ...] = ()
    h5: dict[str, str] = field(default_factory=dict, hash=False)
    empty: tuple[str, ...] = ()


def is_model(layer: Any) -> bool:
    return isinstance(layer, dict) and layer.get("class_name") in MODELS


def _tensor(ref: Ref, shape: Any = None) -> dict:
    return {
        "class_name": "__keras_tensor__",
        "config": {"shape": shape, "dtype": "float32", "keras_history": list(ref)},
    }


def _remap(v: Any, to) -> Any:
    """``v`` (a node's args) with every ``keras_history`` passed through ``to``."""
    if isinstance(v, dict):
        if v.get("class_name") == "__keras_tensor__":
            out = copy.deepcopy(v)
            h = (out.get("config") or {}).get("keras_history")
            if isinstance(h, list) and len(h) == 3:
                out["config"]["keras_history"] = list(to((str(h[0]), int(h[1]), int(h[2]))))
            return out
        return {k: _remap(x, to) for k, x in v.items()}
    if isinstance(v, list):
        return [_remap(x, to) for x in v]
    return v


def _name(layer: dict, i: int) -> str:
    return str(layer.get("name") or (layer.get("config") or {}).get("name") or f"layer_{i}")


class _Flattener:
    def __init__(self) -> None:
        self.layers: list[dict] = []
        self.groups: list[Group] = []
        self.h5: dict[str, str] = {}
        self.empty: list[str] = []

    def _h5(self, path: str, counts: dict[str, int], cls: str) -> str:
        base = "functional" if cls == "Model" else snake_case(cls)
        n = counts.get(base, -1) + 1
        counts[base] = n
        return f"{path}layers/{base}" + (f"_{n}" if n else "")

    def _frozen(self, layer: dict, frozen: bool) -> dict:
        layer = copy.deepcopy(layer)
        if frozen:
            layer.setdefault("config", {})["trainable"] = False
        return layer

    def _add(
        self, layer: dict, prefix: str, frozen: bool, group: str, nodes: list, call: int = 0
    ) -> Ref:
        """One plain layer, renamed and rewired; returns the reference to its output. Call
        ``call`` > 0 of a shared nested model adds its node to the layer the first call added."""
        name = prefix + _name(layer, len(self.layers))
        if call:
            (out,) = [x for x in self.layers if x["name"] == name]
            out["inbound_nodes"].extend(nodes)
            return (name, call, 0)
        out = self._frozen(layer, frozen)
        out["name"] = name
        out.setdefault("config", {})["name"] = name
        out["inbound_nodes"] = nodes
        self.layers.append(out)
        self.h5[name] = group
        return (name, 0, 0)

    def model(
        self, item: dict, prefix: str, inputs: list[Ref], frozen: bool, path: str, call: int = 0
    ) -> Ref:
        """Expand nested model ``item`` called (its ``call``-th call) on ``inputs``; returns
        its output reference."""
        cfg = item.get("config") or {}
        where = f"nested model {prefix[:-1]!r} ({item.get('class_name')})"
        frozen = frozen or cfg.get("trainable", True) is False
        layers = [x for x in cfg.get("layers") or [] if isinstance(x, dict)]
        if item.get("class_name") == "Sequential":
            return self._sequential(layers, prefix, inputs, frozen, path, where, item, call)
        return self._functional(cfg, layers, prefix, inputs, frozen, path, where, item, call)

    def _group(
        self, item: dict, prefix: str, frozen: bool, path: str, input_name: str, call: int
    ) -> None:
        if call:  # a later call of a shared nested model: the first one recorded it
            k = next(i for i, g in enumerate(self.groups) if g.prefix == prefix)
            self.groups[k] = replace(self.groups[k], calls=max(self.groups[k].calls, call + 1))
            return
        cls = "Functional" if item.get("class_name") == "Model" else str(item.get("class_name"))
        trainable = (item.get("config") or {}).get("trainable", True) is not False
        self.groups.append(Group(prefix, cls, trainable and not frozen, input_name))
        self.empty.append(f"{path}vars")

    def _sequential(self, layers, prefix, inputs, frozen, path, where, item, call=0) -> Ref:
        if len(inputs) != 1:
            raise InvalidSpec(f"model: {where} is called on {len(inputs)} tensors (supported: 1)")
        inp = next((x for x in layers if x.get("class_name") == "InputLayer"), None)
        self._group(item, prefix, frozen, path, _name(inp, 0) if inp else "input_layer", call)
        ref, counts = inputs[0], dict[str, int]()
        for x in layers:
            if x.get("class_name") == "InputLayer":
                continue
            group = self._h5(path, counts, str(x.get("class_name")))
            nodes = [{"args": [_tensor(ref)], "kwargs": {}}]
            if is_model(x):
                inner = prefix + _name(x, 0) + "/"
                ref = self.model(x, inner, [ref], frozen, group + "/", call)
            else:
                ref = self._add(x, prefix, frozen, group, nodes, call)
        return ref

    def _functional(self, cfg, layers, prefix, inputs, frozen, path, where, item, call=0) -> Ref:
        ins = cfg.get("input_layers")
        ins = [ins] if isinstance(ins, list) and ins and isinstance(ins[0], str) else ins or []
        if len(ins) != len(inputs):
            raise InvalidSpec(
                f"model: {where} takes {len(ins)} inputs and is called on {len(inputs)}"
            )
        self._group(item, prefix, frozen, path, str(ins[0][0]) if ins else "input_layer", call)
        refs: dict[Ref, Ref] = {(str(i[0]), 0, 0): r for i, r in zip(ins, inputs, strict=True)}
        outs: dict[str, dict[int, Ref]] = {}
        counts: dict[str, int] = {}

        def to(h: Ref) -> Ref:
            if h in refs:
                return refs[h]
            if h[0] in outs:
                return outs[h[0]][h[1]]
            return (prefix + h[0], h[1] + call, h[2])

        for i, x in enumerate(layers):
            cls = str(x.get("class_name"))
            group = self._h5(path, counts, cls)
            if cls == "InputLayer":
                if not call:
                    self.empty.append(f"{group}/vars")
                continue
            nodes = x.get("inbound_nodes") or []
            if not nodes:
                continue
            if len(nodes) > 1 and call:
                raise InvalidSpec(
                    f"model: {where}: {_name(x, i)!r} is called {len(nodes)} times inside a "
                    "nested model: not supported (supported: layers and nested models shared "
                    "at the top level, a nested model shared as a whole)"
                )
            if is_model(x):
                inner = prefix + _name(x, i) + "/"
                for j, node in enumerate(nodes):
                    if not isinstance(node, dict):
                        raise InvalidSpec(
                            f"model: nested model {_name(x, i)!r} in a tf.keras 2 config is "
                            "not supported (supported: Keras 3 configs)"
                        )
                    hist = [to(h) for h in history(node.get("args") or [], where)]
                    out = self.model(x, inner, hist, frozen, group + "/", call + j)
                    outs.setdefault(_name(x, i), {})[j] = out
            else:
                self._add(x, prefix, frozen, group, _remap(nodes, to), call)
        o = cfg.get("output_layers")
        o = o[0] if isinstance(o, list) and o and isinstance(o[0], list) else o
        if not isinstance(o, list) or len(o) != 3:
            raise InvalidSpec(f"model: {where}: output_layers={o!r} (supported: one output)")
        return to((str(o[0]), int(o[1]), int(o[2])))


def flatten(model: dict) -> tuple[dict, Nesting]:
    """``model`` with every nested model expanded (the model itself when it nests none)."""
    cfg = model.get("config") or {}
    layers = cfg.get("layers")
    if not isinstance(layers, list) or not any(is_model(x) for x in layers):
        return model, Nesting()
    f = _Flattener()
    top = {"config": {**cfg, "trainable": True}, "class_name": model.get("class_name")}
    frozen = cfg.get("trainable", True) is False
    if model.get("class_name") == "Sequential":
        inp = next((x for x in layers if x.get("class_name") == "InputLayer"), None)
        if inp is None:
            shape = cfg.get("build_input_shape")
            inp = {"class_name": "InputLayer", "config": {"batch_shape": shape}}
        inp = copy.deepcopy(inp)
        name = str((inp.get("config") or {}).get("name") or "input_layer")
        inp["name"] = inp["config"]["name"] = name
        out = f._sequential(layers, "", [(name, 0, 0)], frozen, "", "the model", top)
        ins: Any = [name, 0, 0]  # Keras JSON as written: one [name, 0, 0] or a list of them
        first = [inp]
    else:
        ins = cfg.get("input_layers")
        first = [copy.deepcopy(x) for x in layers if x.get("class_name") == "InputLayer"]
        ends = ins if ins and isinstance(ins[0], list) else [ins]
        out = f._functional(
            cfg, layers, "", [(str(e[0]), 0, 0) for e in ends], frozen, "", "the model", top
        )
    f.groups.pop(0)  # the model itself
    f.empty.remove("vars")
    flat = {
        **{k: v for k, v in model.items() if k != "config"},
        "class_name": "Functional",
        "config": {
            **{k: v for k, v in cfg.items() if k not in ("layers", "build_input_shape")},
            "trainable": True,
            "layers": [*first, *f.layers],
            "input_layers": ins,
            "output_layers": list(out),
        },
    }
    return flat, Nesting(tuple(f.groups), f.h5, tuple(f.empty))


def nest(flat: dict, nesting: Nesting) -> dict:
    """The inverse of :func:`flatten` for an exported flat Functional config: each group's
    layers folded back into a nested model of its class (innermost first)."""
    if not nesting.groups:
        return flat
    flat = copy.deepcopy(flat)
    layers: list[dict] = flat["config"]["layers"]
    for g in sorted(nesting.groups, key=lambda g: -g.prefix.count("/")):
        name = g.prefix[:-1]
        mine = [x for x in layers if x["name"].startswith(g.prefix)]
        mine = [x for x in mine if "/" not in x["name"][len(g.prefix) :]]
        names = {x["name"] for x in mine}
        srcs = [_source(mine, names, j, g.calls) for j in range(g.calls)]
        read = {
            a["config"]["keras_history"][0]
            for x in layers
            if x["name"] not in names
            for node in x.get("inbound_nodes") or []
            for a in _walk(node.get("args"))
        } | {o[0] for o in _ends(flat["config"]["output_layers"])}
        (out,) = [n for n in names if n in read]
        strip = len(g.prefix)

        def inner(h: Ref, src_name=srcs[0]["config"]["keras_history"][0], g=g, k=strip) -> Ref:
            return (g.input_name, 0, 0) if h[0] == src_name else (h[0][k:], h[1], h[2])

        body = []
        for x in mine:
            y = copy.deepcopy(x)
            y["name"] = y["config"]["name"] = x["name"][strip:]
            nodes = x["inbound_nodes"][: len(x["inbound_nodes"]) // g.calls]
            y["inbound_nodes"] = _remap(nodes, inner)
            if g.cls == "Sequential":
                y.pop("inbound_nodes")
                y.pop("name")
            body.append(y)
        shape = srcs[0]["config"].get("shape")
        inp: dict[str, Any] = {
            "module": "keras.layers",
            "class_name": "InputLayer",
            "config": {"batch_shape": shape, "dtype": "float32", "name": g.input_name},
            "registered_name": None,
        }
        if g.cls != "Sequential":
            inp["name"], inp["inbound_nodes"] = g.input_name, []
        config = {"name": name, "trainable": g.trainable, "layers": [inp, *body]}
        if g.cls != "Sequential":
            config["input_layers"] = [g.input_name, 0, 0]
            config["output_layers"] = [out[strip:], 0, 0]
        item = {
            "module": _MODULE[g.cls],
            "class_name": g.cls,
            "config": config,
            "registered_name": None,
            "build_config": {"input_shape": shape},
            "name": name,
            "inbound_nodes": [{"args": [copy.deepcopy(src)], "kwargs": {}} for src in srcs],
        }
        at = layers.index(mine[0])
        layers[:] = [*layers[:at], item, *[x for x in layers[at:] if x["name"] not in names]]

        def outer(h: Ref, out=out, name=name) -> Ref:
            return (name, h[1], 0) if h[0] == out else h

        for x in layers:
            x["inbound_nodes"] = _remap(x.get("inbound_nodes") or [], outer)
        o = flat["config"]["output_layers"]
        ends = [list(outer((e[0], e[1], e[2]))) for e in _ends(o)]
        flat["config"]["output_layers"] = ends if isinstance(o[0], list) else ends[0]
    return flat


def _ends(v: list) -> list[list]:
    """``output_layers``: one ``[name, node, tensor]`` or a list of them, as a list."""
    return v if v and isinstance(v[0], list) else [v]


def _source(mine: list[dict], names: set[str], call: int, calls: int) -> dict:
    """The one tensor from outside a nested model's layers that its ``call``-th call reads
    (a shared model's layers have one node per call; a model called once may share a layer
    inside: every node is then its only call's)."""
    (src,) = {
        tuple(a["config"]["keras_history"]): a
        for x in mine
        for node in x["inbound_nodes"][call::calls]
        for a in _walk(node.get("args"))
        if a["config"]["keras_history"][0] not in names
    }.values()
    return src


def _walk(v: Any):
    """Every Keras tensor in a node's args."""
    if isinstance(v, dict):
        if v.get("class_name") == "__keras_tensor__":
            yield v
        else:
            for x in v.values():
                yield from _walk(x)
    elif isinstance(v, list):
        for x in v:
            yield from _walk(x)
