"""Authentication of ring peers: the job's token on gRPC, a per-rendezvous key on TCP.

gRPC calls carry the job's token as metadata (``ringtrain-token-bin``) and the server compares
it in constant time. The raw TCP side channel (``grpc+tcp``) never sees that token: its key is
32 random bytes that each side-channel listener makes when it starts and hands, in its
``Register`` answer, to the one peer that may connect to it (``ring.control``), i.e. over the
mutual-TLS control channel. The handshake is a mutual HMAC-SHA256 challenge-response with that
key over fresh nonces (the server proves the key as well, so a worker cannot be tricked into
streaming gradients to an impostor). A recorded handshake fails on the nonces; a key learnt at
an earlier rendezvous, or the job's long-lived token, fails on the key, because every listener
(every process, every rendezvous) has its own. A connection that fails the handshake is closed
before it can touch any ring state.

Why the listener owns the key and its ``Register`` answer carries it: only its left neighbour
ever connects to it, so there is no extra call, no chief to wait for, nothing shared by more
than two ranks; the answer goes only to a caller that passed mutual TLS and the token, and the
key dies with the listener. Without the job's TLS material the control channel, the key
included, is plaintext (the worker says so: ``tls.INSECURE_NOTE``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
from collections.abc import Callable, Container
from typing import Any

import grpc

from ringtrain.errors import Unauthenticated
from ringtrain_trainer.ring import tls
from ringtrain_trainer.ring.protocol import OpHeader

#: gRPC metadata key of the token (``-bin``: raw bytes, base64 on the wire by gRPC itself).
TOKEN_METADATA_KEY = "ringtrain-token-bin"
#: the caller's rank and ring size, and a tensor call's operation header, beside the token
RANK_KEY, WORLD_KEY, OP_KEY = "ringtrain-rank", "ringtrain-world", "ringtrain-op-bin"


def call_metadata(
    token: bytes, rank: int, world: int, header: OpHeader | None = None
) -> tuple[tuple[str, str | bytes], ...]:
    """What every gRPC call of the ring carries, control and tensors alike (tests use it to
    forge calls)."""
    md: list[tuple[str, str | bytes]] = [
        (TOKEN_METADATA_KEY, token),
        (RANK_KEY, str(rank)),
        (WORLD_KEY, str(world)),
    ]
    if header is not None:
        md.append((OP_KEY, header.pack()))
    return tuple(md)


_HELLO = b"RTRH\x01"
_NONCE = 16
_CLIENT = struct.Struct("!II")  # claimed rank, world size
_MAC = 32

#: Bytes of a side-channel key (one per listener, i.e. per rendezvous).
KEY_BYTES = 32

#: Verdict bytes the TCP server sends back (``REFUSED_TOKEN``: the HMAC did not match the key).
OK, REFUSED_TOKEN, REFUSED_WORLD, REFUSED_RANK, REFUSED_BUSY = 0, 1, 2, 3, 4
VERDICTS = {
    REFUSED_TOKEN: "wrong token",
    REFUSED_WORLD: "different ring size",
    REFUSED_RANK: "not this rank's left neighbour",
    REFUSED_BUSY: "left neighbour already connected",
}


class KeyRefused(Unauthenticated):
    """A side channel refused the key; ``connect`` raises a retryable RingError instead.

    The key came from the peer's own ``Register`` answer, so the peer refuses it only when it
    restarted since (a new listener, a new key): the gang restarts, the job does not fail."""


def refusal(
    context: grpc.ServicerContext,
    material: tls.Material | None,
    token: bytes,
    world: int,
    allowed: Container[str],
    role: str,
) -> tuple[dict[str, Any], tuple[grpc.StatusCode, str] | None]:
    """Every ring gRPC call's gate, in order: the job's certificate, the token, the ring size,
    then the caller's rank among ``allowed`` (``role`` says which ranks those are). The call's
    metadata and why it is refused (None: let in); the caller aborts with it and counts it."""
    # values are bytes under "-bin" keys and str elsewhere, which the stubs cannot express
    md: dict[str, Any] = dict(context.invocation_metadata())
    if not tls.peer_ok(context, material):
        return md, (grpc.StatusCode.UNAUTHENTICATED, "caller's certificate names another job")
    if not token_ok(md.get(TOKEN_METADATA_KEY), token):
        return md, (grpc.StatusCode.UNAUTHENTICATED, "missing or wrong ring token")
    if md.get(WORLD_KEY) != str(world):
        why = f"caller's ring size {md.get(WORLD_KEY)} is not {world}"
        return md, (grpc.StatusCode.INVALID_ARGUMENT, why)
    if md.get(RANK_KEY) not in allowed:
        why = f"caller rank {md.get(RANK_KEY)} is not {role}"
        return md, (grpc.StatusCode.PERMISSION_DENIED, why)
    return md, None


#: the one service a caller without the token may call (probes carry none)
HEALTH_PREFIX = "/grpc.health.v1.Health/"


class TokenGate(grpc.ServerInterceptor):
    """Every call but Health's carries the job's token, checked on its metadata *before* its
    message is read. A handler checks the token only once gRPC has read the whole request (up
    to ``channels.MAX_MESSAGE_BYTES``), so 150 concurrent unauthenticated 16 MiB calls raised a
    worker from 155 to 890 MB (issue 35); refused here, a call's message is never read, and
    ``on_refused`` counts it with the handlers' refusals."""

    def __init__(self, token: bytes, rank: int, on_refused: Callable[[], None]) -> None:
        self._token, self._on_refused = token, on_refused
        text = f"rank {rank}: missing or wrong ring token"

        def refuse(requests: Any, context: grpc.ServicerContext) -> bytes:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, text)

        #: a streaming handler whatever the method: it aborts without reading the request
        self._refuse = grpc.stream_unary_rpc_method_handler(refuse)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if handler_call_details.method.startswith(HEALTH_PREFIX):
            return continuation(handler_call_details)
        md: dict[str, Any] = dict(handler_call_details.invocation_metadata)
        if token_ok(md.get(TOKEN_METADATA_KEY), self._token):
            return continuation(handler_call_details)
        self._on_refused()
        return self._refuse


