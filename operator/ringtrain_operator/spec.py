"""TrainingJob spec: the CRD's schema applied locally, then the checks a schema cannot express.

The API server defaults and validates with the CRD's openAPIV3Schema; the operator, ``ringtrain
run`` and ``ringtrain render`` must see *exactly* the same defaults, so they read the same file
(``crd/trainingjobs.yaml``) instead of repeating its defaults in Python. What comes out is a tree
of frozen dataclasses that the manifest and status functions consume.
"""

from __future__ import annotations

import copy
import difflib
import json
import re
from collections.abc import Mapping
from functools import lru_cache
from importlib import resources
from typing import Any

import jsonschema
import yaml

from ringtrain import optiongen, optionrules, options
from ringtrain.errors import InvalidSpec

from . import elastic, limits, modelcheck, modelfrom, mpi, schedulable
from .job import API_VERSION, KIND, ROLE_KEYS, Job, MPISpec, ReplicaSpec, RunPolicy, TrainerSpec

_DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: Longest pod name suffix: "-evaluator-" plus up to four index digits.
_LONGEST_SUFFIX = len("-evaluator-") + 4

__all__ = ["crd", "load", "validate"]


@lru_cache(maxsize=1)
def crd() -> dict:
    """The CRD manifest shipped in this package (our own file: libyaml's loader where there is
    one, 0.03 s instead of pure Python's 0.3 s, paid by the operator's first reconcile)."""
    text = resources.files(__package__).joinpath("crd/trainingjobs.yaml").read_text()
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def _schema() -> dict:
    return crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def apply_defaults(schema: Mapping[str, Any], value: Any) -> Any:
    """Fill in the schema's ``default`` values the way the API server does.

    A default is applied only where the parent object exists, and a defaulted object is itself
    defaulted (so ``runPolicy: {}`` gains its fields). Returns a new value; the input is untouched.
    """
    value = copy.deepcopy(value)
    _default_in_place(schema, value)
    return value


