"""The op protocol every engine op speaks, with its defaults.

Pipeline position: ``keras.lowering`` builds one op per Keras layer (its registry entry's
``build``), ``engine.graph`` wires them, ``engine.program.Program`` drives them all through this
protocol: ``params(layer)``, ``state_specs``, ``buffers(batch, train, need_dx)``, ``flops``,
``bind(ws, batch)``, ``forward(ws, *inputs, **params)``, and backward in three parts —
``backward_local(ws, dout)`` (the gradient through the op's own activation or pooling, shared by
the two halves), ``backward_input(ws, dout, **params)`` (the input gradient; one per input for a
multi-input op such as ``Add``) and ``backward_weights(ws, dout, name, grad, rows)`` (one row
block of one parameter's gradient). Which half runs first, how a gradient is cut into pieces
(``engine.plan``) and when a piece is announced ready is the engine's decision, made once for
every op. Every buffer is allocated by the Program at compile time; a training program is
recognised by its training buffers (``dz``, ``mask``, ...), so one class serves both kinds of
program.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ringtrain_trainer.engine.tensor import ParamSpec


class Op:
    """Defaults for the protocol: no parameters, no state, no fused tail in backward."""

    kind = "layer"
    name = ""
    #: one example's input and output shapes (set by each op's constructor)
    in_shape: tuple[int, ...]
    out_shape: tuple[int, ...]
    #: batch statistics: the replica's batch must not be split across host threads
    batch_coupled = False

    def params(self, layer: int) -> list[ParamSpec]:
        return []

    def state_specs(self) -> list[tuple[str, int, float]]:
        return []

    def flops(self, b: int, train: bool, need_dx: bool) -> int:
        return 0

    def bind(self, ws: Any, b: int) -> None:
        pass

    def out_and_dx(self, b: int, train: bool, need_dx: bool) -> dict:
        """The buffers of an op that writes one output and, when trained with an input
        gradient, one input-shaped gradient: what ``buffers`` of most shape and elementwise
        ops is, or starts from."""
        bufs = {"out": ((b, *self.out_shape), "f")}
        if train and need_dx:
            bufs["dx"] = ((b, *self.in_shape), "f")
        return bufs

    def backward_local(self, ws: Any, dout: np.ndarray) -> None:
        """The gradient through the op's own fused tail (its activation, its pooling) that both
        :meth:`backward_input` and :meth:`backward_weights` read; run first, once."""

    def backward_weights(self, ws: Any, dout, name: str, grad: np.ndarray, rows) -> None:
        """Write rows ``rows = (lo, hi)`` of parameter ``name``'s gradient into ``grad`` (the
        whole parameter's gradient, rows counted on its ``(size // shape[-1], shape[-1])``
        matrix view). Only layers with parameters are asked."""
        raise NotImplementedError(f"{type(self).__name__} has no parameters")
