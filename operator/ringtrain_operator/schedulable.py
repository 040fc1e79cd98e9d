"""Container resources that can never schedule, refused before anything runs (issue 21).

Why: a pod whose requests exceed its limits, or that asks for a negative amount, is refused by
the API server only when the operator creates it, so the job sat with its other pods running (an
MPI job's workers waiting for a launcher that never comes); a pod asking for more than any node
has stays Pending forever. ``spec.load`` calls :func:`check` for every replica's containers, so
``ringtrain render``, ``ringtrain run`` and the operator refuse the spec the same way, naming the
field.

The rule (README, decisions): each ``resources.requests``/``limits`` value of ``cpu`` or
``memory`` must be a Kubernetes quantity, not negative, a request not above its limit, and not
above :data:`MAX` (more than the largest machines sold: 896 vCPUs and 32 TiB in 2026). Other
resources (``ephemeral-storage``, extended resources) must parse and not be negative; their
request may not exceed their limit either.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from decimal import Decimal, InvalidOperation
from typing import Any

from ringtrain.errors import InvalidSpec

from .job import ReplicaSpec

_SUFFIX: dict[str, Decimal | int] = {
    "": 1,
    "m": Decimal("0.001"),
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_QUANTITY = re.compile(r"^([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(m|k|M|G|T|P|E|Ki|Mi|Gi|Ti|Pi|Ei)?$")
#: No node has more: 1,024 cores, 64 TiB.
MAX = {"cpu": Decimal(1024), "memory": Decimal(64 * 2**40)}


def quantity(value: Any, field: str) -> Decimal:
    """A Kubernetes quantity (``500m``, ``2Gi``, ``1.5``, 2) as a number, or InvalidSpec."""
    text = str(value).strip() if isinstance(value, int | float | str) else ""
    match = _QUANTITY.match(text)
    try:
        if match is None or isinstance(value, bool):
            raise InvalidOperation
        return Decimal(match.group(1)) * _SUFFIX[match.group(2) or ""]
    except InvalidOperation:
        raise InvalidSpec(f"{field}: {value!r} is not a Kubernetes quantity") from None


def check_container(resources: Any, field: str) -> None:
    if resources is None:
        return
    if not isinstance(resources, Mapping):
        raise InvalidSpec(f"{field}: must be an object")
    parsed: dict[str, dict[str, Decimal]] = {}
    for kind in ("requests", "limits"):
        values = resources.get(kind) or {}
        if not isinstance(values, Mapping):
            raise InvalidSpec(f"{field}.{kind}: must be an object")
        parsed[kind] = {}
        for name, value in values.items():
            at = f"{field}.{kind}.{name}"
            q = parsed[kind][name] = quantity(value, at)
            if q < 0:
                raise InvalidSpec(f"{at}: {value!r} is negative")
            if name in MAX and q > MAX[name]:
                raise InvalidSpec(
                    f"{at}: {value!r} is more than any node has (at most {MAX[name]:f}), "
                    "so the pod could never be scheduled"
                )
    for name, request in parsed["requests"].items():
        limit = parsed["limits"].get(name)
        if limit is not None and request > limit:
            raise InvalidSpec(
                f"{field}.requests.{name}: {resources['requests'][name]!r} is more than "
                f"limits.{name} {resources['limits'][name]!r}; the API server refuses such a "
                "pod (a request may not exceed its limit)"
            )


def check(replicas: tuple[ReplicaSpec, ...]) -> None:
    """Every container's and init container's ``resources`` in every replica's template."""
    for r in replicas:
        spec = r.template.get("spec") if isinstance(r.template, Mapping) else None
        if not isinstance(spec, Mapping):
            continue
        for list_name in ("initContainers", "containers"):
            containers = spec.get(list_name)
            if not isinstance(containers, list):
                continue
            for i, c in enumerate(containers):
                if isinstance(c, Mapping):
                    field = f"spec.replicaSpecs.{r.key}.template.spec.{list_name}[{i}].resources"
                    check_container(c.get("resources"), field)
