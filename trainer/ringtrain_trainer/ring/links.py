"""The data path's connections: a listener that admits only authenticated ring peers, and the
connect (with backoff) to the right neighbour.

Pipeline position: :class:`.tcp.TcpTransport` (and ``shm``'s same-host links) open their two
sockets here before any tensor moves. Every connection passes the mutual HMAC handshake of
``ring.auth`` (and, with ``encryptData``, TLS) first; at most :data:`MAX_HANDSHAKES` handshakes
run at once, so a flood of strangers cannot starve the ring's own peers.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time

from ringtrain.cluster import split_address
from ringtrain.errors import RESOURCE_ERRNOS, PeerTimeout, RingError, Unauthenticated
from ringtrain_trainer.ring import auth, tls
from ringtrain_trainer.ring.transport import LinkError

#: How long a connecting stranger may take to complete the handshake.
HANDSHAKE_TIMEOUT_S = 5.0


#: Handshakes a listener runs at once (one thread and one descriptor each); a connection beyond
#: them is closed as it is accepted and counted refused. Only the left neighbour's is wanted:
#: 1,500 idle connections otherwise held 1,500 threads and descriptors for the handshake's 5 s
#: (issue 20). A neighbour refused meanwhile retries (``connect_with_backoff``).
MAX_HANDSHAKES = 16


def _tune(sock: socket.socket) -> None:
    """No Nagle delay for the small header and tail chunks. Buffer sizes stay with the
    kernel's autotuning: fixing SO_SNDBUF/SO_RCVBUF (4 MiB) measured 10-20 % slower here."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Listener:
    """Accepts connections on this rank's ring port and keeps the one from the left neighbour.

    Runs for the whole life of the ring so that late strangers are refused too (and counted in
    ``refused``, which tests read). ``key`` is this listener's own, fresh side-channel key: the
    control plane hands it to the left neighbour (``ControlPlane.data_key``); a new listener
    (a restarted worker, the next rendezvous) has a new one, so no old handshake or key opens it.
    """

    def __init__(
        self,
        port: int,
        world: int,
        left_rank: int,
        host: str = "0.0.0.0",
        *,
        fallback: bool = False,
        material: tls.Material | None = None,
    ) -> None:
        self.key = auth.new_key()
        self._world, self._left_rank = world, left_rank
        self._tls = material
        self._ssl = tls.ssl_context(material, server_side=True) if material else None
        self._lock = threading.Lock()
        self._left: socket.socket | None = None
        self._claimed = False
        self._ready = threading.Event()
        self._closed = False
        self.refused = 0
        self._handshakes = threading.BoundedSemaphore(MAX_HANDSHAKES)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            try:
                self._sock.bind((host, port))
            except OSError:
                if not fallback:
                    raise
                self._sock.bind((host, 0))
        except OSError as e:
            self._sock.close()
            raise LinkError(f"cannot listen on {host}:{port}: {e}") from None
        self.port = self._sock.getsockname()[1]
        self._sock.listen(512)  # a short queue drops the neighbour's SYN among a flood
        self._thread = threading.Thread(target=self._accept_loop, name="ring-listener", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError as e:
                if self._closed or e.errno not in RESOURCE_ERRNOS:
                    return  # closed
                time.sleep(0.05)  # out of descriptors: the left neighbour retries meanwhile
                continue
            if not self._handshakes.acquire(blocking=False):
                conn.close()
                with self._lock:
                    self.refused += 1
                continue
            threading.Thread(
                target=self._handshake_one, args=(conn,), name="ring-handshake", daemon=True
            ).start()

    def _handshake_one(self, conn: socket.socket) -> None:
        try:
            self._handshake(conn)
        finally:
            self._handshakes.release()

    def _accept_rank(self, rank: int) -> int:
        with self._lock:
            if rank != self._left_rank:
                return auth.REFUSED_RANK
            if self._claimed or self._closed:
                return auth.REFUSED_BUSY
            self._claimed = True
            return auth.OK

    def _handshake(self, conn: socket.socket) -> None:
        granted = []

        def accept(rank: int) -> int:
            verdict = self._accept_rank(rank)
            if verdict == auth.OK:
                granted.append(rank)
            return verdict

        try:
            conn.settimeout(HANDSHAKE_TIMEOUT_S)
            if self._ssl is not None:
                assert self._tls is not None  # the SSL context is made from it
                conn = self._ssl.wrap_socket(conn, server_side=True)
                if not tls.ssl_peer_ok(conn, self._tls):
                    raise ConnectionError("certificate of another job")
            verdict, _ = auth.server_handshake(conn, self.key, self._world, accept)
        except (OSError, ConnectionError):
            verdict = auth.REFUSED_TOKEN
        if verdict != auth.OK:
            with self._lock:
                self.refused += 1
                if granted:  # the left neighbour vanished mid-handshake: let it retry
                    self._claimed = False
            conn.close()
            return
        _tune(conn)
        with self._lock:
            self._left = conn
        self._ready.set()

    def wake(self) -> None:
        """End :meth:`wait_left` now (the ring broke while it formed)."""
        self._ready.set()

    def wait_left(self, timeout_s: float) -> socket.socket | None:
        self._ready.wait(timeout_s)
        with self._lock:
            return self._left

    def close(self) -> None:
        with self._lock:
            self._closed = True
        with contextlib.suppress(OSError):  # the shutdown wakes accept() on Linux
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5)


