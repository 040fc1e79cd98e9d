"""Authentication of ring peers with the job's shared secret.

Two forms, one secret. gRPC calls carry the token as metadata (``ringtrain-token-bin``) and the
server compares it in constant time. The raw TCP data path never puts the token on the wire:
a mutual HMAC-SHA256 challenge-response over fresh nonces (server proves it knows the token as
well, so a worker cannot be tricked into streaming gradients to an impostor). A connection that
fails the handshake is closed before it can touch any ring state.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

from ringtrain.errors import Unauthenticated

#: gRPC metadata key of the token (``-bin``: raw bytes, base64 on the wire by gRPC itself).
TOKEN_METADATA_KEY = "ringtrain-token-bin"

_HELLO = b"RTRH\x01"
_NONCE = 16
_CLIENT = struct.Struct("!II")  # claimed rank, world size
_MAC = 32

#: Verdict bytes the TCP server sends back.
OK, REFUSED_TOKEN, REFUSED_WORLD, REFUSED_RANK, REFUSED_BUSY = 0, 1, 2, 3, 4
VERDICTS = {
    REFUSED_TOKEN: "wrong token",
    REFUSED_WORLD: "different ring size",
    REFUSED_RANK: "not this rank's left neighbour",
    REFUSED_BUSY: "left neighbour already connected",
}


def token_ok(presented: bytes | None, token: bytes) -> bool:
    """Constant-time comparison; a missing token never matches."""
    return presented is not None and hmac.compare_digest(presented, token)


def _mac(token: bytes, role: bytes, *parts: bytes) -> bytes:
    return hmac.new(token, role + b"".join(parts), hashlib.sha256).digest()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Read exactly ``n`` bytes (small handshake messages only); EOF raises ConnectionError."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("connection closed during handshake")
        got += k
    return bytes(buf)


def server_handshake(sock: socket.socket, token: bytes, world: int,
                     accept_rank) -> tuple[int, int]:
    """Authenticate an incoming connection; returns (verdict, claimed rank).

    ``accept_rank(rank) -> verdict`` decides, once the peer proved the token, whether this rank
    may connect now. The verdict is sent back before the caller closes or keeps the socket.
    """
    nonce_s = os.urandom(_NONCE)
    sock.sendall(_HELLO + nonce_s)
    msg = recv_exact(sock, _CLIENT.size + _NONCE + _MAC)
    ident, nonce_c, mac = msg[:_CLIENT.size], msg[_CLIENT.size:-_MAC], msg[-_MAC:]
    rank, peer_world = _CLIENT.unpack(ident)
    if not hmac.compare_digest(mac, _mac(token, b"client", _HELLO, nonce_s, nonce_c, ident)):
        verdict = REFUSED_TOKEN
    elif peer_world != world:
        verdict = REFUSED_WORLD
    else:
        verdict = accept_rank(rank)
    proof = _mac(token, b"server", _HELLO, nonce_s, nonce_c, ident) if verdict == OK else b""
    sock.sendall(bytes([verdict]) + proof)
    return verdict, rank


def client_handshake(sock: socket.socket, token: bytes, rank: int, world: int,
                     peer: str) -> None:
    """Prove the token to the server and check its proof; raises Unauthenticated or
    ConnectionError (the latter is worth retrying: the peer may still be starting)."""
    hello = recv_exact(sock, len(_HELLO) + _NONCE)
    if hello[:len(_HELLO)] != _HELLO:
        raise Unauthenticated(f"{peer} does not speak the ringtrain TCP protocol (do all "
                              "workers use the same ring transport, tcp or grpc?)", rank=rank)
    nonce_s, nonce_c = hello[len(_HELLO):], os.urandom(_NONCE)
    ident = _CLIENT.pack(rank, world)
    sock.sendall(ident + nonce_c + _mac(token, b"client", _HELLO, nonce_s, nonce_c, ident))
    verdict = recv_exact(sock, 1)[0]
    if verdict != OK:
        text = VERDICTS.get(verdict, f"verdict {verdict}")
        if verdict == REFUSED_BUSY:
            raise ConnectionError(f"{peer} refused rank {rank}: {text}")
        raise Unauthenticated(f"{peer} refused the connection: {text}", rank=rank)
    proof = recv_exact(sock, _MAC)
    if not hmac.compare_digest(proof, _mac(token, b"server", _HELLO, nonce_s, nonce_c, ident)):
        raise Unauthenticated(f"{peer} could not prove the ring token", rank=rank)
