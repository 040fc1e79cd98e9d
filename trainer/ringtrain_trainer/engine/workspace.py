"""Graphcore's ``availableMemoryProportion`` for convolution and matmul workspaces.

On the IPU, Poplar's planner may give an op's temporary workspace at most this fraction of
each tile's memory (Graphcore's default 0.6); a smaller share splits the op into serial pieces
— less memory, more cycles. The emulator's convolutions keep their im2col workspace (columns,
padded input, per-tap input gradients) for the whole batch by default; with a proportion set,
each conv runs over the batch in the fewest chunks whose workspace fits ``proportion × IPU
memory``, and the workspace is planned for one chunk (``engine.ops.conv``). A Dense's matmul
needs no workspace proportional to its batch, so it always fits; any other op whose
workspace exceeds the cap and cannot chunk is refused by name, never silently left over.
"""

from __future__ import annotations

import math

from ringtrain_trainer.engine.ops.conv import Conv

FLAG = "--available-memory-proportion (spec.trainer.availableMemoryProportion)"
#: a matmul's buffers that are its output, not temporary workspace
_NOT_WORK = ("out", "dx", "pre", "z")


class WorkspaceError(ValueError):
    """A conv/matmul workspace that no chunking fits under the proportion."""


def cap_workspaces(spec, proportion: float | None, memory_bytes: int, itemsize: int) -> dict:
    """Set every conv's examples per chunk for ``proportion`` of ``memory_bytes`` (None:
    whole batch); returns ``{layer name: examples per chunk}`` for the capped convs."""
    out: dict[str, int] = {}
    if proportion is not None and not 0 < proportion <= 1:
        raise WorkspaceError(f"{FLAG} must be in (0, 1], got {proportion}")
    cap = None if proportion is None else int(proportion * memory_bytes) // itemsize
    for i, layer in enumerate(spec.layers):
        name = getattr(layer, "name", None) or f"L{i}"
        if isinstance(layer, Conv):
            layer.chunk = None
            per = layer.chunk_elems(1, True, spec.need_dx[i])
            if cap is None or per == 0:
                continue
            fixed = layer.fixed_elems()
            if fixed + per > cap:
                raise WorkspaceError(
                    f"layer {name!r} (conv): the workspace of one example, "
                    f"{(fixed + per) * itemsize:,} bytes, exceeds {FLAG} {proportion} of the "
                    f"IPU's {memory_bytes:,} bytes (raise the proportion or --ipu-memory-mb)"
                )
            layer.chunk = (cap - fixed) // per
            out[name] = layer.chunk
        elif cap is not None and getattr(layer, "kind", "") == "dense":
            bufs = layer.buffers(1, True, spec.need_dx[i])
            work = sum(math.prod(s) for k, (s, _) in bufs.items() if k not in _NOT_WORK)
            if work > cap:  # one example's: a matmul that does not chunk
                raise WorkspaceError(
                    f"layer {name!r} (dense) cannot run under {FLAG} {proportion}: its "
                    "workspace does not split over the batch"
                )
    return out


def pieces(batch: int, chunk: int | None) -> int:
    """Serial pieces a conv with ``chunk`` examples per chunk runs ``batch`` examples in."""
    return 1 if chunk is None else -(-batch // max(1, min(chunk, batch)))
