"""An ONNX model from a Keras config and its weights (`ringtrain export --format onnx`).

Pipeline position: beside ``keras.archive``, from the same ``(config, weights)``, parsed by
``keras.config`` into a layer graph whose every layer appends its own nodes (its registry
entry's ``onnx``). The graph takes what the Keras model takes — float32 ``(batch, …)``,
channels last, the batch dynamic — and returns what it returns. ONNX convolutions and pools
are channels-first, so the writer tracks each tensor's layout: a layer asks for its input as
NCHW or NHWC (or either, for element-wise layers), a transpose is added only where the layout
changes and at most once per tensor (a residual branch reuses it), and the output is NHWC, which
keeps Keras' flatten order. ``padding="same"`` becomes TensorFlow's explicit pads;
BatchNormalization is folded to ``x * a + b`` with its moving statistics (inference).

Opset 17 (IR version 8): every operator used here is stable at that version and it is read by
onnxruntime releases from 1.13 on.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ringtrain import files
from ringtrain.errors import InvalidSpec
from ringtrain_trainer.keras import masks
from ringtrain_trainer.keras.archive import bind
from ringtrain_trainer.keras.config import fix_input_shape, free_input_shape, parse
from ringtrain_trainer.keras.layer_spec import LayerSpec
from ringtrain_trainer.keras.registry import REGISTRY

OPSET = 17
IR_VERSION = 8
INPUT, OUTPUT = "input", "output"
_NCHW, _NHWC = (0, 3, 1, 2), (0, 2, 3, 1)
_ACT = {"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh"}


def _onnx():
    try:
        import onnx
    except ImportError:
        raise InvalidSpec("--format onnx needs the onnx package (pip install onnx)") from None
    return onnx


class OnnxGraph:
    """Nodes and initializers being built; per Keras tensor its ONNX name, layout and rank.
    An entry's ``onnx(g, spec, weights)`` reads its inputs with :meth:`x`, adds nodes with
    :meth:`op` / :meth:`const` and names its output with :meth:`out`; :attr:`nchw` is the
    layout of what it is computing (set by :meth:`x`)."""

    def __init__(self, onnx, rank: int):
        self.onnx, self.h = onnx, onnx.helper
        self.nodes: list = []
        self.inits: list = []
        self.tensors: dict[int, tuple[str, bool, int]] = {0: (INPUT, False, rank)}
        self._moved: dict[tuple[str, bool], str] = {}
        self.spec: LayerSpec | None = None  # the layer being lowered, set by to_onnx
        self.nchw = False
        self._n = 0

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, hint: str, value) -> str:
        name = self.name(hint)
        self.inits.append(self.onnx.numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op: str, inputs: list[str], hint: str, **attrs) -> str:
        out = self.name(hint)
        self.nodes.append(self.h.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def x(self, k: int = 0, nchw: bool | None = None) -> str:
        """Input ``k`` of the current layer, in layout ``nchw`` (None: as it is)."""
        assert self.spec is not None
        return self.tensor(self.spec.inputs[k], nchw)

    def tensor(self, t: int, nchw: bool | None = None) -> str:
        """Keras tensor ``t`` in layout ``nchw`` (None: as it is); a transpose is made once."""
        name, is_nchw, rank = self.tensors[t]
        if rank != 4 or nchw is None or nchw == is_nchw:
            self.nchw = is_nchw and rank == 4
            return name
        key = (name, nchw)
        if key not in self._moved:
            hint = "to_nchw" if nchw else "to_nhwc"
            self._moved[key] = self.op(
                "Transpose", [name], hint, perm=list(_NCHW if nchw else _NHWC)
            )
        self.nchw = nchw
        return self._moved[key]

    def xs(self) -> list[str]:
        """Every input of the current layer, in the first one's layout."""
        first = self.x(0)
        layout = self.nchw
        assert self.spec is not None
        rest = [self.x(k, layout) for k in range(1, len(self.spec.inputs))]
        self.nchw = layout
        return [first, *rest]

    def out(self, name: str) -> None:
        assert self.spec is not None
        self.tensors[self.spec.output] = (name, self.nchw, len(self.spec.out_shape) + 1)

    def per_channel(self, hint: str, v) -> str:
        """A per-channel constant broadcast along the channel axis of the current layout."""
        v = np.asarray(v, np.float32)
        return self.const(hint, v.reshape(-1, 1, 1) if self.nchw and v.size > 1 else v)

    def act(self, x: str, act: str, hint: str | None = None) -> str:
        if not hint:
            assert self.spec is not None
            hint = f"{self.spec.name}_act"
        if act == "linear":
            return x
        if act == "softmax":
            return self.op("Softmax", [x], hint, axis=1 if self.nchw else -1)
        return self.op(_ACT[act], [x], hint)


