"""An in-memory stand-in for :class:`ringtrain_operator.kube.Kube`, for fast reconcile tests.

It keeps the semantics the reconciler relies on (409 on create of an existing name, 404 on
delete of a missing one, merge-patch of status); the e2e tests run the same code on a real API.
``refuse`` makes a create of (kind, name) answer an ApiException, as the API server's 422.
"""

from __future__ import annotations

import copy


class FakeKube:
    def __init__(self, job: dict) -> None:
        self.restarts: dict[str, int] = {}
        self.job: dict | None = copy.deepcopy(job)
        self.objects: dict[tuple[str, str], dict] = {}
        self.calls: list[tuple[str, str]] = []
        self.refuse: dict[tuple[str, str], Exception] = {}

    def get_job(self, namespace: str, name: str) -> dict | None:
        return copy.deepcopy(self.job)

    def list_pods(self, namespace: str, job_name: str) -> list[dict]:
        return [copy.deepcopy(o) for (kind, _), o in sorted(self.objects.items()) if kind == "Pod"]

    def create(self, obj: dict) -> bool:
        key = (obj["kind"], obj["metadata"]["name"])
        self.calls.append(("create", f"{key[0]}/{key[1]}"))
        if key in self.refuse:
            raise self.refuse[key]
        if key in self.objects:
            return False
        self.objects[key] = copy.deepcopy(obj)
        return True

    def read(self, kind: str, namespace: str, name: str) -> dict | None:
        self.calls.append(("read", f"{kind}/{name}"))
        found = self.objects.get((kind, name))
        return copy.deepcopy(found) if found is not None else None

    def delete_pod(self, namespace: str, name: str) -> bool:
        self.calls.append(("delete", f"Pod/{name}"))
        return self.objects.pop(("Pod", name), None) is not None

    def patch_status(self, namespace: str, name: str, patch: dict) -> None:
        self.calls.append(("patch", "status"))
        merge_patch(self.job.setdefault("status", {}), patch)

    def delete_job(self, namespace: str, name: str) -> None:
        self.calls.append(("delete", "TrainingJob"))
        self.job = None

    def set_pod_phase(self, name: str, phase: str, exit_code: int | None = None) -> None:
        pod = self.objects[("Pod", name)]
        cs = {"name": "ringtrain", "restartCount": 0, "state": {"running": {}}}
        if exit_code is not None:
            cs["state"] = {"terminated": {"exitCode": exit_code}}
        pod["status"] = {
            "phase": phase,
            "podIP": "10.1.0.9",
            "containerStatuses": [cs],
            "conditions": [{"type": "Ready", "status": "True" if phase == "Running" else "False"}],
        }

    def restart_in_place(self, name: str, exit_code: int) -> None:
        """What the kubelet does under restartPolicy OnFailure: the container runs again in the
        same pod, restartCount + 1, its previous exit in lastState."""
        self.set_pod_phase(name, "Running")
        cs = self.objects[("Pod", name)]["status"]["containerStatuses"][0]
        cs["restartCount"] = self.restarts.get(name, 0) + 1
        self.restarts[name] = cs["restartCount"]
        cs["lastState"] = {"terminated": {"exitCode": exit_code, "reason": "Error"}}


def merge_patch(target: dict, patch: dict) -> None:
    """RFC 7386 as the API server applies it: objects merged key by key, null removes."""
    for k, v in patch.items():
        if v is None:
            target.pop(k, None)
        elif isinstance(v, dict) and isinstance(target.get(k), dict):
            merge_patch(target[k], v)
        else:
            target[k] = copy.deepcopy(v)
