"""The Kubernetes backend: a job is a TrainingJob in a namespace, its files ConfigMaps.

Pipeline position: the client's submit creates the TrainingJob, then one ConfigMap for the model
(``spec.trainer.modelFrom.configMap``, decision 0206) and one for the data (``spec.trainer.data``
with a configMap volume), each owned by the job, so deleting the job removes them (the garbage
collector) and ``kubectl get tj -o yaml`` names where the files came from. Pods wait in
ContainerCreating for the ConfigMaps (the kubelet retries the mount), so creating the job first
costs nothing and gives the owner's uid. A ConfigMap holds at most 1 MiB: beyond it submit
refuses, naming the size and the limit (a PersistentVolumeClaim the client fills is issue 36's
next step, not done). Credentials: in-cluster, else the kubeconfig (``$KUBECONFIG``), as the
operator's (:func:`ringtrain_operator.kube.load_config`).

The chief's checkpoints and export go to a PersistentVolumeClaim the job owns when a storage
class is known (:mod:`.output`), so ``model()`` can read the export after the pods are gone.
End to end on the local cluster: tests/e2e/test_client_cluster.py.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, TextIO

from kubernetes import client
from kubernetes.client import ApiException

from ringtrain.options import BY_NAME
from ringtrain_localrun.logs import label_of
from ringtrain_operator import manifests, modelfrom
from ringtrain_operator.job import GROUP, PLURAL, VERSION
from ringtrain_operator.kube import load_config

from . import output, upload
from .build import DATA_FILE, MODEL_FILE
from .jobs import JobNotFound, JobStatus, Metrics, fold_metrics

#: how long ``logs(follow=True)`` waits for the job's pods and their containers to start
LOG_START_WAIT_S = 300
#: where the data ConfigMap is mounted in the trainer pods (spec.trainer.data.path)
DATA_MOUNT = "/data"


def too_big(size: int, what: str) -> str | None:
    """Why ``size`` bytes cannot go in one ConfigMap (the client has no other route yet)."""
    if size <= modelfrom.MAX_OBJECT_BYTES:
        return None
    return (
        f"{what} is {size:,} bytes; a ConfigMap holds at most {modelfrom.MAX_OBJECT_BYTES:,} "
        "(1 MiB, Kubernetes' limit), and the client ships nothing larger to a cluster yet: "
        "put it on a PersistentVolumeClaim and name it in spec= (trainer.modelFrom / "
        "trainer.data), or use the local backend"
    )


def trainer_fields(name: str) -> dict[str, Any]:
    """``spec.trainer`` naming the two ConfigMaps :meth:`KubeBackend.submit` creates."""
    return {
        "modelFrom": {"configMap": {"name": f"{name}-model", "key": MODEL_FILE}},
        "data": {
            "volume": {"configMap": {"name": f"{name}-data"}},
            "path": DATA_MOUNT,
            "file": DATA_FILE,
        },
    }


def _owner(job: dict[str, Any]) -> dict[str, Any]:
    """The ownerReference that makes an object the job's (garbage-collected with it)."""
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "name": job["metadata"]["name"],
        "uid": job["metadata"]["uid"],
        "controller": False,
        "blockOwnerDeletion": False,
    }


def _over_a_configmap(sizes: dict[str, int]) -> list[str]:
    return [what for what, size in sizes.items() if size > modelfrom.MAX_OBJECT_BYTES]


