"""``TrainerClient``: one API over two backends, named as Kubeflow's where the meaning is the same.

Pipeline position: the top of the project (a notebook, a script, ``ringtrain status``). ``fit``
builds the TrainingJob (:mod:`.build`), writes the model and the data, hands them to a backend —
:class:`.local.LocalBackend` (``ringtrain run``'s processes) or :class:`.kube.KubeBackend` (a
cluster) — and returns a :class:`Job` handle. Kubeflow's ``TrainerClient`` calls are here as
``list_jobs()``, ``get_job(name)``, ``get_job_logs(name, follow=)``, ``wait_for_job_status``
(``wait_for_job``), ``delete_job(name)``; the handle's methods are the same calls on one job.
Keras' ``model.fit`` names the training keywords (``x``, ``y``, ``validation_data``,
``epochs``, ``batch_size``).
"""

from __future__ import annotations

import io
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, TextIO, cast

from . import build
from .jobs import TERMINAL, JobFailed, JobStatus, JobTimeout, Metrics
from .kube import KubeBackend
from .local import LocalBackend
from .progress import display_for, from_status

#: seconds between looks at a job's status in ``wait``
POLL_S = 0.5


class Backend(Protocol):
    """What a backend does; the two are :class:`.local.LocalBackend` and
    :class:`.kube.KubeBackend`."""

    name: str

    def status(self, name: str) -> JobStatus: ...
    def metrics(self, name: str) -> Metrics: ...
    def logs(self, name: str, replica: str | None, follow: bool, out: TextIO) -> int: ...
    def export(self, name: str) -> Path: ...
    def delete(self, name: str) -> None: ...
    def list(self) -> list[JobStatus]: ...


class Job:
    """A submitted job: every call asks its backend anew (the handle holds only the name)."""

    def __init__(self, client: TrainerClient, name: str):
        self.client, self.name = client, name

    def __repr__(self) -> str:
        return f"Job({self.name!r}, backend={self.client.backend.name!r})"

    def status(self) -> JobStatus:
        """Where the job is now (phase, step, loss, accuracy); never blocks."""
        return self.client.backend.status(self.name)

    def wait(
        self, timeout: float | None = None, poll_s: float = POLL_S, progress: bool | None = None
    ) -> JobStatus:
        """Block until the job ends; its final status when it succeeded. Raises
        :class:`JobFailed` (the job's reason and message) when it failed and
        :class:`JobTimeout` after ``timeout`` seconds (the job goes on).

        ``progress``: the line ``ringtrain run`` draws, kept up to date while it waits — by
        default in a notebook (one output updated in place) or on a terminal, and nowhere
        else; ``True`` also prints it on a plain stream, ``False`` never shows it."""
        return self.client.wait_for_job(
            self.name, timeout=timeout, poll_s=poll_s, progress=progress
        )

    def logs(self, replica: str | None = None, follow: bool = False) -> str:
        """The replicas' output (``replica``: one, e.g. ``worker-1``); ``follow`` returns when
        the job ends, printing as it goes."""
        return self.client.get_job_logs(self.name, replica=replica, follow=follow)

    def metrics(self) -> Metrics:
        """The chief's progress and evaluations (``.history`` as Keras' History.history)."""
        return self.client.backend.metrics(self.name)

    def model(self) -> Any:
        """The trained model: the chief's export loaded by Keras (``keras.saving.load_model``).

        Its weights are the trained ones and it is compiled with the optimizer that trained it,
        with fresh state: the optimizer's moments stay in the job's checkpoint (the export
        holds the model), so Keras' warning that it skips the optimizer's variables — there are
        none to load, by design — is not shown."""
        import keras

        path = str(self.client.backend.export(self.name))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Skipping variable loading for optimizer")
            return keras.saving.load_model(path)

    def delete(self) -> None:
        """Stop the job if it runs, then delete it (locally: its run dir)."""
        self.client.delete_job(self.name)


