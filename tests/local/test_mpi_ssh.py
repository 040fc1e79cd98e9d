"""A job's SSH key opens only its own workers (issue 21): the real sshd (Debian's
openssh-server) runs as an MPI worker pod runs it, from the sshd_config, the key Secret and its
volume layout that :mod:`ringtrain_operator.mpi` generates for job A, as a non-root user on a
free high port; only sshd's port and run directory differ (one host, no emptyDir)."""

from __future__ import annotations

import base64
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.ports import free_port

from ringtrain_operator import manifests, mpi
from ringtrain_operator import spec as jobspec

pytestmark = pytest.mark.mpi

SSHD = "/usr/sbin/sshd"


def job(name: str, auth_dir: Path) -> jobspec.Job:
    return jobspec.load(
        {
            "apiVersion": jobspec.API_VERSION,
            "kind": jobspec.KIND,
            "metadata": {"name": name, "namespace": "team", "uid": f"u-{name}"},
            "spec": {
                "mpi": {"sshAuthMountPath": str(auth_dir)},
                "replicaSpecs": {"Worker": {"replicas": 1}},
                "trainer": {"dataset": "mnist-5k", "steps": 4},
            },
        }
    )


def login_user() -> pwd.struct_passwd:
    """sshd not run by root logs in only its own user: this one, or (as root) a non-root
    account with a shell, as the image's ``ringtrain`` user is."""
    me = pwd.getpwuid(os.getuid())
    if me.pw_uid != 0:
        return me
    users = [
        u
        for u in pwd.getpwall()
        if u.pw_uid >= 100 and u.pw_shell.endswith("sh") and Path(u.pw_shell).exists()
    ]
    if not users:
        pytest.fail("running as root with no non-root login account to run sshd as")
    return users[0]


def mount_secret(secret: dict, into: Path, uid: int) -> None:
    """The Secret as the kubelet mounts it in the worker: :func:`mpi.ssh_volume_items` at the
    volume's ``defaultMode``, owned by the pod's user."""
    into.mkdir(parents=True)
    for item in mpi.ssh_volume_items():
        f = into / item["path"]
        f.write_bytes(base64.b64decode(secret["data"][item["key"]]))
        os.chown(f, uid, -1)
        f.chmod(manifests.TOKEN_MODE)


def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 10) -> None:
    """The worker's readiness probe: sshd accepts TCP connections."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"sshd exited {proc.returncode}: {proc.stderr.read()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("sshd never listened")


@pytest.fixture
def worker_of_job_a() -> Iterator[tuple[int, str, dict, dict]]:
    if not Path(SSHD).exists():
        pytest.fail(f"{SSHD} missing: apt-get install openssh-server (the image has it)")
    user = login_user()
    root = Path(tempfile.mkdtemp(prefix="ringtrain-sshd-"))
    root.chmod(0o755)
    try:
        a = job("a", root / "a-ssh")
        b = job("b", root / "b-ssh")
        secret_a, secret_b = mpi.ssh_secret(a), mpi.ssh_secret(b)
        mount_secret(secret_a, root / "a-ssh", user.pw_uid)
        run_dir = root / "sshd-run"
        run_dir.mkdir()
        os.chown(run_dir, user.pw_uid, user.pw_gid)
        port = free_port()
        config = root / "sshd_config"
        config.write_text(mpi.sshd_config(a, port=port, run_dir=str(run_dir)))
        # the worker container's command (mpi.SSHD_SCRIPT) with this run directory and config
        script = mpi.SSHD_SCRIPT.replace(mpi.SSHD_RUN_DIR, str(run_dir)).replace(
            mpi.SSHD_CONFIG, str(config)
        )
        proc = subprocess.Popen(
            ["/bin/sh", "-c", script],
            user=user.pw_uid,
            group=user.pw_gid,
            env={"PATH": "/usr/bin:/bin", "HOME": str(run_dir)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            wait_listening(port, proc)
            yield port, user.pw_name, secret_a, secret_b
        finally:
            proc.terminate()
            proc.communicate(timeout=10)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def ssh(port: int, user: str, secret: dict, tmp: Path) -> subprocess.CompletedProcess:
    key = tmp / f"key-{secret['metadata']['name']}"
    key.write_bytes(base64.b64decode(secret["data"][mpi.PRIVATE_KEY]))
    key.chmod(0o400)
    return subprocess.run(
        [
            "ssh",
            "-F",
            "/dev/null",
            "-p",
            str(port),
            "-i",
            str(key),
            "-l",
            user,
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "PasswordAuthentication=no",
            "127.0.0.1",
            "true",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_a_jobs_key_opens_its_workers_and_another_jobs_key_is_refused(worker_of_job_a, tmp_path):
    port, user, secret_a, secret_b = worker_of_job_a
    assert secret_a["data"][mpi.PRIVATE_KEY] != secret_b["data"][mpi.PRIVATE_KEY]
    own = ssh(port, user, secret_a, tmp_path)
    assert own.returncode == 0, own.stderr
    other = ssh(port, user, secret_b, tmp_path)
    assert other.returncode == 255, other.stderr
    assert "Permission denied" in other.stderr
