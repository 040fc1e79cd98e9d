"""TF_CONFIG: the one description of a job's cluster, shared by the operator and the trainer.

The operator *builds* it (spec → one JSON string per replica) and every worker *parses* it at
start-up, exactly as TensorFlow's ``TFConfigClusterResolver`` reads the variable, so that stock
TensorFlow code and the ringtrain trainer see the same cluster. Keeping both directions in one
module (Kubeflow keeps its ``TFConfig`` struct in one file) means they cannot drift.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from ringtrain.errors import InvalidSpec

#: Roles TensorFlow knows, in the order TF_CONFIG lists them.
ROLES = ("chief", "worker", "ps", "evaluator")
#: Roles that take part in the gradient ring; chief (if any) is rank 0, then workers by index.
RING_ROLES = ("chief", "worker")
#: Roles that appear only in their own ``task``, never in ``cluster``: TensorFlow's
#: ``RunConfig`` requires the evaluator to stay out of the cluster spec, and Kubeflow's
#: ``genClusterSpec`` leaves it out.
TASK_ONLY_ROLES = ("evaluator",)


class InvalidClusterSpec(InvalidSpec, ValueError):
    """TF_CONFIG is malformed; the message names the offending field.

    An ``InvalidSpec`` (permanent exit code) so that callers need not translate it; still a
    ``ValueError`` for code that caught it as one."""


@dataclass(frozen=True)
class ClusterSpec:
    """The parsed content of TF_CONFIG.

    ``cluster`` maps a role to its ordered ``host:port`` addresses; ``task_type`` and
    ``task_index`` say which of them this process is.
    """

    cluster: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    task_type: str = "worker"
    task_index: int = 0
    environment: str = "cloud"

    @classmethod
    def single(cls) -> ClusterSpec:
        """The cluster of a process started without TF_CONFIG: one worker, no peers."""
        return cls(cluster={}, task_type="worker", task_index=0, environment="")

    @property
    def ring(self) -> tuple[str, ...]:
        """Addresses of the ring members in rank order (chief first, then workers)."""
        return tuple(a for role in RING_ROLES for a in self.cluster.get(role, ()))

    @property
    def ring_names(self) -> tuple[str, ...]:
        """The ring members' task names in rank order (``chief-0``, ``worker-0``, …): how
        logs, ``/status`` and the operator name a rank."""
        return tuple(
            f"{role}-{i}" for role in RING_ROLES for i in range(len(self.cluster.get(role, ())))
        )

    @property
    def in_ring(self) -> bool:
        return self.task_type in RING_ROLES

    @property
    def rank(self) -> int:
        """This process's position in the ring (0 for a single process)."""
        if not self.cluster:
            return 0
        if not self.in_ring:
            raise InvalidClusterSpec(f"task.type {self.task_type!r} does not take part in the ring")
        offset = len(self.cluster.get("chief", ())) if self.task_type == "worker" else 0
        return offset + self.task_index

    @property
    def world_size(self) -> int:
        return max(1, len(self.ring))

    @property
    def is_chief(self) -> bool:
        """The process that checkpoints, evaluates and logs: the chief, else worker 0."""
        return self.in_ring and self.rank == 0

    @property
    def address(self) -> str | None:
        """This task's ``host:port``; None alone or for a task outside ``cluster`` (evaluator)."""
        addresses = self.cluster.get(self.task_type, ())
        return addresses[self.task_index] if self.task_index < len(addresses) else None

    def to_json(self) -> str:
        """Serialise exactly as Kubeflow's TFJob controller writes TF_CONFIG."""
        doc = {
            "cluster": {r: list(self.cluster[r]) for r in ROLES if r in self.cluster},
            "task": {"type": self.task_type, "index": self.task_index},
            "environment": self.environment,
        }
        return json.dumps(doc, separators=(",", ":"))


def split_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as ``(host, port)``: how a ring member finds its own
    port and its peers in TF_CONFIG."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


#: What a worker binds its ports to when its whole cluster is on loopback (``ringtrain run``).
LOOPBACK = "127.0.0.1"
#: ... and otherwise (a pod: peers reach it on its pod IP).
ANY = "0.0.0.0"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a DNS name: a pod's


def bind_host(addresses: Iterable[str]) -> str:
    """Where a member of the cluster of ``addresses`` listens (ring, side channel, health and
    metrics ports): loopback when every member is on loopback — ``ringtrain run`` on one
    machine, whose unauthenticated ports were reachable from the LAN (issue 20) —, every
    interface otherwise (none given, a worker started alone, keeps that)."""
    hosts = [split_address(a)[0] for a in addresses]
    return LOOPBACK if hosts and all(_loopback(h) for h in hosts) else ANY


