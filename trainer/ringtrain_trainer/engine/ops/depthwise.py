"""DepthwiseConv1D/2D (``depth_multiplier``) and SeparableConv1D/2D (depthwise, then a
pointwise product, then bias and activation), channels last.

Why not im2col + BLAS here: each channel has its own tiny filter, so there is no shared matrix
to multiply; the op is memory-bound and runs as one multiply-add over the whole batch per
kernel tap (``kh * kw`` vectorised passes), with one planned product buffer. The passes run
in a *wide* layout (every padded position of the flat input is an output, the strided valid
ones copied out once): a tap is then one contiguous slice at a fixed offset, periodic in ``c``,
so it takes the tap's kernel as one 512-float tile (:mod:`.tiles`) and numpy's inner loop is
the tile long, not ``c`` floats nor a padded row (the zoo's 6×6×8 depthwise at batch 32,
forward + backward: 496–585 → 413–465 µs, bit-identical). A strided op first deals the padded
input into its ``sh * sw`` stride phases, so each tap is a stride-1 tap of one phase and no
output is computed that the stride drops. py-spy, the zoo's depthwise block, one thread: 8.1 → 5.5
CPU ms per step (wide) → 4.6 (phases) (README, issue 24). Output channel
``c * depth_multiplier + m`` is input channel ``c`` under filter ``m``, as Keras orders them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ringtrain_trainer.engine import native
from ringtrain_trainer.engine.op import Op
from ringtrain_trainer.engine.ops import activations, tiles
from ringtrain_trainer.engine.ops.window import Window
from ringtrain_trainer.engine.tensor import ParamSpec


class Depthwise(Window, Op):
    """Keras ``DepthwiseConv1D`` / ``DepthwiseConv2D``: kernel ``(*kernel, cin, multiplier)``."""

    kind = "conv"

    def __init__(
        self,
        in_shape,
        kernel,
        strides=1,
        padding: str = "valid",
        dilation=1,
        depth_multiplier: int = 1,
        activation="linear",
        use_bias: bool = True,
    ):
        self._geometry(in_shape, kernel, strides, padding, dilation)
        self.m, self.use_bias = int(depth_multiplier), use_bias
        self.act = activations.resolve(activation)
        self.kshape = self.k[1:] if self.rank == 1 else self.k
        self.cout = self.cin * self.m
        self.out_shape = (*self.out_hw, self.cout)

    def params(self, layer: int) -> list[ParamSpec]:
        r = math.prod(self.kshape)
        shape = (*self.kshape, self.cin, self.m)
        ps = [ParamSpec(layer, "kernel", shape, r * self.cin, r * self.m, True)]
        return ps + ([ParamSpec(layer, "bias", (self.cout,), 0, 0, False)] if self.use_bias else [])

    def _wide(self):
        """The wide layout: the padded input split into ``sh * sw`` stride phases (one phase,
        the padded input itself, at stride 1), each ``(b, hq, wq, c)``, so that every tap is
        a stride-1 tap of one phase. Returns ((hq, wq), flat offset of every tap)."""
        (sh, sw), (dh, dw), (hp, wp, c) = self.s, self.d, self.padded
        hq, wq = -(-hp // sh), -(-wp // sw)
        plane = hq * wq * c  # per example; phase k of the batch starts at k * b * plane
        offs = [
            (((i * dh) % sh) * sw + (j * dw) % sw, ((i * dh) // sh * wq + (j * dw) // sw) * c)
            for i, j in self.taps()
        ]
        return (hq, wq), plane, offs

    def _offsets(self, b):
        _, plane, offs = self._wide()
        return [k * b * plane + o for k, o in offs]

    def buffers(self, b, train, need_dx):
        out = (b, *self.out_shape)
        (hq, wq), plane, offs = self._wide()
        phases, slack = math.prod(self.s), plane
        n, rows, row = phases * b * plane, b * hq, wq * self.cin
        bufs = {"out": (out, "f"), **self.act.buffers(out, train)}
        bufs["xw"] = ((n + slack,), "f")
        if phases > 1:
            bufs["xp"] = ((b, *self.padded), "f")
        bufs["zw"] = ((self.m, rows, row), "f")
        bufs["tmp"] = ((rows, row), "f")
        bufs["kt"] = ((len(offs), self.m, tiles.span(rows * row, self.cin)), "f")
        if self.use_bias:
            bufs["bt"] = ((tiles.span(math.prod(out), self.cout),), "f")
        if train:
            bufs["ones"] = ((rows * wq,), "f")
            bufs["dzw"] = ((self.m, rows, row), "f")
            if need_dx:
                bufs["dxw"] = ((n + slack,), "f")
                if phases > 1:
                    bufs["dxp"] = ((b, *self.padded), "f")
        return bufs

    def flops(self, b, train, need_dx):
        per = 2 * b * self.ho * self.wo * self.cout * math.prod(self.kshape)
        return per * (1 + (1 + need_dx if train else 0))

    def _phases(self, flat: np.ndarray, b: int):
        """(phase plane (b, hq, wq, c) view, the padded buffer's strided view it holds)."""
        (hq, wq), plane, _ = self._wide()
        (sh, sw), (hp, wp, c) = self.s, self.padded
        out = []
        for pi in range(sh):
            for pj in range(sw):
                k = pi * sw + pj
                p4 = flat[k * b * plane : (k + 1) * b * plane].reshape(b, hq, wq, c)
                h, w = -(-(hp - pi) // sh), -(-(wp - pj) // sw)
                out.append((p4[:, :h, :w], (slice(pi, None, sh), slice(pj, None, sw))))
        return out

    def bind(self, ws: dict[str, Any], b):
        for k in ("xw", "dzw", "dxw", "xp", "dxp"):
            if k in ws:
                ws[k].fill(0)  # pads, slack and the wide gradient's unused positions stay 0
        if "ones" in ws:
            ws["ones"].fill(1)
        (hq, wq), _, _ = self._wide()
        valid = [w.reshape(b, hq, wq, self.cin)[:, : self.ho, : self.wo] for w in ws["zw"]]
        ws["z4"] = valid
        if "dzw" in ws:
            ws["dz4"] = [w.reshape(b, hq, wq, self.cin)[:, : self.ho, : self.wo] for w in ws["dzw"]]
        ws["xphases"] = self._phases(ws["xw"], b)
        ws["x4"] = ws["xp"] if "xp" in ws else ws["xphases"][0][0]
        if "dxw" in ws:
            ws["dxphases"] = self._phases(ws["dxw"], b)
            dxp = ws["dxp"] if "dxp" in ws else ws["dxphases"][0][0]
            ws["dx"] = self.inner(dxp).reshape(b, *self.in_shape)
        # every pass's operands as views fixed here: a tap's slice of the wide input (or of
        # the wide input gradient) and the products, ``(n / L, L)`` for the tiles' span L
        n, span_ = ws["tmp"].size, ws["kt"].shape[-1]
        offs = self._offsets(b)
        ws["src"] = [ws["xw"][o : o + n].reshape(-1, span_) for o in offs]
        ws["zl"] = [z.reshape(-1, span_) for z in ws["zw"]]
        ws["tl"] = ws["tmp"].reshape(-1, span_)
        if "dzw" in ws:
            ws["dzl"] = [d.reshape(-1, span_) for d in ws["dzw"]]
            ws["sums"] = [ws["xw"][o : o + n].reshape(-1, self.cin) for o in offs]
        if "dxw" in ws:
            ws["dst"] = [ws["dxw"][o : o + n].reshape(-1, span_) for o in offs]
        self._bind_native(ws, b)

    def _bind_native(self, ws: dict[str, Any], b):
        """The compiled kernels (``depthwise.h``: every output summed over its taps in
        registers, written once) where the program is float32 and the padded input and its
        gradient are plain (B, Hp, Wp, C) buffers."""
        x4 = ws["x4"]
        dxp = (ws["dxp"] if "dxp" in ws else ws["dxphases"][0][0]) if "dxw" in ws else None
        ws["native"] = (
            native.kernels is not None
            and ws["out"].dtype == np.float32
            and x4.flags.c_contiguous
            and (dxp is None or dxp.flags.c_contiguous)
        )
        if ws["native"]:
            (kh, kw), (sh, sw), (dh, dw) = self.k, self.s, self.d
            hp, wp, c = self.padded
            ws["dims"] = (b, hp, wp, c, self.m, kh, kw, sh, sw, dh, dw, *self.osp)
            ws["dxpad"] = dxp
            ws["dk"] = np.zeros((kh * kw * c, self.m), np.float32)

    def _tile(self, ws: dict[str, Any], kernel):
        """Each tap's kernel repeated along the tiles' span, ``(taps, m, L)``: the wide layout
        is periodic in ``c``, so one tile serves every ``L`` floats of a pass (kept for
        backward's input gradient: the same step's kernel)."""
        kt, taps = ws["kt"], math.prod(self.k)
        tiles.fill(kt, kernel.reshape(taps, self.cin, self.m).transpose(0, 2, 1))
        return kt

    def forward(self, ws: dict[str, Any], x, kernel, bias=None):
        # Wide layout: every output is computed at every padded position of the flat
        # (b, hp, wp, c) input, so one tap is one contiguous slice at a fixed offset times
        # the tap's kernel tiled along a padded row — long inner loops instead of
        # ``c``-float ones; the valid (strided) outputs are copied out once per filter.
        np.copyto(self.inner(ws["x4"]), self.as2d(x))
        if ws["native"]:
            ws["kernel"] = kernel
            z = self.act.pre(ws)
            native.loaded().depthwise_forward(ws["x4"], kernel, z, ws["dims"])
            if bias is not None:
                tiles.add_bias(z.reshape(-1, self.cout), bias, ws["bt"])
            return self.act.run(ws)
        if "xp" in ws:  # strided: the padded input dealt into its phases
            for plane, (ri, ci) in ws["xphases"]:
                np.copyto(plane, ws["xp"][:, ri, ci])
        zl, t, kt = ws["zl"], ws["tl"], self._tile(ws, kernel)
        for n, src in enumerate(ws["src"]):
            for m in range(self.m):
                if n == 0:
                    np.multiply(src, kt[n, m], out=zl[m])
                else:
                    np.multiply(src, kt[n, m], out=t)
                    np.add(zl[m], t, out=zl[m])
        z = self.act.pre(ws)
        z5 = z.reshape(*ws["z4"][0].shape, self.m)
        for m in range(self.m):
            np.copyto(z5[..., m], ws["z4"][m])
        if bias is not None:
            tiles.add_bias(z, bias, ws["bt"])
        return self.act.run(ws)

    def backward_local(self, ws: dict[str, Any], dout):
        dz = self.act.grad(ws, dout)
        if ws["native"]:  # the kernel's and the input's gradients in one pass, here
            ws["dz2"] = dz.reshape(-1, self.cout)
            native.loaded().depthwise_backward(
                ws["x4"], np.ascontiguousarray(dz), ws["kernel"], ws["dk"], ws["dxpad"],
                ws["dims"],
            )  # fmt: skip
            return
        dz5 = dz.reshape(*ws["dz4"][0].shape, self.m)
        for m in range(self.m):
            np.copyto(ws["dz4"][m], dz5[..., m])
        ws["dz2"] = dz.reshape(-1, self.cout)

    def backward_weights(self, ws: dict[str, Any], dout, name, grad, rows):
        if name == "bias":
            n = ws["dz2"].shape[0]
            np.matmul(ws["ones"][:n], ws["dz2"], out=grad)
            return
        lo, hi = rows
        if ws["native"]:
            np.copyto(grad.reshape(-1, self.m)[lo:hi], ws["dk"][lo:hi])
            return
        c, g = self.cin, grad.reshape(-1, self.cin, self.m)
        t, ones = ws["tmp"].reshape(-1, c), ws["ones"]
        dz = [d.reshape(-1, c) for d in ws["dzw"]]
        for p, src in enumerate(ws["sums"]):
            c0, c1 = max(lo - p * c, 0), min(hi - p * c, c)
            if c1 <= c0:
                continue
            for m in range(self.m):
                np.multiply(src, dz[m], out=t)
                sums = ones @ t  # the channel sums as one BLAS product
                g[p, c0:c1, m] = sums[c0:c1]

    def backward_input(self, ws: dict[str, Any], dout, kernel, bias=None):
        if ws["native"]:  # computed with the kernel's gradient (backward_local)
            return ws["dx"]
        t, kt, dzl = ws["tl"], ws["kt"], ws["dzl"]  # kt: forward's tiles of this kernel
        ws["dxw"][ws["tmp"].size :].fill(0)
        for n, dst in enumerate(ws["dst"]):
            for m in range(self.m):
                if n == 0 and m == 0:
                    np.multiply(dzl[m], kt[n, m], out=dst)
                else:
                    np.multiply(dzl[m], kt[n, m], out=t)
                    np.add(dst, t, out=dst)
        if "dxp" in ws:  # the phases partition the padded input: each lands where it came from
            for plane, (ri, ci) in ws["dxphases"]:
                np.copyto(ws["dxp"][:, ri, ci], plane)
        return ws["dx"]


class Separable(Op):
    """Keras ``SeparableConv1D`` / ``SeparableConv2D``: weights ``depthwise_kernel``
    ``(*kernel, cin, multiplier)``, ``pointwise_kernel`` ``(*ones, cin * multiplier,
    filters)``, ``bias`` — a :class:`Depthwise` (its buffers prefixed ``dw_``) and a product."""

    kind = "conv"

    def __init__(
        self,
        in_shape,
        filters: int,
        kernel,
        strides=1,
        padding: str = "valid",
        dilation=1,
        depth_multiplier: int = 1,
        activation="linear",
        use_bias: bool = True,
    ):
        self.dw = Depthwise(
            in_shape, kernel, strides, padding, dilation, depth_multiplier, "linear", use_bias=False
        )
        self.in_shape, self.use_bias = self.dw.in_shape, use_bias
        self.cmid, self.cout = self.dw.cout, int(filters)
        self.act = activations.resolve(activation)
        self.out_shape = (*self.dw.out_hw, self.cout)

    def params(self, layer: int) -> list[ParamSpec]:
        d = self.dw.params(layer)[0]
        ones = (1,) * self.dw.rank
        ps = [
            ParamSpec(layer, "depthwise_kernel", d.shape, d.fan_in, d.fan_out, True),
            ParamSpec(
                layer, "pointwise_kernel", (*ones, self.cmid, self.cout), self.cmid, self.cout, True
            ),
        ]
        return ps + ([ParamSpec(layer, "bias", (self.cout,), 0, 0, False)] if self.use_bias else [])

    def buffers(self, b, train, need_dx):
        out = (b, *self.out_shape)
        bufs = {f"dw_{k}": v for k, v in self.dw.buffers(b, train, need_dx).items()}
        bufs.update({"out": (out, "f"), **self.act.buffers(out, train)})
        if self.use_bias:
            bufs["bt"] = ((tiles.span(math.prod(out), self.cout),), "f")
        if train:
            rows = b * self.dw.ho * self.dw.wo
            bufs.update({"ones": ((rows,), "f"), "dmid": ((rows, self.cmid), "f")})
        return bufs

    def flops(self, b, train, need_dx):
        mm = 2 * b * self.dw.ho * self.dw.wo * self.cmid * self.cout
        return self.dw.flops(b, train, need_dx) + mm * (1 + (1 + need_dx if train else 0))

    def bind(self, ws: dict[str, Any], b):
        ws["dw"] = {k[3:]: v for k, v in ws.items() if k.startswith("dw_")}
        self.dw.bind(ws["dw"], b)
        if "ones" in ws:
            ws["ones"].fill(1)
        ws["mid"] = ws["dw"]["out"].reshape(-1, self.cmid)

    def forward(self, ws: dict[str, Any], x, depthwise_kernel, pointwise_kernel, bias=None):
        self.dw.forward(ws["dw"], x, depthwise_kernel)
        ws["pk"] = pk = pointwise_kernel.reshape(self.cmid, self.cout)
        z = self.act.pre(ws).reshape(-1, self.cout)
        np.matmul(ws["mid"], pk, out=z)
        if bias is not None:
            tiles.add_bias(z, bias, ws["bt"])
        return self.act.run(ws)

    def backward_local(self, ws: dict[str, Any], dout):
        # the depthwise half needs d(mid) = dz @ pointwise.T: computed here, before any weight
        # gradient is announced (a resident pointwise kernel may be updated right after)
        ws["dz2"] = dz2 = self.act.grad(ws, dout).reshape(-1, self.cout)
        np.matmul(dz2, ws["pk"].T, out=ws["dmid"])
        self.dw.backward_local(ws["dw"], ws["dmid"])

    def backward_weights(self, ws: dict[str, Any], dout, name, grad, rows):
        if name == "bias":
            np.matmul(ws["ones"], ws["dz2"], out=grad)
        elif name == "pointwise_kernel":
            lo, hi = rows
            g = grad.reshape(self.cmid, self.cout)
            np.matmul(ws["mid"].T[lo:hi], ws["dz2"], out=g[lo:hi])
        else:
            self.dw.backward_weights(ws["dw"], ws["dmid"], "kernel", grad, rows)

    def backward_input(
        self, ws: dict[str, Any], dout, depthwise_kernel, pointwise_kernel, bias=None
    ):
        return self.dw.backward_input(ws["dw"], ws["dmid"], depthwise_kernel)