def new_key() -> bytes:
    """A fresh side-channel key."""
    return os.urandom(KEY_BYTES)


def token_ok(presented: bytes | None, token: bytes) -> bool:
    """Constant-time comparison; a missing token never matches."""
    return presented is not None and hmac.compare_digest(presented, token)


def _mac(key: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, role + b"".join(parts), hashlib.sha256).digest()


class PeerClosed(ConnectionError):
    """The peer closed the connection before a whole message arrived."""


def recv_into_exactly(sock: socket.socket, view: memoryview, closed: str) -> None:
    """Fill ``view`` from ``sock``, however the bytes arrive; EOF before it is full raises
    :class:`PeerClosed` (``closed``). The one read loop of the ring's sockets: handshakes here, the
    data path's whole messages in ``tcp`` and ``shm``."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise PeerClosed(closed)
        got += k


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes (small handshake messages only); EOF raises ConnectionError."""
    buf = bytearray(n)
    recv_into_exactly(sock, memoryview(buf), "connection closed during handshake")
    return bytes(buf)


def server_handshake(sock: socket.socket, key: bytes, world: int, accept_rank) -> tuple[int, int]:
    """Authenticate an incoming connection with ``key``; returns (verdict, claimed rank).

    ``accept_rank(rank) -> verdict`` decides, once the peer proved the key, whether this rank
    may connect now. The verdict is sent back before the caller closes or keeps the socket.
    """
    nonce_s = os.urandom(_NONCE)
    sock.sendall(_HELLO + nonce_s)
    msg = recv_exact(sock, _CLIENT.size + _NONCE + _MAC)
    ident, nonce_c, mac = msg[: _CLIENT.size], msg[_CLIENT.size : -_MAC], msg[-_MAC:]
    rank, peer_world = _CLIENT.unpack(ident)
    if not hmac.compare_digest(mac, _mac(key, b"client", _HELLO, nonce_s, nonce_c, ident)):
        verdict = REFUSED_TOKEN
    elif peer_world != world:
        verdict = REFUSED_WORLD
    else:
        verdict = accept_rank(rank)
    proof = _mac(key, b"server", _HELLO, nonce_s, nonce_c, ident) if verdict == OK else b""
    sock.sendall(bytes([verdict]) + proof)
    return verdict, rank


def client_handshake(sock: socket.socket, key: bytes, rank: int, world: int, peer: str) -> None:
    """Prove ``key`` to the server and check its proof; raises Unauthenticated (KeyRefused for
    a refused key) or ConnectionError (worth retrying: the peer may still be starting)."""
    hello = recv_exact(sock, len(_HELLO) + _NONCE)
    if hello[: len(_HELLO)] != _HELLO:
        raise Unauthenticated(
            f"{peer} does not speak the ringtrain TCP protocol (do all "
            "workers use the same ring transport, tcp or grpc?)",
            rank=rank,
        )
    nonce_s, nonce_c = hello[len(_HELLO) :], os.urandom(_NONCE)
    ident = _CLIENT.pack(rank, world)
    sock.sendall(ident + nonce_c + _mac(key, b"client", _HELLO, nonce_s, nonce_c, ident))
    verdict = recv_exact(sock, 1)[0]
    if verdict != OK:
        text = VERDICTS.get(verdict, f"verdict {verdict}")
        if verdict == REFUSED_BUSY:
            raise ConnectionError(f"{peer} refused rank {rank}: {text}")
        if verdict == REFUSED_TOKEN:
            raise KeyRefused(f"{peer} refused the connection: {text}", rank=rank)
        raise Unauthenticated(f"{peer} refused the connection: {text}", rank=rank)
    proof = recv_exact(sock, _MAC)
    if not hmac.compare_digest(proof, _mac(key, b"server", _HELLO, nonce_s, nonce_c, ident)):
        raise Unauthenticated(f"{peer} could not prove the side-channel key", rank=rank)
