"""An ONNX model from a Keras Sequential config and its weights (`ringtrain export --format onnx`).

Pipeline position: beside :mod:`keras_file`, from the same ``(config, weights)``. The graph
takes what the Keras model takes — float32 ``(batch, H, W, C)``, channels last, the batch
dynamic — and returns what it returns. ONNX convolutions and pools are channels-first, so the
writer tracks the layout: a run of spatial layers is wrapped in one transpose to NCHW and one
back (before Flatten, Reshape, Dense, Softmax or the output), which keeps Keras' NHWC flatten
order. ``padding="same"`` becomes TensorFlow's explicit pads (the extra one at the end);
BatchNormalization is folded to ``x * a + b`` with its moving statistics (inference).

Opset 17 (IR version 8): every operator used here is stable at that version and it is read by
onnxruntime releases from 1.13 on.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ringtrain.errors import InvalidSpec
from ringtrain_trainer.export.layers import Layer, activation_name, bind, input_shape, pair

OPSET = 17
IR_VERSION = 8
INPUT, OUTPUT = "input", "output"
_NCHW, _NHWC = (0, 3, 1, 2), (0, 2, 3, 1)


def _onnx():
    try:
        import onnx
    except ImportError:
        raise InvalidSpec("--format onnx needs the onnx package (pip install onnx)") from None
    return onnx


def _same_pads(n: int, k: int, s: int) -> tuple[int, int]:
    total = max((-(-n // s) - 1) * s + k - n, 0)
    return total // 2, total - total // 2


class _Graph:
    """Nodes and initializers being built, and the current tensor with its layout."""

    def __init__(self, onnx, rank: int):
        self.onnx, self.h = onnx, onnx.helper
        self.nodes: list = []
        self.inits: list = []
        self.x, self.nchw, self.rank = INPUT, False, rank
        self._n = 0

    def name(self, hint: str) -> str:
        self._n += 1
        return f"{hint}_{self._n}"

    def const(self, hint: str, value: np.ndarray) -> str:
        name = self.name(hint)
        self.inits.append(self.onnx.numpy_helper.from_array(np.asarray(value), name))
        return name

    def op(self, op: str, inputs: list[str], hint: str, **attrs) -> str:
        out = self.name(hint)
        self.nodes.append(self.h.make_node(op, [self.x, *inputs], [out], name=out, **attrs))
        self.x = out
        return out

    def layout(self, nchw: bool) -> None:
        if self.rank == 4 and self.nchw != nchw:
            self.op(
                "Transpose",
                [],
                "to_nchw" if nchw else "to_nhwc",
                perm=list(_NCHW if nchw else _NHWC),
            )
            self.nchw = nchw

    def per_channel(self, hint: str, v: np.ndarray) -> str:
        """A per-channel constant broadcast along the channel axis of the current layout."""
        v = np.asarray(v, np.float32)
        return self.const(hint, v.reshape(-1, 1, 1) if self.nchw and v.size > 1 else v)

    def activation(self, act: str, hint: str) -> None:
        if act == "linear":
            return
        if act == "softmax":
            self.layout(False)
            self.op("Softmax", [], hint, axis=-1)
        else:
            self.op({"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh"}[act], [], hint)


def _emit(g: _Graph, layer: Layer) -> None:
    c, n = layer.cfg, layer.name
    cls = layer.cls
    if cls == "Conv2D":
        g.layout(True)
        kh, kw, _, _ = layer.weight_shapes[0]
        sh, sw = pair(c.get("strides", 1), "strides", n)
        pads = [0, 0, 0, 0]
        if c.get("padding", "valid") == "same":
            (t, b), (l_, r) = (
                _same_pads(layer.in_shape[0], kh, sh),
                _same_pads(layer.in_shape[1], kw, sw),
            )
            pads = [t, l_, b, r]
        inputs = [g.const(f"{n}_kernel", layer.weights[0].transpose(3, 2, 0, 1))]
        if len(layer.weights) > 1:
            inputs.append(g.const(f"{n}_bias", layer.weights[1]))
        g.op("Conv", inputs, n, kernel_shape=[kh, kw], strides=[sh, sw], pads=pads)
        g.activation(activation_name(layer, c.get("activation")), f"{n}_act")
    elif cls in ("MaxPooling2D", "AveragePooling2D"):
        g.layout(True)
        ph, pw = pair(c.get("pool_size", 2), "pool_size", n)
        sh, sw = pair(c.get("strides") or (ph, pw), "strides", n)
        pads = [0, 0, 0, 0]
        if c.get("padding", "valid") == "same":
            (t, b), (l_, r) = (
                _same_pads(layer.in_shape[0], ph, sh),
                _same_pads(layer.in_shape[1], pw, sw),
            )
            pads = [t, l_, b, r]
        op = "MaxPool" if cls == "MaxPooling2D" else "AveragePool"
        extra = {} if op == "MaxPool" else {"count_include_pad": 0}
        g.op(op, [], n, kernel_shape=[ph, pw], strides=[sh, sw], pads=pads, **extra)
    elif cls == "GlobalAveragePooling2D":
        g.layout(True)
        g.op("GlobalAveragePool", [], n)
        if not c.get("keepdims"):
            g.op("Flatten", [], f"{n}_squeeze", axis=1)
            g.rank, g.nchw = 2, False
    elif cls in ("Flatten", "Reshape"):
        g.layout(False)
        target = [0, -1] if cls == "Flatten" else [0, *layer.out_shape]
        g.op("Reshape", [g.const(f"{n}_shape", np.array(target, np.int64))], n)
        g.rank = len(layer.out_shape) + 1
    elif cls == "Rescaling":
        scale, offset = (
            np.asarray(c.get(k, d), np.float32) for k, d in (("scale", 1.0), ("offset", 0.0))
        )
        g.op("Mul", [g.per_channel(f"{n}_scale", scale)], n)
        g.op("Add", [g.per_channel(f"{n}_offset", offset)], f"{n}_offset")
    elif cls == "Dense":
        g.layout(False)
        g.op("MatMul", [g.const(f"{n}_kernel", layer.weights[0])], n)
        if len(layer.weights) > 1:
            g.op("Add", [g.const(f"{n}_bias", layer.weights[1])], f"{n}_bias")
        g.activation(activation_name(layer, c.get("activation")), f"{n}_act")
    elif cls == "BatchNormalization":
        w = list(layer.weights)
        gamma = w.pop(0) if c.get("scale", True) else 1.0
        beta = w.pop(0) if c.get("center", True) else 0.0
        mean, var = w
        a = gamma / np.sqrt(var + np.float32(c.get("epsilon", 1e-3)))
        g.op("Mul", [g.per_channel(f"{n}_a", a)], n)
        g.op("Add", [g.per_channel(f"{n}_b", beta - mean * a)], f"{n}_b")
    elif cls == "Activation":
        g.activation(activation_name(layer, c.get("activation")), n)
    elif cls == "ReLU":
        g.activation("relu", n)
    elif cls == "Softmax":
        g.activation("softmax", n)
    # Dropout: the identity at inference


def to_onnx(keras_config: dict, weights: list[np.ndarray]):
    """The ``onnx.ModelProto``; :func:`write_onnx` checks and saves it."""
    onnx = _onnx()
    layers = bind(keras_config, weights)
    shape = input_shape(keras_config)
    g = _Graph(onnx, len(shape) + 1)
    for layer in layers:
        _emit(g, layer)
    g.layout(False)
    g.nodes.append(onnx.helper.make_node("Identity", [g.x], [OUTPUT], name=OUTPUT))
    out_shape = layers[-1].out_shape if layers else shape
    f32 = onnx.TensorProto.FLOAT
    graph = onnx.helper.make_graph(
        g.nodes,
        (keras_config.get("config") or {}).get("name", "sequential"),
        [onnx.helper.make_tensor_value_info(INPUT, f32, ["batch", *shape])],
        [onnx.helper.make_tensor_value_info(OUTPUT, f32, ["batch", *out_shape])],
        initializer=g.inits,
    )
    model = onnx.helper.make_model(
        graph, producer_name="ringtrain", opset_imports=[onnx.helper.make_opsetid("", OPSET)]
    )
    model.ir_version = IR_VERSION
    return model


def write_onnx(path: str | os.PathLike, keras_config: dict, weights: list[np.ndarray]) -> Path:
    """Write the model as ONNX (opset 17, NHWC float32 input named ``input``), checked by
    ``onnx.checker`` before it is saved."""
    onnx = _onnx()
    model = to_onnx(keras_config, weights)
    onnx.checker.check_model(model, full_check=True)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(model.SerializeToString())
    os.replace(tmp, path)
    return path
