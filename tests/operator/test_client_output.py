"""How the client reads a cluster job's export back (ringtrain_client.output): the reader pod's
settings and the check of what it printed. The real pod on the real cluster:
tests/e2e/test_client_cluster.py."""

from __future__ import annotations

import base64
import hashlib

import pytest

from ringtrain_client import output, upload


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


def test_a_file_is_cut_into_configmap_parts_the_writer_joins_and_checks():
    data = bytes(range(256)) * 9000  # 2.3 MB: three parts
    maps, args = upload.parts("j-data", "ns", {"data.npz": data})
    assert [m["metadata"]["name"] for m in maps] == [f"j-data-part-{i:04d}" for i in range(3)]
    joined = b"".join(base64.b64decode(next(iter(m["binaryData"].values()))) for m in maps)
    assert joined == data
    assert all(len(base64.b64decode(*m["binaryData"].values())) <= upload.CHUNK_BYTES for m in maps)
    name, digest, *keys = args[0].split(":")
    assert (name, digest) == ("data.npz", hashlib.sha256(data).hexdigest())
    assert keys == [next(iter(m["binaryData"])) for m in maps]
    pod = upload.writer_pod("j", "data", "ns", {"image": "img:1"}, maps, args)
    (parts_vol, claim_vol) = pod["spec"]["volumes"]
    assert [s["configMap"]["name"] for s in parts_vol["projected"]["sources"]] == [
        m["metadata"]["name"] for m in maps
    ]
    assert claim_vol["persistentVolumeClaim"] == {"claimName": "j-data"}


def test_inputs_beyond_the_upload_bound_are_refused_naming_the_sizes():
    assert upload.too_big({"data.npz": upload.MAX_UPLOAD_BYTES}) is None
    why = upload.too_big({"model.keras": 10, "data.npz": upload.MAX_UPLOAD_BYTES})
    assert why is not None and "data.npz 64,000,000" in why and "64,000,010 bytes" in why
