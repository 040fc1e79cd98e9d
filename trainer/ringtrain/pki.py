"""Per-job PKI: one CA per TrainingJob and one certificate every replica of the job presents.

The contract between the operator (and ``ringtrain run``), which create the material once per job
into the job's Secret, and the workers, which load it (``ringtrain_trainer.ring.tls``) and speak
mutual TLS on every gRPC channel of the ring. It imports neither side.

Choices, and why:

* **Keys**: ECDSA on NIST P-256 for both the CA and the job certificate, signed with SHA-256.
  BoringSSL (gRPC) and OpenSSL (Python's ``ssl``, the optional encrypted TCP data path) both
  handle it natively, it is ~100x faster to generate than RSA-2048 (about 1 ms here, so the
  operator's reconcile is never slowed), and its signatures are small.
* **One shared leaf per job**, not one per replica: the Secret is per job and mounted in every
  Pod, so per-replica keys would all sit side by side anyway and buy nothing. A single leaf with
  ``serverAuth`` and ``clientAuth`` serves as both ends of every channel.
* **Names** (subjectAltName): ``*.<svc>.<ns>.svc`` and ``*.<svc>.<ns>.svc.cluster.local`` (every
  replica's stable DNS name under the headless Service), ``<svc>.<ns>.svc`` (the Service itself:
  :func:`server_name`, the name channels verify, see ``ring/tls.py``), ``localhost``,
  127.0.0.1 and ::1 (``ringtrain run``), and the URI
  ``spiffe://ringtrain.io/ns/<ns>/trainingjob/<name>/<uid>``: the job's identity, which servers
  compare after the handshake (:func:`identity`). Another job's certificate already fails the
  handshake (another CA); the identity check also refuses a certificate of the same CA issued
  for another job, should a CA ever be shared.
* **Validity**: both certificates from 5 minutes before creation (clock skew between nodes) to
  :data:`VALIDITY_DAYS` days after. There is no rotation: a job that outlives its certificate
  needs a new Secret (delete it; the operator creates a fresh one with the next gang).
* The CA's key is thrown away once the leaf is signed: nothing can issue another certificate for
  the job, and the Secret never holds a signing key.
"""

from __future__ import annotations

import datetime
import ipaddress
import uuid
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ringtrain.errors import InvalidSpec

#: Secret keys and file names (the layout of a ``kubernetes.io/tls`` Secret plus the CA).
CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
FILES = (CA_FILE, CERT_FILE, KEY_FILE)
VALIDITY_DAYS = 365
CLOCK_SKEW = datetime.timedelta(minutes=5)
CURVE = ec.SECP256R1
URI_PREFIX = "spiffe://ringtrain.io/"


@dataclass(frozen=True)
class JobMaterial:
    """A job's trust anchor and its one certificate, all PEM."""

    ca_cert: bytes
    cert: bytes
    key: bytes  # PKCS#8, unencrypted: the Secret's file mode is its protection

    def files(self) -> dict[str, bytes]:
        """File name → content, as the Secret holds them."""
        return {CA_FILE: self.ca_cert, CERT_FILE: self.cert, KEY_FILE: self.key}

    def __repr__(self) -> str:  # never print the key by accident
        return "JobMaterial(<redacted>)"


def server_name(service: str, namespace: str) -> str:
    """The DNS name every channel of the job verifies its peer against (a SAN of the leaf)."""
    return f"{service}.{namespace}.svc"


def identity_uri(name: str, namespace: str, uid: str) -> str:
    return f"{URI_PREFIX}ns/{namespace}/trainingjob/{name}/{uid}"


def _name(common_name: str, namespace: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "ringtrain"),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, namespace[:64]),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name[:64]),
        ]
    )


def create(
    name: str,
    namespace: str,
    service: str,
    uid: str | None = None,
    *,
    now: datetime.datetime | None = None,
    validity_days: int = VALIDITY_DAYS,
) -> JobMaterial:
    """A fresh CA and job certificate for TrainingJob ``namespace/name`` behind ``service``.

    ``uid`` is the TrainingJob's metadata.uid; without one (a job never submitted to an API
    server: ``ringtrain run``) a random one makes the identity unique all the same.
    """
    now = now or datetime.datetime.now(datetime.UTC)
    start, end = now - CLOCK_SKEW, now + datetime.timedelta(days=validity_days)
    uid = uid or str(uuid.uuid4())
    ca_key = ec.generate_private_key(CURVE())
    ca_name = _name(f"{name} CA", namespace)
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(CURVE())
    sans = [
        x509.DNSName(server_name(service, namespace)),
        x509.DNSName(f"*.{service}.{namespace}.svc"),
        x509.DNSName(f"*.{service}.{namespace}.svc.cluster.local"),
        x509.DNSName(f"{service}.{namespace}.svc.cluster.local"),
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
        x509.UniformResourceIdentifier(identity_uri(name, namespace, uid)),
    ]
    leaf = (
        x509.CertificateBuilder()
        .subject_name(_name(name, namespace))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    return JobMaterial(
        ca_cert=ca.public_bytes(pem),
        cert=leaf.public_bytes(pem),
        key=key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )


def _sans(cert_pem: bytes) -> x509.SubjectAlternativeName:
    cert = x509.load_pem_x509_certificate(cert_pem)
    return cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value


def identity(cert_pem: bytes) -> str | None:
    """The job identity URI of a certificate (None if it has none)."""
    uris = [
        u
        for u in _sans(cert_pem).get_values_for_type(x509.UniformResourceIdentifier)
        if u.startswith(URI_PREFIX)
    ]
    return uris[0] if uris else None


def verify_name(cert_pem: bytes) -> str:
    """The name channels verify the server against: the first DNS SAN without a wildcard."""
    for name in _sans(cert_pem).get_values_for_type(x509.DNSName):
        if not name.startswith("*"):
            return name
    return "localhost"


def load(directory: str | Path) -> JobMaterial:
    """Read a job's material from the files of :data:`FILES` in ``directory`` (a mounted
    Secret); :class:`InvalidSpec` names the file that is missing, unreadable or malformed."""
    d = Path(directory)
    data = {}
    for name in FILES:
        try:
            data[name] = (d / name).read_bytes()
        except OSError as e:
            raise InvalidSpec(f"ring TLS: cannot read {d / name}: {e.strerror or e}") from None
        if b"-----BEGIN " not in data[name]:
            raise InvalidSpec(f"ring TLS: {d / name} is not PEM")
    try:
        identity(data[CERT_FILE])
        x509.load_pem_x509_certificate(data[CA_FILE])
    except (ValueError, x509.ExtensionNotFound) as e:
        raise InvalidSpec(f"ring TLS: {d}: not a ringtrain job certificate ({e})") from None
    return JobMaterial(data[CA_FILE], data[CERT_FILE], data[KEY_FILE])