def _default_in_place(schema: Mapping[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for name, sub in schema.get("properties", {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                _default_in_place(sub, value[name])
    elif isinstance(value, list) and "items" in schema:
        for item in value:
            _default_in_place(schema["items"], item)


def _strict(schema: Mapping[str, Any]) -> dict:
    """The schema with unknown fields rejected, where the server would silently prune them.

    Locally (``ringtrain run``) a typo such as ``batchsize`` should fail loudly, not vanish.
    """
    out = dict(schema)
    if "properties" in out:
        out["properties"] = {k: _strict(v) for k, v in out["properties"].items()}
        if not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if "items" in out:
        out["items"] = _strict(out["items"])
    return out


@lru_cache(maxsize=1)
def _validator() -> jsonschema.Draft4Validator:
    return jsonschema.Draft4Validator(_strict(_schema()))


def warm() -> None:
    """Build the CRD's schema and validator now (a process about to load many specs)."""
    _validator()


def _path(error: jsonschema.ValidationError) -> str:
    parts = [str(p) if not isinstance(p, int) else f"[{p}]" for p in error.absolute_path]
    return ".".join(parts).replace(".[", "[") or "(root)"


def validate(obj: Mapping[str, Any]) -> None:
    """Check a defaulted TrainingJob against the CRD schema; the message names every bad field.

    ``spec.trainer.model`` is checked here too, in the same message: the CRD can only say "a
    string or an object" (see ``options.Option.or_object``)."""
    errors = [
        (list(map(str, e.absolute_path)), f"{_path(e)}: {e.message}{_did_you_mean(e)}")
        for e in _validator().iter_errors(obj)
    ]
    trainer = (
        (obj.get("spec") or {}).get("trainer") if isinstance(obj.get("spec"), Mapping) else None
    )
    if isinstance(trainer, Mapping) and (why := modelfrom.conflict(trainer)) is not None:
        errors.append((["spec", "trainer", "model"], why))  # the model is not used: unchecked
    elif (
        isinstance(trainer, Mapping)
        and "model" in trainer
        and (why := model_error(trainer["model"], _budget(trainer))) is not None
    ):
        errors.append((["spec", "trainer", "model"], f"spec.trainer.model: {why}"))
    if errors:
        raise InvalidSpec("; ".join(message for _, message in sorted(errors)))


def _did_you_mean(error: jsonschema.ValidationError) -> str:
    """For a field the schema does not know: the nearest field it does (``batchsize`` →
    ``batchSize``), as kubectl's own validation does not say; for a choice of one field
    (spec.trainer.modelFrom), the fields to choose from."""
    schema = error.schema if isinstance(error.schema, Mapping) else {}
    if error.validator in ("minProperties", "maxProperties") and schema.get("maxProperties") == 1:
        return f" (set exactly one of {', '.join(schema.get('properties') or {})})"
    if error.validator != "additionalProperties" or not isinstance(error.instance, Mapping):
        return ""
    known = list(schema.get("properties") or {})
    by_lower = {k.lower(): k for k in known}
    hints = []
    for name in error.instance:
        if name in known or not isinstance(name, str):
            continue
        near = by_lower.get(name.lower()) or next(
            iter(difflib.get_close_matches(name, known, n=1, cutoff=0.75)), None
        )
        if near:
            hints.append(f"{name!r}: did you mean {near!r}?")
    return f" ({'; '.join(hints)})" if hints else ""


def _budget(trainer: Mapping[str, Any]) -> tuple[int, int]:
    """(one IPU's bytes, examples per IPU) for ``budget.check``; the option defaults where a
    field is invalid (the schema has already named it)."""

    def field(name: str) -> int:
        v = trainer.get(options.BY_NAME[name].crd or "")
        if isinstance(v, int) and not isinstance(v, bool) and v >= 1:
            return v
        return int(options.DEFAULTS[name])

    per_ipu = max(1, field("batch_size") // field("ipus_per_worker"))
    pipe = trainer.get("pipeline")
    if isinstance(pipe, Mapping) and pipe.get("stages"):  # the stages share the IPUs' memory
        ipus = field("ipus_per_worker")  # micro-batches of batchSize through all of them
        return ipus * (field("ipu_memory_mb") << 20), field("batch_size")
    return field("ipu_memory_mb") << 20, per_ipu


#: Linux's limit on one command-line argument (MAX_ARG_STRLEN), the terminating NUL included:
#: an inline model reaches the worker as the text of ``--model``.
MAX_INLINE_MODEL_BYTES = 128 * 1024 - 1


def model_error(model: Any, budget: tuple[int, int] | None = None) -> str | None:
    """Why ``spec.trainer.model`` cannot run, or None: a preset or absolute ``.json``/``.keras``
    path (the file itself only the worker can read), or an inline Keras Sequential config,
    parsed and built exactly as the worker will (by the worker's own code, in a bounded child
    process: :mod:`.modelcheck`), so an unsupported layer or argument is refused before any pod
    exists, with the parser's words. ``budget`` (one IPU's bytes, examples per IPU) refuses a
    model too large for it by arithmetic, before the build; the options' defaults when not
    given."""
    budget = budget or _budget({})
    if isinstance(model, str):
        pattern = options.BY_NAME["model"].schema["pattern"]
        if re.match(pattern, model):
            return None
        return (
            f"{model!r} is not a preset (cnn, cnn2), the absolute path of a .json or .keras "
            "file in the pod, or an inline Keras model config (an object)"
        )
    if not isinstance(model, Mapping):
        return (
            "must be a preset name, a path, or an inline Keras model config (an object), "
            f"got {type(model).__name__}"
        )
    size = len(json.dumps(model, separators=(",", ":")).encode())
    if size > MAX_INLINE_MODEL_BYTES:
        return (
            f"the inline model config is {size} bytes as compact JSON; at most "
            f"{MAX_INLINE_MODEL_BYTES} fit in the worker's --model argument: put it in a "
            ".json file on a volume and give its path"
        )
    return modelcheck.check(dict(model), *budget)


def load(obj: Mapping[str, Any]) -> Job:
    """Default, validate and convert a TrainingJob object (as from the API or a YAML file)."""
    if not isinstance(obj, Mapping):
        raise InvalidSpec("a TrainingJob must be a mapping, got " + type(obj).__name__)
    limits.check_depth(obj)
    if obj.get("apiVersion") != API_VERSION or obj.get("kind") != KIND:
        raise InvalidSpec(
            f"apiVersion/kind: expected {API_VERSION}/{KIND}, "
            f"got {obj.get('apiVersion')}/{obj.get('kind')}"
        )
    doc = apply_defaults(_schema(), {k: v for k, v in obj.items() if k != "status"})
    validate(doc)
    meta = doc.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not _DNS1035.match(name):
        raise InvalidSpec(
            f"metadata.name: {name!r} must be a DNS-1035 label (lower-case letters, digits, '-', "
            "starting with a letter): it names the job's Service"
        )
    if len(name) + _LONGEST_SUFFIX > 63:
        raise InvalidSpec(
            f"metadata.name: {name!r} is too long; pod host names '<name>-<role>-<index>' must fit "
            f"in 63 characters, so the name may have at most {63 - _LONGEST_SUFFIX}"
        )
    spec = doc["spec"]
    replicas = tuple(
        ReplicaSpec(
            key=key,
            role=role,
            replicas=rs["replicas"],
            restart_policy=rs["restartPolicy"],
            template=rs["template"],
        )
        for key, role in ROLE_KEYS.items()
        if (rs := spec["replicaSpecs"].get(key)) is not None and rs["replicas"] > 0
    )
    trainer = _trainer(spec["trainer"]) if "trainer" in spec else None
    mpi = None
    if "mpi" in spec:
        mpi, replicas = _mpi(spec["mpi"], replicas, trainer)
        if spec["runPolicy"]["successPolicy"] != "ChiefOrWorker0":
            raise InvalidSpec(
                "spec.runPolicy.successPolicy: an MPI job's outcome is its launcher's "
                "(mpirun's exit); remove successPolicy"
            )
    elif "Launcher" in spec["replicaSpecs"]:
        raise InvalidSpec(
            "spec.replicaSpecs.Launcher: a launcher runs mpirun and belongs to an MPI job; set "
            "spec.mpi or remove the Launcher"
        )
    _check_semantics(replicas, trainer)
    policy = elastic.policy(spec.get("elasticPolicy"), replicas, trainer, mpi)
    rp = spec["runPolicy"]
    backoff = rp["backoffLimit"]
    if policy is not None and policy.max_restarts is not None:  # the stricter of the two
        backoff = min(backoff, policy.max_restarts)
    return Job(
        name=name,
        namespace=meta.get("namespace") or "default",
        uid=meta.get("uid"),
        generation=int(meta.get("generation") or 1),
        replicas=replicas,
        trainer=trainer,
        run_policy=RunPolicy(
            backoff_limit=backoff,
            active_deadline_s=rp.get("activeDeadlineSeconds"),
            ttl_after_finished_s=rp.get("ttlSecondsAfterFinished"),
            clean_pod_policy=rp["cleanPodPolicy"],
            suspend=rp["suspend"],
            success_policy=rp["successPolicy"],
        ),
        mpi=mpi,
        elastic=policy,
    )


def _trainer(t: Mapping[str, Any]) -> TrainerSpec:
    if "steps" in t and "epochs" in t:
        raise InvalidSpec("spec.trainer: set steps or epochs, not both")
    if "data" in t and t.get("dataset") == "mnist-5k":
        raise InvalidSpec(
            "spec.trainer.data: dataset mnist-5k is built in and reads no files; "
            "remove spec.trainer.dataset (or spec.trainer.data)"
        )
    if t["batchSize"] % t["ipusPerWorker"]:
        raise InvalidSpec(
            f"spec.trainer.batchSize: {t['batchSize']} is not divisible by "
            f"spec.trainer.ipusPerWorker={t['ipusPerWorker']} (each IPU gets an equal share)"
        )
    modelfrom.check(t)
    values = optiongen.from_crd(t)
    for name, why in optionrules.errors(values):  # the worker's own rules (optiongen.check)
        raise InvalidSpec(f"spec.trainer.{options.BY_NAME[name].crd} {why}")
    if values["model_from"] is not None:  # the worker's --model: the file where it is mounted
        values["model"] = modelfrom.pod_path(values["model_from"])
    return TrainerSpec(**values)


def _mpi(
    m: Mapping[str, Any], replicas: tuple[ReplicaSpec, ...], trainer: TrainerSpec | None
) -> tuple[MPISpec, tuple[ReplicaSpec, ...]]:
    """spec.mpi, checked against the replicas (:func:`.mpi.check`), and the replicas with the
    Launcher (a default one, restartPolicy OnFailure, when replicaSpecs has none)."""

    if not any(r.role == "launcher" for r in replicas):
        replicas += (ReplicaSpec("Launcher", "launcher", 1, "OnFailure", {}),)
    out = MPISpec(
        implementation=m["mpiImplementation"],
        slots_per_worker=m["slotsPerWorker"],
        launcher_creation_policy=m["launcherCreationPolicy"],
        ssh_auth_mount_path=m["sshAuthMountPath"],
        command=tuple(m["command"]) if "command" in m else None,
    )
    mpi.check(out, replicas, trainer)
    return out, replicas


def _check_semantics(replicas: tuple[ReplicaSpec, ...], trainer: TrainerSpec | None) -> None:
    """What the schema cannot say: relations between fields."""
    if not any(r.role == "worker" for r in replicas):
        raise InvalidSpec("spec.replicaSpecs.Worker.replicas: at least one worker is required")
    if trainer is not None:
        _check_trainer_roles(replicas, trainer)
        limits.check_mounts(replicas, trainer)
    schedulable.check(replicas)
    for r in replicas:
        field = f"spec.replicaSpecs.{r.key}"
        if r.role == "chief" and r.replicas > 1:
            raise InvalidSpec(f"{field}.replicas: at most one chief, got {r.replicas}")
        tspec = r.template.get("spec", {})
        if not isinstance(tspec, Mapping):
            raise InvalidSpec(f"{field}.template.spec must be an object")
        containers = tspec.get("containers", [])
        if not isinstance(containers, list) or not all(
            isinstance(c, Mapping) and c.get("name") for c in containers
        ):
            raise InvalidSpec(
                f"{field}.template.spec.containers must be a list of named containers"
            )
        if trainer is None and not containers:
            raise InvalidSpec(
                f"{field}.template.spec.containers: required when spec.trainer is not set "
                "(there is no command to run)"
            )
        if trainer is None and not all(c.get("image") for c in containers):
            raise InvalidSpec(
                f"{field}.template.spec.containers[].image: required when spec.trainer is not set"
            )


def _check_trainer_roles(replicas: tuple[ReplicaSpec, ...], trainer: TrainerSpec) -> None:
    """The built-in trainer knows chief, workers and an evaluator (the CRD allows one); the
    evaluator reads what the chief writes, so their checkpoint volume must be one they share (an
    emptyDir is per pod)."""
    by_role = {r.role: r for r in replicas}
    if "ps" in by_role:
        raise InvalidSpec(
            "spec.replicaSpecs.PS: the built-in trainer (spec.trainer) has no parameter servers: "
            "its workers average gradients with a ring allreduce. Remove the PS replicas and "
            "give their resources to Worker replicas; a stock TensorFlow job (no spec.trainer, "
            "your own image and command) may still use PS"
        )
    ev = by_role.get("evaluator")
    if ev is None:
        return
    volume = trainer.checkpoint_volume
    if not volume or "emptyDir" in volume:
        raise InvalidSpec(
            "spec.replicaSpecs.Evaluator: the evaluator reads the checkpoints the chief writes, "
            "but the checkpoint volume is an emptyDir, which each pod has for itself; set "
            "spec.trainer.checkpoint.volume to storage the pods share (e.g. persistentVolumeClaim "
            "with ReadWriteMany, or ReadWriteOnce with all pods on one node)"
        )
