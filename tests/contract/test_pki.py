"""ringtrain.pki: the per-job CA and certificate, and loading them back with clear errors."""

from __future__ import annotations

import datetime

import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec

from ringtrain import pki
from ringtrain.errors import InvalidSpec


def test_one_p256_leaf_for_both_ends_signed_by_the_jobs_own_ca():
    now = datetime.datetime(2025, 1, 1, tzinfo=datetime.UTC)
    m = pki.create("mnist", "team-a", "mnist", "uid-1", now=now)
    ca = x509.load_pem_x509_certificate(m.ca_cert)
    leaf = x509.load_pem_x509_certificate(m.cert)
    leaf.verify_directly_issued_by(ca)
    assert isinstance(leaf.public_key().curve, ec.SECP256R1)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    eku = leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert set(eku) == {
        x509.oid.ExtendedKeyUsageOID.SERVER_AUTH,
        x509.oid.ExtendedKeyUsageOID.CLIENT_AUTH,
    }
    assert leaf.not_valid_after_utc - now == datetime.timedelta(days=pki.VALIDITY_DAYS)
    assert now - leaf.not_valid_before_utc == pki.CLOCK_SKEW
    assert pki.verify_name(m.cert) == "mnist.team-a.svc"
    assert pki.identity(m.cert) == "spiffe://ringtrain.io/ns/team-a/trainingjob/mnist/uid-1"
    assert "PRIVATE" not in repr(m)


def test_every_job_gets_its_own_ca_and_identity():
    a, b = pki.create("j", "ns", "j"), pki.create("j", "ns", "j")
    assert a.ca_cert != b.ca_cert and pki.identity(a.cert) != pki.identity(b.cert)
    with pytest.raises(InvalidSignature):  # same CA name, another key
        x509.load_pem_x509_certificate(a.cert).verify_directly_issued_by(
            x509.load_pem_x509_certificate(b.ca_cert)
        )


def test_load_round_trips_and_names_the_missing_or_bad_file(tmp_path):
    m = pki.create("j", "ns", "j")
    for name, content in m.files().items():
        (tmp_path / name).write_bytes(content)
    assert pki.load(tmp_path) == m
    (tmp_path / "tls.key").unlink()
    with pytest.raises(InvalidSpec, match=r"cannot read .*/tls\.key"):
        pki.load(tmp_path)
    (tmp_path / "tls.key").write_bytes(m.key)
    (tmp_path / "ca.crt").write_text("not a certificate")
    with pytest.raises(InvalidSpec, match=r"ca\.crt is not PEM"):
        pki.load(tmp_path)
