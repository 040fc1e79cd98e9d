"""The e2e tests' reads of the API server, made in-process over one kept-alive connection.

The tests poll every 0.2-0.5 s while jobs train (a job's state, its pods' container statuses, a
worker's log). As a ``kubectl`` process each read cost ≈0.12 s of CPU (a Go binary started,
the kubeconfig parsed, a TLS handshake); polling took about a third of one of the CI machine's
two cores from the pods it waited on. The same GET from here costs ≈1 ms. Only plain reads
come here (``get KIND [NAME] [-n NS] [-l SEL] [--field-selector SEL]`` of the kinds below, and a
container's log); anything else is still ``kubectl``, and the answers are kubectl's JSON (a list
is ``kind: List`` whose items carry their ``apiVersion`` and ``kind``; no ``managedFields``)."""

from __future__ import annotations

import json
from typing import Any

from kubernetes import config
from kubernetes.client.exceptions import ApiException

# kubectl's names for a kind -> (API path prefix, plural, the item's apiVersion and kind)
KINDS: dict[str, tuple[str, str, str, str]] = {}
for _names, _version, _plural, _kind in (
    ("pod pods po", "v1", "pods", "Pod"),
    ("event events ev", "v1", "events", "Event"),
    ("node nodes no", "v1", "nodes", "Node"),
    ("secret secrets", "v1", "secrets", "Secret"),
    ("service services svc", "v1", "services", "Service"),
    ("serviceaccount serviceaccounts sa", "v1", "serviceaccounts", "ServiceAccount"),
    ("tj trainingjob trainingjobs", "ringtrain.io/v1alpha1", "trainingjobs", "TrainingJob"),
    ("deployment deployments deploy", "apps/v1", "deployments", "Deployment"),
):
    _prefix = "api/v1" if _version == "v1" else f"apis/{_version}"
    for _n in _names.split():
        KINDS[_n] = (_prefix, _plural, _version, _kind)
CLUSTER_SCOPED = {"nodes"}
FLAGS = {"-n": "namespace", "-l": "labelSelector", "--field-selector": "fieldSelector"}


class NotFound(AssertionError):
    """The object read by name does not exist (kubectl's ``NotFound``)."""


class ApiReads:
    """GETs against the cluster of one kubeconfig; thread-safe (urllib3's pool: the fault
    tests read from a watcher thread too)."""

    def __init__(self, kubeconfig: str) -> None:
        self.api = config.new_client_from_config(kubeconfig)

    def plan(self, args: tuple[str, ...]) -> tuple[str, dict[str, str], str | None] | None:
        """``(path, query, name)`` for a read this class makes, or None."""
        if len(args) < 2 or args[0] != "get" or args[1] not in KINDS:
            return None
        prefix, plural, _, _ = KINDS[args[1]]
        name, opts, rest = None, {}, list(args[2:])
        while rest:
            a = rest.pop(0)
            if a in FLAGS and rest:
                opts[FLAGS[a]] = rest.pop(0)
            elif not a.startswith("-") and name is None:
                name = a
            else:
                return None
        ns = opts.pop("namespace", None)
        if plural in CLUSTER_SCOPED:
            if ns is not None:
                return None
            path = f"/{prefix}/{plural}"
        else:
            path = f"/{prefix}/namespaces/{ns or 'default'}/{plural}"
        if name is not None:
            if opts:
                return None
            path += f"/{name}"
        return path, opts, name

    def _get(self, path: str, query: dict[str, str]) -> bytes:
        try:
            resp = self.api.call_api(
                path,
                "GET",
                query_params=list(query.items()),
                auth_settings=["BearerToken"],
                _preload_content=False,
                _request_timeout=30,
            )[0]
        except ApiException as e:
            if e.status == 404:
                raise NotFound(f"GET {path}: not found") from e
            raise AssertionError(f"GET {path} failed ({e.status}): {e.body!r}") from e
        except Exception as e:  # no connection: the API server is away
            raise AssertionError(f"GET {path} failed: {e!r}") from e
        return resp.data

    def json(self, args: tuple[str, ...]) -> dict[str, Any] | None:
        """kubectl's ``-o json`` answer to ``args``; None if this is not a read made here."""
        plan = self.plan(args)
        if plan is None:
            return None
        path, query, name = plan
        obj = json.loads(self._get(path, query))
        if name is not None:
            return _as_kubectl_shows(obj)
        _, _, version, kind = KINDS[args[1]]
        items = [_as_kubectl_shows(i) for i in obj.get("items") or []]
        for item in items:
            item.setdefault("apiVersion", version)
            item.setdefault("kind", kind)
        return {
            "apiVersion": "v1",
            "kind": "List",
            "items": items,
            "metadata": {"resourceVersion": ""},
        }

    def log(self, pod: str, ns: str, container: str, previous: bool = False) -> str:
        """The container's log ("" when it has none yet, as ``kubectl logs`` prints)."""
        query = {"container": container, **({"previous": "true"} if previous else {})}
        try:
            return self._get(f"/api/v1/namespaces/{ns}/pods/{pod}/log", query).decode(
                errors="replace"
            )
        except AssertionError:
            return ""


def _as_kubectl_shows(obj: dict[str, Any]) -> dict[str, Any]:
    """Without ``metadata.managedFields``, which kubectl leaves out by default."""
    obj.get("metadata", {}).pop("managedFields", None)
    return obj
