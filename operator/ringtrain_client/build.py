"""``fit``'s arguments → a TrainingJob and the two files its replicas read.

Pipeline position: :func:`ringtrain_client.client.TrainerClient.fit` calls :func:`job_object`
for the manifest and :func:`write_model` / :func:`write_data` for the files; the backend then
says where the replicas find them (a local path, a ConfigMap) and submits. The files are the
formats the trainer already reads — the model with its weights as ``model.save`` writes a
``.keras`` archive, the data as the ``.npz`` of ``x_train, y_train, x_test, y_test``
(docs/your-model-and-data.md) — so nothing new is parsed in a pod.

Keras' names where the meaning is Keras': ``batch_size`` is the **global** batch, as in
``model.fit`` and MultiWorkerMirroredStrategy, split evenly over ``workers`` (the CRD's
``batchSize`` is per worker); ``epochs``/``steps`` are the CRD's. Whatever the keywords do not
name is reachable through ``spec=``, merged last, so every field of the TrainingJob is.
"""

from __future__ import annotations

import copy
import re
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ringtrain_operator.job import GROUP, VERSION

#: the file names the client writes, in the run dir's ``inputs/`` or as ConfigMap keys
MODEL_FILE, DATA_FILE = "model.keras", "data.npz"
#: where the chief exports the trained model: relative, so in the checkpoint volume
EXPORT_PATH = "model.keras"
#: a job name's room before the operator's longest pod suffix (spec.py: 63 in all)
NAME_MAX = 40


def job_name(base: str) -> str:
    """A DNS-1035 name from ``base`` (the model's name) and a random suffix, so two ``fit``
    calls of one model never collide (Kubernetes' ``generateName`` shape)."""
    stem = re.sub(r"[^a-z0-9-]+", "-", base.lower()).strip("-")
    stem = re.sub(r"^[^a-z]+", "", stem)[: NAME_MAX - 6].rstrip("-") or "job"
    return f"{stem}-{secrets.token_hex(2)}"


def merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``override`` into ``base``, recursively for mappings (a ``None`` removes the key), as
    a strategic merge of the spec would: ``spec={"trainer": {"lr": 0.01}}`` keeps the rest."""
    out = copy.deepcopy(base)
    for k, v in override.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def per_worker_batch(batch_size: int, workers: int) -> int:
    if batch_size < workers or batch_size % workers:
        raise ValueError(
            f"batch_size={batch_size} is the global batch (as in Keras' fit); it must be a "
            f"multiple of workers={workers}, each worker taking batch_size / workers"
        )
    return batch_size // workers


def job_object(
    name: str,
    *,
    workers: int,
    batch_size: int | None,
    epochs: int | None,
    steps: int | None,
    trainer: Mapping[str, Any],
    spec: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The TrainingJob: ``workers`` Worker replicas (restartPolicy ExitCode: a permanent error
    fails the job at once, a lost peer is retried), the trainer fields the backend chose for
    the model and the data (``trainer``), the export the handle's ``model()`` reads, then
    ``spec`` over all of it."""
    if workers < 1:
        raise ValueError(f"workers={workers}: at least 1")
    if steps is not None and epochs is not None:
        raise ValueError("give steps or epochs, not both (the CRD's fields are exclusive)")
    t: dict[str, Any] = {**trainer, "export": {"path": EXPORT_PATH}}
    if batch_size is not None:
        t["batchSize"] = per_worker_batch(batch_size, workers)
    if steps is not None:
        t["steps"] = steps
    if epochs is not None:
        t["epochs"] = epochs
    body: dict[str, Any] = {
        "replicaSpecs": {"Worker": {"replicas": workers, "restartPolicy": "ExitCode"}},
        "trainer": t,
        "runPolicy": {"backoffLimit": 2},
    }
    obj = {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name},
        "spec": merge(body, spec or {}),
    }
    return obj


def write_model(model: Any, path: Path) -> str:
    """A compiled ``keras.Model`` saved with its weights, or an existing ``.keras`` file
    copied, at ``path``; returns the model's name (for the job's)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(model, (str, Path)):
        src = Path(model)
        if src.suffix != ".keras" or not src.is_file():
            raise ValueError(f"{src}: not a .keras file (model.save('m.keras') writes one)")
        shutil.copyfile(src, path)
        return src.stem
    if not hasattr(model, "save") or not hasattr(model, "compile"):
        raise TypeError(f"model: a compiled keras.Model or a .keras path, not {type(model)!r}")
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            "model is not compiled: call model.compile(optimizer, loss, metrics) first "
            "(its compile() settings are what the job trains with)"
        )
    model.save(str(path))
    return str(getattr(model, "name", "") or "model")


def _arrays(prefix: str, value: Any) -> dict[str, np.ndarray]:
    """One array as ``prefix``, or a dict of them (a model with several inputs or outputs)
    as ``prefix_<name>`` (decision 0007)."""
    if isinstance(value, Mapping):
        return {f"{prefix}_{k}": np.asarray(v) for k, v in value.items()}
    return {prefix: np.asarray(value)}


def write_data(path: Path, x: Any, y: Any, validation_data: Any) -> int:
    """``x``, ``y`` and ``validation_data=(x_test, y_test)`` as the trainer's ``.npz``;
    returns its size in bytes. The test split is required: the trainer evaluates on it (the
    job's reported accuracy) and the file format holds one."""
    if validation_data is None:
        raise ValueError(
            "validation_data=(x_test, y_test) is required: the job evaluates on it and "
            "reports its accuracy (the trainer's .npz holds a test split)"
        )
    try:
        x_test, y_test = validation_data
    except (TypeError, ValueError):
        raise ValueError("validation_data: a pair (x_test, y_test)") from None
    arrays = {
        **_arrays("x_train", x),
        **_arrays("y_train", y),
        **_arrays("x_test", x_test),
        **_arrays("y_test", y_test),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]  # np.savez's stubs want positionals
    return path.stat().st_size
