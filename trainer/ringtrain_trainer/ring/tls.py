"""Mutual TLS for the ring's gRPC channels (and, with ``--ring-encrypt-data``, its TCP sockets).

The material is the job's (``ringtrain.pki``): ``ca.crt``, ``tls.crt``, ``tls.key`` in the
directory the Pod mounts from the job's Secret (``RINGTRAIN_TLS_DIR``). Every gRPC server of the
ring requires a client certificate signed by the job's CA (``require_client_auth``), and every
channel verifies the server's certificate against that CA; a peer without one, with another
job's, or speaking anything but TLS is dropped in the handshake, before any handler runs.

Channels verify the server's name as :func:`ringtrain.pki.verify_name` (``<svc>.<ns>.svc``, a
SAN of the one shared job certificate) through ``grpc.ssl_target_name_override``, whatever the
address in TF_CONFIG says (a pod name, a loopback IP, a custom cluster domain): every replica
holds the same certificate, so the CA and the job identity are what authenticate a peer, and
the target's spelling must not make the handshake fail. Servers additionally compare the
peer's job identity (the URI SAN) with their own after the handshake (:func:`peer_ok`).

Without material (``ringtrain worker`` started by hand with only ``RINGTRAIN_TOKEN``) the ring
runs as before TLS existed: insecure channels, the token in call metadata (and the side
channel's per-rendezvous key in ``Register`` answers), and one plain log line saying so. With
material, the token still travels in every call, inside TLS.

:func:`serve` and :func:`channel` are the only ways the ring opens a gRPC port or channel, so a
transport switches between the two modes in one argument.
"""

from __future__ import annotations

import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from ringtrain import pki

#: Where TLS is off, the one line the worker logs.
INSECURE_NOTE = (
    "ring TLS is off (no RINGTRAIN_TLS_DIR or --ring-tls-dir): gRPC calls are "
    "unencrypted and carry the ring token, and the grpc+tcp side channel's "
    "per-rendezvous key, in cleartext"
)


@dataclass(frozen=True)
class Material:
    """A job's CA, certificate and key (PEM) and what is derived from them once."""

    ca_cert: bytes
    cert: bytes
    key: bytes
    identity: str | None  # the job identity URI of ``cert``
    server_name: str  # the name channels verify

    @classmethod
    def of(cls, m: pki.JobMaterial) -> Material:
        return cls(m.ca_cert, m.cert, m.key, pki.identity(m.cert), pki.verify_name(m.cert))

    def __repr__(self) -> str:
        return f"tls.Material(identity={self.identity!r})"


def load(directory: str | Path) -> Material:
    """The material in ``directory`` (:func:`ringtrain.pki.load`: errors name the file)."""
    return Material.of(pki.load(directory))


def server_credentials(m: Material) -> grpc.ServerCredentials:
    """Mutual TLS: clients must present a certificate signed by the job's CA."""
    return grpc.ssl_server_credentials(
        [(m.key, m.cert)], root_certificates=m.ca_cert, require_client_auth=True
    )


def channel_credentials(m: Material) -> grpc.ChannelCredentials:
    """Verify the server against the job's CA and present the job certificate."""
    return grpc.ssl_channel_credentials(
        root_certificates=m.ca_cert, private_key=m.key, certificate_chain=m.cert
    )


def channel_options(m: Material | None) -> list[tuple[str, str]]:
    """The name override of the module docstring (none without TLS)."""
    return [] if m is None else [("grpc.ssl_target_name_override", m.server_name)]


def channel(
    target: str, m: Material | None, options: Sequence[tuple[str, object]] = ()
) -> grpc.Channel:
    """A channel to ``target``: mutual TLS with ``m``, insecure without."""
    if m is None:
        return grpc.insecure_channel(target, options=list(options))
    return grpc.secure_channel(
        target, channel_credentials(m), options=[*options, *channel_options(m)]
    )


def serve(server: grpc.Server, address: str, m: Material | None) -> int:
    """Open ``address`` on ``server`` (mutual TLS with ``m``, insecure without); the bound port,
    0 when it cannot be bound."""
    try:
        if m is None:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, server_credentials(m))
    except RuntimeError:  # newer grpcio raises where older ones returned 0
        return 0


def peer_ok(context: grpc.ServicerContext, m: Material | None) -> bool:
    """After the handshake: does the caller hold a certificate of *this* job? Always true
    without TLS (the token is then the only check)."""
    if m is None or m.identity is None:
        return True
    sans = context.auth_context().get("x509_subject_alternative_name", ())
    return m.identity.encode() in sans


def ssl_context(m: Material, *, server_side: bool) -> ssl.SSLContext:
    """Python ``ssl`` with the same mutual TLS, for the raw TCP data path (``encryptData``)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_verify_locations(cadata=m.ca_cert.decode())
    ctx.verify_mode = ssl.CERT_REQUIRED
    # ssl can only load a key pair from files: a private temporary file, gone at once.
    with tempfile.NamedTemporaryFile("wb", prefix="ringtrain-tls-") as f:
        f.write(m.cert + m.key)
        f.flush()
        ctx.load_cert_chain(f.name)
    return ctx


def ssl_peer_ok(sock: ssl.SSLSocket, m: Material) -> bool:
    """:func:`peer_ok` for a Python ``ssl`` socket whose handshake is done."""
    if m.identity is None:
        return True
    sans = (sock.getpeercert() or {}).get("subjectAltName", ())
    return ("URI", m.identity) in sans
