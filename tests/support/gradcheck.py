"""One finite-difference gradient check for every op, layer and model (like
``torch.autograd.gradcheck``): central differences of a scalar function against the analytic
gradient, on all entries or a random sample.

Why one helper: the engine's tests and the model tests used to carry their own loops with their
own step and tolerances; one place means one rule for what "matches finite differences" means.
Run it in float64: with ``eps = 1e-6`` float32 rounding alone would swamp the difference.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

#: the step and the tolerance every check in the suite uses unless it says why not
EPS, ATOL, RTOL = 1e-6, 1e-6, 1e-4


def numeric_grad(f: Callable[[], float], x: np.ndarray, i: int, eps: float = EPS) -> float:
    """d f / d x.flat[i] by central differences; ``x`` is perturbed in place and restored."""
    flat = x.reshape(-1)
    if not np.shares_memory(flat, x):
        raise ValueError("gradcheck needs an array it can perturb in place (contiguous)")
    old = flat[i]
    flat[i] = old + eps
    up = f()
    flat[i] = old - eps
    down = f()
    flat[i] = old
    return (up - down) / (2 * eps)


def gradcheck(
    f: Callable[[], float],
    x: np.ndarray,
    analytic: np.ndarray,
    *,
    rng: np.random.Generator | None = None,
    samples: int | None = None,
    indices=None,
    eps: float = EPS,
    atol: float = ATOL,
    rtol: float = RTOL,
    what: str = "",
) -> None:
    """Assert ``analytic`` (shaped like ``x``) is d f / d x: at ``indices``, or ``samples``
    random entries drawn with ``rng``, or every entry. ``f`` must read ``x`` itself (a view of
    the parameter buffer, the program's input), since entries are perturbed in place.
    Reports every mismatching entry, not just the first."""
    if x.dtype != np.float64:
        raise ValueError(f"gradcheck runs in float64, got {x.dtype} ({what})")
    analytic = np.asarray(analytic).reshape(-1)
    n = x.size
    if indices is None:
        indices = (
            range(n)
            if samples is None or samples >= n
            else (rng or np.random.default_rng(0)).choice(n, samples, replace=False)
        )
    bad = []
    for i in indices:
        fd = numeric_grad(f, x, int(i), eps)
        if not abs(fd - analytic[i]) <= atol + rtol * abs(fd):
            bad.append((int(i), fd, float(analytic[i])))
    assert not bad, f"{what}: (index, finite difference, analytic) disagree at {bad[:8]}"


def check_model(spec, flat, grad, loss, rng, samples: int = 10) -> None:
    """Every parameter tensor of a model: ``samples`` entries each. ``loss()`` runs forward
    and the loss on ``flat``; ``grad`` holds backward's result for it."""
    for slot in spec.slots:
        gradcheck(
            loss,
            flat[slot.start : slot.stop],
            grad[slot.start : slot.stop],
            rng=rng,
            samples=samples,
            what=f"{spec.name} {slot.spec}",
        )
