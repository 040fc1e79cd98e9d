"""What a worker says once at start-up about what runs (and the chief's ``numerics/*``
TensorBoard scalars, the same facts per progress point).

Pipeline position: the :class:`~ringtrain_trainer.worker.Trainer` prints these lines after
compiling, before the first step. They live here, apart from the training loop, because they
only describe: the optimizer and loss, the numerics (precision, loss scaling, rounding), the
global batch with its factors (one line with or without pipelining: the pipeline's depth is
the gradient accumulation steps), and the pipeline's stages or recomputation's saving.
"""

from __future__ import annotations

from ringtrain_trainer.engine import native


def training_line(optimizer_spec, spec, numerics) -> str:
    """The optimizer, its arguments and schedule (and which flags replaced the model's), the
    loss, and the numerics."""
    loss = spec.loss
    folded = f", {loss.folded} folded in" if loss.folded else ""
    regs = sum(s.spec.reg is not None for s in spec.slots)
    plus = f" + the L1/L2 penalty of {regs} weight tensors" if regs else ""
    cons = [s.spec.constraint.cls for s in spec.slots if s.spec.constraint is not None]
    projected = f"; {len(cons)} weight tensors projected ({', '.join(sorted(set(cons)))})"
    return (
        f"optimizer {optimizer_spec.describe()}{projected if cons else ''}; "
        f"loss {loss.describe()}{folded}{plus}; "
        f"{numerics.describe()}{frozen_note(spec)}"
    )


def frozen_note(spec) -> str:
    """How many parameters are frozen (``trainable=False``), or "" when none are."""
    n = spec.num_frozen
    if not n:
        return ""
    return (
        f"; {spec.num_params:,} trainable parameters, {n:,} frozen "
        "(trainable=False: no gradient, not reduced, not optimized)"
    )


def batch_line(cfg, world: int) -> str:
    """The global batch and its factors; ``cfg``: a ``TrainerConfig``."""
    r, k = cfg.ipus_per_worker, cfg.gradient_accumulation_steps
    if cfg.pipeline_stages:  # the IPUs are stages: one replica, K the depth
        r, depth = 1, " (the pipeline's depth)"
    else:
        depth = ""
    b = cfg.batch_size // r
    return (
        f"global batch {b * k * r * world} = micro-batch {b} x gradient accumulation "
        f"{k}{depth} x replicas {r} x workers {world}"
    )


def ipu_lines(cfg, spec, ipu, exe) -> list[str]:
    """What the IPUs run: the compiled kernels, the pipeline's stages and schedule,
    recomputation's saving."""
    out = [kernels_line(spec, exe)]
    if exe.baseline is not None:
        out.append(
            f"recomputation: peak {exe.plan.total:,} bytes per IPU, "
            f"{exe.baseline.total:,} without it"
        )
    plans = getattr(exe, "stage_plans", None)
    if plans:
        stages = "; ".join(
            f"{st.describe(spec)} on IPU {st.index}: {p.total:,} bytes"
            for st, p in zip(ipu.stages, plans, strict=True)
        )
        out.append(
            f"pipeline ({cfg.pipeline_schedule} schedule; Interleaved is not implemented): {stages}"
        )
    return out


def compiled_parts(ws: dict) -> list[str]:
    """What of one layer's step runs compiled (``engine.native``), from the flags its ``bind``
    set in its workspace (a Separable's depthwise half in its own, under ``dw``)."""
    parts = []
    if ws.get("native"):
        fused = "idx" in ws
        parts.append("conv + 2x2 max-pool + bias + ReLU fused" if fused else "depthwise conv")
    if ws.get("pool_native"):
        parts.append("2x2 max-pool + bias + ReLU")
    if ws.get("gemm"):
        parts.append("GEMM, input read in place" if "pixels" in ws else "GEMM")
    if ws.get("gemm_dx") or "dx_c" in ws or ws.get("native_dx"):
        parts.append("input gradient")
    sub = ws.get("dw")
    return parts + (compiled_parts(sub) if isinstance(sub, dict) else [])


def kernels_line(spec, exe) -> str:
    """Which layers run a compiled kernel (``engine.native``) rather than numpy passes and
    BLAS, and what of each."""
    programs = getattr(exe, "programs", None) or []
    pairs = list(zip(spec.layers, programs[0].ws if programs else [], strict=False))
    where = []
    for i, (layer, ws) in enumerate(pairs):
        parts = compiled_parts(ws)
        if parts:
            where.append(f"{getattr(layer, 'name', '') or f'layer {i}'} ({', '.join(parts)})")
    if native.kernels is None or where:
        return f"compiled kernels: {native.describe()}" + (
            f" for {'; '.join(where)}" if where else ""
        )
    return (
        f"compiled kernels: {native.describe()}; no layer of this model uses one (numpy and BLAS)"
    )


def numerics_scalars(loss_scale, numerics, accumulation: int) -> dict[str, float]:
    """TensorBoard's ``numerics/*``: what the IPU computes in, at each progress point."""
    return {
        "numerics/loss_scale": loss_scale.scale,
        "numerics/skipped_steps": loss_scale.skipped,
        "numerics/gradient_accumulation_steps": accumulation,
        "numerics/precision_bits": 16 if numerics.precision == "fp16" else 32,
    }
