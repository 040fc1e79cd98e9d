"""A TrainingJob as the operator's pure functions see it: frozen dataclasses, defaulted and checked.

Pipeline position: :func:`.spec.load` builds a :class:`Job` from the API object (the CRD's
defaults, then every check); manifests, MPI objects, network policies, observation and status all
read it and nothing else of the raw object. This module depends on nothing of the operator, so
every other module can import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

from ringtrain import options

GROUP = "ringtrain.io"


VERSION = "v1alpha1"


API_VERSION = f"{GROUP}/{VERSION}"


KIND = "TrainingJob"


PLURAL = "trainingjobs"


#: spec.replicaSpecs keys → TF_CONFIG role names, in TF_CONFIG order.
#: The Launcher (MPI jobs only, spec.mpi) is in no TF_CONFIG: it comes last.
ROLE_KEYS = {
    "Chief": "chief",
    "Worker": "worker",
    "PS": "ps",
    "Evaluator": "evaluator",
    "Launcher": "launcher",
}


@dataclass(frozen=True)
class ReplicaSpec:
    """One role of the gang. ``template`` is the user's Pod template, defaulted but not merged."""

    key: str  # "Worker", as in spec.replicaSpecs
    role: str  # "worker", as in TF_CONFIG
    replicas: int
    restart_policy: str
    template: Mapping[str, Any]


#: spec.trainer, defaulted: one field per option of ``ringtrain.options`` that has a CRD field
#: (``image``, ``checkpoint_dir`` from checkpoint.path, ``ring_transport``, ...).
if TYPE_CHECKING:  # built from the option table at import: its fields are the table's names
    TrainerSpec: TypeAlias = Any
else:
    TrainerSpec = options.record(
        "TrainerSpec",
        options.CRD,
        "spec.trainer: the image, the checkpoint volume and ``ringtrain worker`` flags by option "
        "name.",
    )


@dataclass(frozen=True)
class RunPolicy:
    backoff_limit: int
    active_deadline_s: int | None
    ttl_after_finished_s: int | None
    clean_pod_policy: str
    suspend: bool
    success_policy: str


@dataclass(frozen=True)
class MPISpec:
    """spec.mpi, defaulted: the job is an MPIJob (:mod:`.mpi` builds its objects)."""

    implementation: str
    slots_per_worker: int
    launcher_creation_policy: str
    ssh_auth_mount_path: str
    command: tuple[str, ...] | None


@dataclass(frozen=True)
class ElasticPolicy:
    """spec.elasticPolicy, checked (:mod:`.elastic`): the worker counts the job may run at, and
    the global batch every one of them keeps (a worker's batch is ``global_batch / N / K``)."""

    min_replicas: int
    max_replicas: int
    #: gang restarts after failures (TorchElastic's --max-restarts); resizes never count
    max_restarts: int | None
    #: examples per optimizer step over the whole ring: batchSize x K x Worker.replicas
    global_batch: int
    #: seconds a worker may be lost before the job goes on without it (shrinkAfterSeconds)
    shrink_after_s: int = 60
    #: why an edit of the running job's count or bounds is not applied ("" when none is)
    refused: str = ""

    def sizes(self) -> range:
        return range(self.min_replicas, self.max_replicas + 1)


@dataclass(frozen=True)
class Job:
    """A validated, defaulted TrainingJob."""

    name: str
    namespace: str
    uid: str | None
    generation: int
    replicas: tuple[ReplicaSpec, ...]  # TF_CONFIG order, roles with replicas > 0 only
    trainer: TrainerSpec | None
    run_policy: RunPolicy
    mpi: MPISpec | None = None
    elastic: ElasticPolicy | None = None

    def replica(self, role: str) -> ReplicaSpec | None:
        return next((r for r in self.replicas if r.role == role), None)

    @property
    def service_name(self) -> str:
        return self.name

    @property
    def chief(self) -> tuple[str, int]:
        """The replica that decides success and reports progress: the chief, else worker 0."""
        return ("chief", 0) if self.replica("chief") else ("worker", 0)

    def pod_name(self, role: str, index: int) -> str:
        if role == "launcher":  # one per job, named as mpi-operator names it
            return f"{self.name}-launcher"
        return f"{self.name}-{role}-{index}"

    def members(self) -> list[tuple[ReplicaSpec, int]]:
        """Every (replica spec, index) of the gang, in TF_CONFIG order."""
        return [(r, i) for r in self.replicas for i in range(r.replicas)]