class TrainerClient:
    """``backend``: ``"local"`` (processes on this machine, run dirs under ``root``) or
    ``"kubernetes"`` (TrainingJobs in ``namespace``, credentials from ``kubeconfig``; the
    chief's checkpoints and export on a claim of ``storage_class``, default the cluster's
    default StorageClass, which ``model()`` reads)."""

    def __init__(
        self,
        backend: str = "local",
        *,
        root: str | os.PathLike[str] | None = None,
        namespace: str = "default",
        kubeconfig: str | None = None,
        storage_class: str | None = None,
    ):
        self.backend: Backend
        if backend == "local":
            self.backend = LocalBackend(root)
        elif backend in ("kubernetes", "k8s", "cluster"):
            self.backend = KubeBackend(namespace, kubeconfig, storage_class)
        else:
            raise ValueError(f"backend={backend!r}: 'local' or 'kubernetes'")

    def fit(
        self,
        model: Any,
        x: Any = None,
        y: Any = None,
        *,
        validation_data: Any = None,
        epochs: int | None = None,
        batch_size: int | None = None,
        workers: int = 2,
        steps: int | None = None,
        data: str | os.PathLike[str] | None = None,
        spec: Mapping[str, Any] | None = None,
        name: str | None = None,
    ) -> Job:
        """Train ``model`` (a compiled ``keras.Model`` or a ``.keras`` path) on ``workers``
        replicas and return the job's handle at once.

        Data: ``x``, ``y`` and ``validation_data=(x_test, y_test)`` as numpy arrays (dicts by
        input/output name for several), or ``data=`` a ``.npz`` of ``x_train, y_train,
        x_test, y_test``. ``batch_size`` is the global batch (Keras'), split over the workers.
        ``spec`` is merged over the TrainingJob's ``spec`` last, so any field can be set:
        ``spec={"trainer": {"learningRate": 0.01}, "runPolicy": {"backoffLimit": 0}}``."""
        with tempfile.TemporaryDirectory(prefix="ringtrain-fit-") as tmp:
            staged = Path(tmp)
            stem = build.write_model(model, staged / build.MODEL_FILE)
            if data is not None:
                if x is not None or y is not None or validation_data is not None:
                    raise ValueError("give data= (a .npz) or x, y, validation_data, not both")
                src = Path(data)
                if src.suffix != ".npz" or not src.is_file():
                    raise ValueError(f"data={src}: not a .npz file (x_train, y_train, ...)")
                (staged / build.DATA_FILE).write_bytes(src.read_bytes())
            else:
                build.write_data(staged / build.DATA_FILE, x, y, validation_data)
            job_name = name or build.job_name(stem)
            files = {"model": staged / build.MODEL_FILE, "data": staged / build.DATA_FILE}
            return Job(
                self, self._submit(job_name, files, workers, batch_size, epochs, steps, spec)
            )

    def _submit(
        self,
        name: str,
        files: dict[str, Path],
        workers: int,
        batch_size: int | None,
        epochs: int | None,
        steps: int | None,
        spec: Mapping[str, Any] | None,
    ) -> str:
        args: dict[str, Any] = {"workers": workers, "batch_size": batch_size}
        args |= {"epochs": epochs, "steps": steps, "spec": spec}
        b = self.backend
        if isinstance(b, LocalBackend):
            run_dir = b.new_run_dir(name)
            model_path = b.input_path(run_dir, build.MODEL_FILE)
            data_path = b.input_path(run_dir, build.DATA_FILE)
            model_path.parent.mkdir(parents=True, exist_ok=True)
            files["model"].replace(model_path)
            files["data"].replace(data_path)
            # absolute paths outside every pod mount: ringtrain run passes them as they are
            trainer = {"model": str(model_path), "dataDir": str(data_path)}
            return b.submit(build.job_object(name, trainer=trainer, **args), run_dir)
        assert isinstance(b, KubeBackend)
        return b.submit(
            build.job_object(name, trainer=b.trainer_fields(name, files), **args), files
        )

    # --- Kubeflow's TrainerClient calls ------------------------------------------------------

    def list_jobs(self) -> list[JobStatus]:
        """Every job's status: the local runs under ``root`` (started here or by hand), or
        the namespace's TrainingJobs."""
        return self.backend.list()

    def get_job(self, name: str) -> Job:
        """The handle of an existing job (raises :class:`JobNotFound` when there is none)."""
        return Job(self, self.backend.status(name).name)

    def get_job_logs(
        self, name: str, replica: str | None = None, follow: bool = False, out: TextIO | None = None
    ) -> str:
        """The job's logs as one string; with ``follow`` (or ``out``) also written to ``out``
        (default stdout) as they come, until the job ends."""
        buf = io.StringIO()
        sink = cast(TextIO, _Tee(buf, out or sys.stdout) if (follow or out) else buf)
        self.backend.logs(name, replica, follow, sink)
        return buf.getvalue()

    def wait_for_job(
        self,
        name: str,
        timeout: float | None = None,
        poll_s: float = POLL_S,
        progress: bool | None = None,
    ) -> JobStatus:
        """:meth:`Job.wait` by name (``progress`` as there)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        shown = display_for(progress)
        try:
            while True:
                st = self.backend.status(name)
                if shown is not None:
                    shown.update(self._progress(st), final=st.phase in TERMINAL)
                if st.phase in TERMINAL:
                    if st.phase != "Succeeded":
                        raise JobFailed(st.name, st.reason, st.message)
                    return st
                if deadline is not None and time.monotonic() >= deadline:
                    raise JobTimeout(f"TrainingJob {st.name} still {st.phase} after {timeout} s")
                time.sleep(poll_s)
        finally:
            if shown is not None:
                shown.close()

    def _progress(self, st: JobStatus) -> Mapping[str, Any]:
        """The progress line's fields: a local run's own progress event, else what the
        status says (a TrainingJob's status holds the chief's step, loss and accuracy)."""
        b = self.backend
        return b.progress(st) if isinstance(b, LocalBackend) else from_status(st)

    def delete_job(self, name: str) -> None:
        """:meth:`Job.delete` by name."""
        self.backend.delete(name)


class _Tee(io.TextIOBase):
    """Writes to two text streams (the logs returned and the ones shown)."""

    def __init__(self, *streams: TextIO):
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            st.flush()


#: the keyword arguments of :func:`fit` that go to :class:`TrainerClient`
CLIENT_ARGS = ("root", "namespace", "kubeconfig", "storage_class")


def fit(model: Any, x: Any = None, y: Any = None, *, backend: str = "local", **kw: Any) -> Job:
    """``TrainerClient(backend, ...).fit(model, x, y, ...)`` in one call (the notebook's):
    ``root``, ``namespace``, ``kubeconfig`` and ``storage_class`` go to the client."""
    where = {k: kw.pop(k) for k in CLIENT_ARGS if k in kw}
    return TrainerClient(backend, **where).fit(model, x, y, **kw)