def io_names(cfg) -> tuple[list[str], list[str]]:
    """The ONNX graph's input and output names: ``input`` / ``output`` for a model with one
    of each (as always), the Keras input and output names where it has several."""
    ins = [x.name for x in cfg.inputs] if len(cfg.inputs) > 1 else [INPUT]
    outs = list(cfg.output_names) if len(cfg.outputs) > 1 else [OUTPUT]
    return ins, outs


def to_onnx(keras_config: dict, weights: list[np.ndarray], input_shape=None):
    """The ``onnx.ModelProto``; :func:`write_onnx` checks and saves it. ``input_shape``: the
    shape the run compiled where the config's input has None dimensions; they stay symbolic
    in the graph's input (``dim1``, ...), so onnxruntime takes any length as Keras does."""
    onnx = _onnx()
    declared = free_input_shape(keras_config)
    if declared is not None and input_shape is not None:
        keras_config = fix_input_shape(keras_config, input_shape)
    cfg = parse(keras_config, compiled=False)
    masked = masks.readers(cfg.layers, masks.propagate(cfg.layers, cfg.outputs))
    if masked:
        s = masked[0]
        raise InvalidSpec(
            f"export: layer {s.name!r} ({s.cls}) reads a Keras mask (Embedding(mask_zero=True) "
            "or Masking): ONNX export of masks is not supported (the .keras export keeps them)"
        )
    dims = [f"dim{i + 1}" if declared and declared[i] is None else d for i, d in
            enumerate(cfg.input_shape)]  # fmt: skip
    arrays = bind(cfg, weights)
    g = OnnxGraph(onnx, len(cfg.input_shape) + 1)
    ins, outs = io_names(cfg)
    for x, name in zip(cfg.inputs, ins, strict=True):
        g.tensors[x.tensor] = (name, False, len(x.shape) + 1)
    for s, ws in zip(cfg.layers, arrays, strict=True):
        g.spec = s
        REGISTRY[s.cls].onnx(g, s, ws)
    f32 = onnx.TensorProto.FLOAT
    out_infos = []
    for t, name in zip(cfg.outputs or (cfg.output,), outs, strict=True):
        g.nodes.append(onnx.helper.make_node("Identity", [g.tensor(t, False)], [name], name=name))
        out_infos.append(
            onnx.helper.make_tensor_value_info(name, f32, ["batch", *cfg.out_shape_of(t)])
        )
    in_infos = [
        onnx.helper.make_tensor_value_info(name, f32, ["batch", *(dims if k == 0 else x.shape)])
        for k, (x, name) in enumerate(zip(cfg.inputs, ins, strict=True))
    ]
    graph = onnx.helper.make_graph(g.nodes, cfg.name, in_infos, out_infos, initializer=g.inits)
    model = onnx.helper.make_model(
        graph, producer_name="ringtrain", opset_imports=[onnx.helper.make_opsetid("", OPSET)]
    )
    model.ir_version = IR_VERSION
    return model


def write_onnx(
    path: str | os.PathLike, keras_config: dict, weights: list[np.ndarray], input_shape=None
) -> Path:
    """Write the model as ONNX (opset 17, NHWC float32 input named ``input``), checked by
    ``onnx.checker`` before it is saved (``input_shape``: see :func:`to_onnx`)."""
    onnx = _onnx()
    model = to_onnx(keras_config, weights, input_shape)
    onnx.checker.check_model(model, full_check=True)
    return files.atomic_write(path, model.SerializeToString())