def connect_with_backoff(
    address: str,
    key: bytes,
    rank: int,
    world: int,
    timeout_s: float,
    material: tls.Material | None = None,
) -> socket.socket:
    """Connect and authenticate with the peer's side-channel ``key`` (from its ``Register``
    answer) to ``address``, retrying while the peer is not up yet (refused connection,
    unresolvable name: a pod whose DNS record is not published yet) until ``timeout_s``; then
    PeerTimeout naming the peer and the last error. With ``material`` the socket is wrapped in
    mutual TLS first; a TLS failure is Unauthenticated, not retried. A refused key is a
    RingError (retryable): the key came from the peer itself, so the peer restarted since."""
    host, port = split_address(address)
    ctx = tls.ssl_context(material, server_side=False) if material else None
    deadline = time.monotonic() + timeout_s
    delay, last = 0.02, "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        sock = None
        try:
            sock = socket.create_connection((host, port), timeout=max(0.1, min(remaining, 5.0)))
            sock.settimeout(max(0.1, min(remaining, HANDSHAKE_TIMEOUT_S)))
            if ctx is not None:
                assert material is not None  # ctx is made from it
                sock = ctx.wrap_socket(sock, server_hostname=material.server_name)
                if not tls.ssl_peer_ok(sock, material):
                    raise Unauthenticated(f"{address} holds another job's certificate", rank=rank)
            auth.client_handshake(sock, key, rank, world, address)
            _tune(sock)
            return sock
        except auth.KeyRefused as e:
            assert sock is not None  # refused by the handshake, after the connect
            sock.close()
            raise RingError(
                f"{address} refused the side-channel key it gave at the rendezvous "
                f"(it restarted since?): {e.reason}",
                rank=rank,
                step=-1,
                peer=address,
            ) from None
        except Unauthenticated:
            if sock is not None:
                sock.close()
            raise
        except ssl.SSLError as e:
            if sock is not None:
                sock.close()
            raise Unauthenticated(
                f"{address}: TLS failed ({e.reason or e}; do all workers "
                "use --ring-encrypt-data and the job's certificate?)",
                rank=rank,
            ) from None
        except (OSError, ConnectionError) as e:
            if sock is not None:
                sock.close()
            last = f"{type(e).__name__}: {e}"
        if time.monotonic() + delay > deadline:
            raise PeerTimeout(
                f"not reachable within {timeout_s:g} s (last error: {last})",
                rank=rank,
                step=-1,
                peer=address,
            )
        time.sleep(delay)  # backoff between connection attempts
        delay = min(delay * 2, 1.0)
