"""Raw sockets against a server under test: send what a stranger would, read what comes back."""

from __future__ import annotations

import contextlib
import socket


def drain(s: socket.socket) -> bytes:
    """Everything until the server closes; a reset counts as closed (a socket timeout fails the
    test: the server must close)."""
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def send_and_drain(
    port: int, data: bytes, *, half_close: bool = False, timeout_s: float = 10
) -> bytes:
    """Connect to ``port`` on loopback, send ``data`` (shutting our side with ``half_close``),
    and return what the server answers until it closes. A server that closes before taking all
    of ``data`` is an answer too."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        with contextlib.suppress(OSError):
            s.sendall(data)
            if half_close:
                s.shutdown(socket.SHUT_WR)
        return drain(s)
