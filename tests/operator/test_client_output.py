"""How the client reads a cluster job's export back (ringtrain_client.output): the reader pod's
settings and the check of what it printed. The real pod on the real cluster:
tests/e2e/test_client_cluster.py."""

from __future__ import annotations

import base64
import hashlib

import pytest

from ringtrain_client import output


def _printed(data: bytes, size: int | None = None, digest: str | None = None) -> str:
    head = f"{len(data) if size is None else size} {digest or hashlib.sha256(data).hexdigest()}"
    return head + "\n" + base64.encodebytes(data).decode()


def test_what_the_reader_printed_is_the_file_when_its_size_and_digest_agree():
    data = bytes(range(256)) * 300
    assert output.decode(_printed(data), "x") == data


@pytest.mark.parametrize(
    ("log", "why"),
    [
        (_printed(b"model", digest="0" * 64), "do not match its size or SHA-256"),
        (_printed(b"model", size=6), "do not match its size or SHA-256"),
        ("Traceback (most recent call last):\n", "not a size and digest"),
        (f"{output.MAX_FETCH_BYTES + 1} {'0' * 64}\n", "reads at most"),
    ],
)
def test_a_truncated_forged_or_oversized_read_is_refused_naming_why(log, why):
    with pytest.raises(OSError, match=why):
        output.decode(log, "job's export /checkpoints/model.keras")


def test_the_reader_pod_mounts_the_claim_read_only_and_runs_as_the_trainer_pods_do():
    pod = output.reader_pod(
        "j", "ns", {"image": "img:1", "imagePullPolicy": "Never"}, "j-output", "/ck", "/ck/m.keras"
    )
    spec = pod["spec"]
    (c,) = spec["containers"]
    assert c["image"] == "img:1" and c["imagePullPolicy"] == "Never"
    assert c["command"][-2:] == ["/ck/m.keras", str(output.MAX_FETCH_BYTES)]
    assert c["volumeMounts"] == [{"name": "output", "mountPath": "/ck", "readOnly": True}]
    assert spec["volumes"][0]["persistentVolumeClaim"] == {
        "claimName": "j-output",
        "readOnly": True,
    }
    assert spec["securityContext"]["runAsNonRoot"] and not spec["automountServiceAccountToken"]
    assert c["securityContext"]["readOnlyRootFilesystem"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
