"""Which paths of a pod become local paths when ``ringtrain run`` turns it into a process.

Pipeline position: :func:`.plan.plan` maps each pod's volumes to directories of the run (or the
user's own ``hostPath``) and rewrites the arguments and environment values that lie inside a
mount; the rule for what is never rewritten (the user's ``/tmp`` below the scratch mount, the
interpreter's environment, the checkout) is decision 0200.
"""

from __future__ import annotations

import base64
import dataclasses
import os
import sys
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any

from ringtrain_operator import manifests
from ringtrain_operator import spec as jobspec

CHECKPOINT_VOLUME = manifests.CHECKPOINT_VOLUME


#: The pod's scratch space (manifests.pod mounts an emptyDir there: the root filesystem is
#: read-only). Locally it maps only itself (``HOME=/tmp``): below it is this machine's ``/tmp``,
#: where users keep checkouts and models (issue 34).
SCRATCH_MOUNT = "/tmp"


#: Paths no argument is ever rewritten under, wherever they are: the interpreter's environment
#: and this checkout (an MPI launcher's args name the interpreter of the ranks).
NEVER_REWRITTEN = tuple(
    dict.fromkeys(
        str(p)
        for p in (
            Path(sys.executable).parent,
            Path(sys.prefix),
            Path(__file__).resolve().parents[2],
        )
    )
)


def secret_data(objs: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, bytes]]:
    """Secrets and ConfigMaps by kind and name: their files, as the kubelet writes them."""
    out: dict[str, dict[str, bytes]] = {}
    for o in objs:
        if o.get("kind") == "Secret":
            data = {k: base64.b64decode(v) for k, v in (o.get("data") or {}).items()}
            data.update({k: v.encode() for k, v in (o.get("stringData") or {}).items()})
            out[o["metadata"]["name"]] = data
        elif o.get("kind") == "ConfigMap":
            data = {k: v.encode() for k, v in (o.get("data") or {}).items()}
            data.update({k: base64.b64decode(v) for k, v in (o.get("binaryData") or {}).items()})
            out[f"configmap/{o['metadata']['name']}"] = data
    return out


def items(source: Mapping[str, Any], data: Mapping[str, bytes]) -> dict[str, bytes]:
    """A Secret or ConfigMap volume's files: every key, or only its ``items`` at their paths."""
    if not source.get("items"):
        return dict(data)
    return {i["path"]: data[i["key"]] for i in source["items"] if i["key"] in data}


def volume_dirs(
    pod: Mapping[str, Any],
    run_dir: Path,
    secrets: Mapping[str, Mapping[str, bytes]],
) -> tuple[dict[str, Path], dict[str, bytes]]:
    """Volume name → local directory, and the files that must exist in them."""
    pod_name = pod["metadata"]["name"]
    dirs: dict[str, Path] = {}
    files: dict[str, bytes] = {}
    for v in pod["spec"].get("volumes") or []:
        name = v["name"]
        if "secret" in v:
            local = run_dir / "pods" / pod_name / "secrets" / name
            data = secrets.get(v["secret"]["secretName"])
            if data is None:
                raise jobspec.InvalidSpec(
                    f"pod {pod_name}: volume {name} mounts secret {v['secret']['secretName']}, "
                    "which the job does not create"
                )
            for key, content in items(v["secret"], data).items():
                files[str(local / key)] = content
        elif "configMap" in v:
            local = run_dir / "pods" / pod_name / "configmaps" / name
            cm = v["configMap"]["name"]
            for key, content in items(v["configMap"], secrets.get(f"configmap/{cm}", {})).items():
                files[str(local / key)] = content
        elif "downwardAPI" in v:  # the pod's own annotations as files (an elastic job's size)
            local = run_dir / "pods" / pod_name / "downward" / name
            notes = pod["metadata"].get("annotations") or {}
            for item in v["downwardAPI"].get("items") or []:
                ref = (item.get("fieldRef") or {}).get("fieldPath", "")
                key = ref.removeprefix("metadata.annotations['").removesuffix("']")
                if key != ref and key in notes:
                    files[str(local / item["path"])] = notes[key].encode()
        elif name == CHECKPOINT_VOLUME:
            # Shared and kept whatever its source: the chief writes, a rerun with the same
            # --run-dir resumes, the summary points at it.
            local = run_dir / CHECKPOINT_VOLUME
        elif "hostPath" in v:
            # This machine is the node: the host path itself (the user's data, say).
            local = Path(v["hostPath"]["path"])
        elif "emptyDir" in v:
            local = run_dir / "pods" / pod_name / "volumes" / name
        else:
            # A PVC, hostPath, NFS...: storage the gang shares and that outlives a replica.
            local = run_dir / "volumes" / name
        dirs[name] = local
    return dirs, files


def under_any(path: Path, roots: Iterable[Path]) -> bool:
    """A hostPath is the user's: never created (nor anything under it)."""
    return any(path == r or r in path.parents for r in roots)


def inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def rewrite(
    value: str,
    mounts: Mapping[str, Path],
    run_dir: Path | None = None,
    user_mounts: Collection[str] = (),
) -> str:
    """An in-pod path under a mount → the local path (the longest mount path wins); any other
    value as it is. Never rewritten (docs/decisions/0200-local-run-paths.md): a path below the
    scratch mount ``/tmp`` (this machine's own ``/tmp``: only ``/tmp`` itself is the pod's), a
    path in the interpreter's environment or this checkout, and, below a mount of a volume the
    user declared in a pod template (``user_mounts``), a path that exists on this machine
    outside ``run_dir`` (the user's own file where the volume would hold it)."""
    for mount in sorted(mounts, key=len, reverse=True):
        if not inside(value, mount):
            continue
        if value != mount and (
            mount.rstrip("/") == SCRATCH_MOUNT
            or any(inside(value, keep) for keep in NEVER_REWRITTEN)
            or (
                mount in user_mounts
                and os.path.lexists(value)
                and not (run_dir is not None and inside(value, str(run_dir)))
            )
        ):
            return value
        return str(mounts[mount]) + value[len(mount.rstrip("/")) :]
    return value


@dataclasses.dataclass
class PodPaths:
    """One container's mounts: in-pod values made local (:func:`rewrite`), each rewrite
    remembered with why (:attr:`Replica.rewritten`)."""

    mounts: Mapping[str, Path]  # mount path → local directory
    volumes: Mapping[str, str]  # mount path → volume name
    user_mounts: Collection[str]
    run_dir: Path
    rewritten: dict[str, str] = dataclasses.field(default_factory=dict)

    def local(self, value: str) -> str:
        new = rewrite(value, self.mounts, self.run_dir, self.user_mounts)
        if new != value:
            mount = max((m for m in self.mounts if inside(value, m)), key=len)
            self.rewritten[new] = (
                f"{value} in the pod (volume {self.volumes[mount]}, mounted at {mount})"
            )
        return new