class KubeBackend:
    """TrainingJobs in ``namespace`` of the cluster the kubeconfig names."""

    name = "kubernetes"

    def __init__(
        self,
        namespace: str = "default",
        kubeconfig: str | None = None,
        storage_class: str | None = None,
    ):
        self.namespace = namespace
        self.storage_class = storage_class
        api = load_config(kubeconfig)
        self.api = api
        self.custom = client.CustomObjectsApi(api)
        self.core = client.CoreV1Api(api)

    def _get(self, name: str) -> dict[str, Any]:
        try:
            obj: dict[str, Any] = self.custom.get_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name
            )
        except ApiException as e:
            if e.status == 404:
                raise JobNotFound(f"no TrainingJob {name} in namespace {self.namespace}") from None
            raise
        return obj

    def trainer_fields(self, name: str, files: dict[str, Path]) -> dict[str, Any]:
        """``spec.trainer``'s model and data: each in a ConfigMap when it fits one, else on a
        claim of its own that :mod:`.upload` fills."""
        fields = trainer_fields(name)
        big = _over_a_configmap({w: p.stat().st_size for w, p in files.items()})
        if "model" in big:
            claim = upload.claim_name(name, "model")
            fields["modelFrom"] = {
                "persistentVolumeClaim": {"claimName": claim, "path": MODEL_FILE}
            }
        if "data" in big:
            claim = upload.claim_name(name, "data")
            fields["data"]["volume"] = {
                "persistentVolumeClaim": {"claimName": claim, "readOnly": True}
            }
        return fields

    def submit(self, obj: dict[str, Any], files: dict[str, Path]) -> str:
        """Create the TrainingJob, then its inputs (``{"model": path, "data": path}``) owned
        by it: a ConfigMap per file, or — named so by :meth:`trainer_fields` — the input claim,
        filled while the job is suspended. Sizes are checked before anything is created."""
        contents = {what: p.read_bytes() for what, p in files.items()}
        name = obj["metadata"]["name"]
        big = _over_a_configmap({w: len(d) for w, d in contents.items()})
        run_policy = obj["spec"].setdefault("runPolicy", {})
        suspended = bool(run_policy.get("suspend"))
        checkpoint = obj["spec"].setdefault("trainer", {}).setdefault("checkpoint", {})
        own_volume = "volume" in checkpoint  # the user's own volume (spec=) is kept
        cls = self.storage_class
        if cls is None and (big or not own_volume):
            cls = output.default_storage_class(self.api)
        input_class = None
        if big:
            sizes = {files[w].name: len(contents[w]) for w in big}
            if (why := upload.too_big(sizes)) is not None:
                raise ValueError(why)
            if cls is None:
                raise ValueError(
                    f"{', '.join(f'{k} is {v:,} bytes' for k, v in sizes.items())}: over a "
                    f"ConfigMap's {modelfrom.MAX_OBJECT_BYTES:,}, so the client copies it "
                    "onto a claim, which needs a storage class: give TrainerClient(..., "
                    "storage_class=) (the cluster has no default StorageClass)"
                )
            input_class = cls
            run_policy["suspend"] = True  # no pod before its inputs are in place
        storage = None if own_volume else cls
        if storage is not None:
            claim = output.claim_name(name)
            checkpoint["volume"] = {"persistentVolumeClaim": {"claimName": claim}}
        created = self.custom.create_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, obj
        )
        owner = _owner(created)
        try:  # nothing half-made: a job whose inputs could not all be made is deleted
            self._inputs(obj, owner, contents, input_class, storage)
            if input_class is not None and not suspended:
                patch = {"spec": {"runPolicy": {"suspend": False}}}
                self.custom.patch_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, name, patch
                )
        except BaseException:
            self.delete(name)
            raise
        return str(name)

    def _inputs(
        self,
        obj: dict[str, Any],
        owner: dict[str, Any],
        contents: dict[str, bytes],
        input_class: str | None,
        storage: str | None,
    ) -> None:
        """The job's ConfigMaps and claims, each owned by it: the small inputs' ConfigMaps and
        the output claim first, then each large input's claim, filled (:mod:`.upload`)."""
        name = obj["metadata"]["name"]
        keys = {"model": MODEL_FILE, "data": DATA_FILE}
        big = _over_a_configmap({w: len(d) for w, d in contents.items()})
        for what, data in contents.items():
            if what in big:
                continue
            cm = modelfrom.configmap(f"{name}-{what}", keys[what], data, self.namespace)
            cm["metadata"]["ownerReferences"] = [owner]
            cm["metadata"]["labels"] = {manifests.LABEL_JOB: name}
            self.core.create_namespaced_config_map(self.namespace, cm)
        if storage is not None:
            pvc = output.claim(name, self.namespace, storage)
            pvc["metadata"]["ownerReferences"] = [owner]
            self.core.create_namespaced_persistent_volume_claim(self.namespace, pvc)
        for what in big:
            assert input_class is not None
            data = contents[what]
            pvc = upload.claim(name, what, self.namespace, input_class, len(data))
            pvc["metadata"]["ownerReferences"] = [owner]
            self.core.create_namespaced_persistent_volume_claim(self.namespace, pvc)
            upload.copy(
                self.core,
                self.namespace,
                name,
                what,
                self._container(obj),
                {keys[what]: data},
                owner,
            )

    def status(self, name: str) -> JobStatus:
        obj = self._get(name)
        st = obj.get("status") or {}
        state = st.get("state")
        cond: dict[str, Any] = next(
            (
                c
                for c in st.get("conditions") or []
                if c.get("type") == state and c.get("status") == "True"
            ),
            {},
        )
        prog = st.get("progress") or {}
        trainer = (obj.get("spec") or {}).get("trainer") or {}
        return JobStatus(
            name=name,
            backend=self.name,
            phase=state,
            reason=cond.get("reason"),
            message=cond.get("message"),
            step=prog.get("step"),
            total_steps=trainer.get("steps"),
            loss=prog.get("loss"),
            test_accuracy=prog.get("testAccuracy"),
            restarts=int(st.get("restarts") or 0),
            export=prog.get("export"),
            location=f"{self.namespace}/{name}",
        )

    def _pods(self, name: str, replica: str | None = None) -> list[str]:
        sel = f"{manifests.LABEL_JOB}={name},!{output.HELPER_LABEL}"  # the replicas only
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=sel).items
        names = sorted(p.metadata.name for p in pods)
        if replica is not None:
            names = [n for n in names if n == replica or n.endswith(f"-{replica}")]
        return names

    def _chief(self, name: str) -> str | None:
        pods = self._pods(name)
        return next((p for p in pods if p.endswith(("-chief-0", "-worker-0"))), None)

    def metrics(self, name: str) -> Metrics:
        chief = self._chief(name)
        if chief is None:
            return Metrics()
        text = self.core.read_namespaced_pod_log(chief, self.namespace, container=self._main(chief))
        return fold_metrics(str(text).splitlines())

    def logs(self, name: str, replica: str | None, follow: bool, out: TextIO) -> int:
        pods = self._pods(name, replica)
        deadline = time.monotonic() + LOG_START_WAIT_S
        while follow and not pods and time.monotonic() < deadline:  # just submitted
            self._get(name)
            time.sleep(0.5)
            pods = self._pods(name, replica)
        if not pods:
            raise JobNotFound(f"no pod of {name} in {self.namespace} (replica {replica!r})")
        prefix = len(pods) > 1  # as a local run's logs: ``worker-0  | line``
        for pod in pods:
            head = (
                f"{label_of(pod):<10}| " if prefix else ""
            )  # followed one after the other: a job's pods end together
            resp = self._log_stream(pod, follow)
            if resp is None:
                continue
            tail = b""
            for raw in resp.stream():
                *lines, tail = (tail + raw).split(b"\n")
                for line in lines:
                    text = line.decode(errors="replace")
                    out.write(head + text + "\n")
            if tail:
                text = tail.decode(errors="replace")
                out.write(head + text + "\n")
            out.flush()
        return 0

    def _main(self, pod: str) -> str:
        """The pod's main container, as the operator picks it: the one named ``ringtrain``,
        else the first (a stock template's ``tensorflow``)."""
        names = [c.name for c in self.core.read_namespaced_pod(pod, self.namespace).spec.containers]
        return manifests.MAIN_CONTAINER if manifests.MAIN_CONTAINER in names else names[0]

    def _log_stream(self, pod: str, follow: bool) -> Any:
        """The pod's main container's log as a stream; None when it has not started and
        ``follow`` is not set (nothing logged yet). Following waits for it to start: the API
        answers 400 while the container is created (its ConfigMaps mounted, its image pulled)."""
        deadline = time.monotonic() + LOG_START_WAIT_S
        container = self._main(pod)
        while True:
            try:
                return self.core.read_namespaced_pod_log(
                    pod,
                    self.namespace,
                    container=container,
                    follow=follow,
                    _preload_content=False,
                )
            except ApiException as e:
                if e.status != 400 or "waiting to start" not in str(e.body):
                    raise  # only a container not started yet is waited for, nothing else
                if not follow:
                    return None
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{pod}: its container did not start within {LOG_START_WAIT_S} s "
                        f"({e.body!r:.200})"
                    ) from None
                time.sleep(0.5)

    def export(self, name: str) -> Path:
        """The chief's export, read from the job's checkpoint claim by a short-lived pod
        (:mod:`.output`) into a local temporary directory."""
        obj, st = self._get(name), self.status(name)
        if st.phase != "Succeeded" or not st.export:
            raise FileNotFoundError(
                f"{name}: no exported model ({st.phase}; the chief exports when it succeeds)"
            )
        checkpoint = ((obj.get("spec") or {}).get("trainer") or {}).get("checkpoint") or {}
        claim = ((checkpoint.get("volume") or {}).get("persistentVolumeClaim") or {}).get(
            "claimName"
        )
        if not claim:
            raise FileNotFoundError(
                f"{name}: the export {st.export} was on the chief's checkpoint volume, which is "
                "not a PersistentVolumeClaim, so it went with the pod. The client makes one "
                "when given a storage class (TrainerClient(..., storage_class=)) or the "
                "cluster has a default StorageClass; or name your own claim in "
                "spec.trainer.checkpoint.volume"
            )
        mount = checkpoint.get("path") or "/checkpoints"
        path = st.export if st.export.startswith("/") else f"{mount}/{st.export}"
        pod = output.reader_pod(name, self.namespace, self._container(obj), claim, mount, path)
        pod["metadata"]["ownerReferences"] = [_owner(obj)]  # gone with the job, whatever happens
        data = output.read(self.core, self.namespace, pod, f"{name}'s export {path}")
        local = Path(tempfile.mkdtemp(prefix=f"ringtrain-{name}-")) / Path(path).name
        local.write_bytes(data)
        return local

    def _container(self, obj: dict[str, Any]) -> dict[str, Any]:
        """The trainer pods' image and pull policy, as the operator chooses them: a
        template's container image, else ``spec.trainer.image``, else its default."""
        spec = obj.get("spec") or {}
        for rs in (spec.get("replicaSpecs") or {}).values():
            for c in ((rs.get("template") or {}).get("spec") or {}).get("containers") or []:
                if c.get("image"):
                    return dict(c)
        return {"image": (spec.get("trainer") or {}).get("image") or BY_NAME["image"].default}

    def delete(self, name: str) -> None:
        try:
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, name, propagation_policy="Foreground"
            )
        except ApiException as e:
            if e.status != 404:
                raise
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                self._get(name)
            except JobNotFound:
                return
            time.sleep(0.5)

    def list(self) -> list[JobStatus]:
        items = self.custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL
        ).get("items", [])
        return [self.status(o["metadata"]["name"]) for o in items]