def parse(text: str | None) -> ClusterSpec:
    """Parse TF_CONFIG; ``None`` or empty means a single worker.

    Every error names the field, because a bad TF_CONFIG is a *permanent* failure the user has
    to fix, and "invalid JSON" alone does not say where.
    """
    if text is None or not text.strip():
        return ClusterSpec.single()
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidClusterSpec(f"TF_CONFIG is not valid JSON: {e}") from None
    except RecursionError:
        raise InvalidClusterSpec("TF_CONFIG is nested too deeply to be a TF_CONFIG") from None
    if not isinstance(doc, dict):
        raise InvalidClusterSpec("TF_CONFIG must be a JSON object")
    raw_cluster = doc.get("cluster", {})
    if not isinstance(raw_cluster, dict):
        raise InvalidClusterSpec("TF_CONFIG.cluster must be an object mapping role to addresses")
    cluster: dict[str, tuple[str, ...]] = {}
    for role, addrs in raw_cluster.items():
        if role not in ROLES:
            raise InvalidClusterSpec(f"TF_CONFIG.cluster.{role}: unknown role (known: {ROLES})")
        if isinstance(addrs, dict):  # TensorFlow also accepts {index: address}
            try:
                addrs = [addrs[k] for k in sorted(addrs, key=int)]
            except (ValueError, TypeError):
                raise InvalidClusterSpec(
                    f"TF_CONFIG.cluster.{role}: keys must be indices"
                ) from None
        if not isinstance(addrs, list) or not all(isinstance(a, str) for a in addrs):
            raise InvalidClusterSpec(f"TF_CONFIG.cluster.{role} must be a list of 'host:port'")
        for i, a in enumerate(addrs):
            host, sep, port = a.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise InvalidClusterSpec(f"TF_CONFIG.cluster.{role}[{i}]: {a!r} is not host:port")
        cluster[role] = tuple(addrs)
    seen: dict[str, str] = {}
    for role, addrs in cluster.items():  # two members on one address would talk to themselves
        for i, a in enumerate(addrs):
            if a in seen:
                raise InvalidClusterSpec(f"TF_CONFIG.cluster.{role}[{i}]: {a!r} is also {seen[a]}")
            seen[a] = f"cluster.{role}[{i}]"
    if len(cluster.get("chief", ())) > 1:
        raise InvalidClusterSpec("TF_CONFIG.cluster.chief: at most one chief")
    task = doc.get("task", {})
    if not isinstance(task, dict):
        raise InvalidClusterSpec("TF_CONFIG.task must be an object")
    task_type = task.get("type", "worker" if not cluster else None)
    if task_type not in ROLES:
        raise InvalidClusterSpec(f"TF_CONFIG.task.type: {task_type!r} is not one of {ROLES}")
    index = task.get("index", 0)
    if isinstance(index, str) and index.isdigit():
        index = int(index)
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise InvalidClusterSpec(f"TF_CONFIG.task.index: {index!r} is not a non-negative integer")
    if cluster and task_type not in TASK_ONLY_ROLES and index >= len(cluster.get(task_type, ())):
        raise InvalidClusterSpec(
            f"TF_CONFIG.task.index: {index} but cluster.{task_type} has "
            f"{len(cluster.get(task_type, ()))} entries"
        )
    env = doc.get("environment", "")
    if not isinstance(env, str):
        raise InvalidClusterSpec("TF_CONFIG.environment must be a string")
    return ClusterSpec(cluster=cluster, task_type=task_type, task_index=index, environment=env)


def build(
    cluster: Mapping[str, list[str] | tuple[str, ...]],
    task_type: str,
    task_index: int,
    environment: str = "cloud",
) -> str:
    """Build the TF_CONFIG string for one replica (used by the operator and `ringtrain run`).

    As Kubeflow's ``genClusterSpec`` does, an evaluator in ``cluster`` is left out: it appears
    only in its own ``task``."""
    spec = ClusterSpec(
        cluster={
            r: tuple(cluster[r])
            for r in ROLES
            if r in cluster and cluster[r] and r not in TASK_ONLY_ROLES
        },
        task_type=task_type,
        task_index=task_index,
        environment=environment,
    )
    return spec.to_json()
