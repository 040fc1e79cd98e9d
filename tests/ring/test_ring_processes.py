"""Real ring members in separate processes on loopback, over both transports."""

import signal
import socket
import time

import grpc
import numpy as np
import pytest
import ring_procs
from support.ports import free_ports
from support.sockets import drain

from ringtrain.cluster import ClusterSpec, split_address
from ringtrain.errors import EXIT_RETRYABLE, PeerTimeout
from ringtrain_trainer.collective import LocalCollective
from ringtrain_trainer.ring import auth, connect
from ringtrain_trainer.ring.grpc_transport import call_metadata
from ringtrain_trainer.ring.protocol import Kind, OpHeader

TRANSPORTS = ["grpc+tcp", "grpc"]
#: what ring_worker runs: grpc+tcp with shared memory off, on (grpc+shm), and grpc
DATA_PATHS = ["grpc+tcp", "grpc+shm", "grpc"]
#: sizes the "pause" scenario reduces per step (ring_worker's default list)
STEP_SIZES = [0, 1, 2, 3, 5, 1000, 262147]


def test_one_worker_needs_no_ring():
    coll = connect(ClusterSpec.single(), b"")
    buf = np.arange(5, dtype=np.float32)
    coll.allreduce_mean_(buf)
    assert isinstance(coll, LocalCollective) and buf.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", DATA_PATHS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_allreduce_mean_and_broadcast_of_odd_sizes(world, transport):
    ring = ring_procs.start(world, "allreduce", transport)
    try:
        results = ring.finish()
    finally:
        ring.kill()
    for rank, (code, events) in enumerate(results):
        assert code == 0, f"rank {rank}: {events}"
        assert events[-1]["event"] == "done"


def wrong_token_joins(ring: ring_procs.Ring, transport: str) -> None:
    """connect() towards a live ring member with another job's secret: Unauthenticated (exit
    code 2, permanent) at once, not a retry until the connect timeout."""
    from ringtrain.errors import EXIT_PERMANENT, Unauthenticated

    spec = ClusterSpec(
        cluster={"worker": (f"127.0.0.1:{free_ports(1)[0]}", ring.addresses[0])}, task_index=0
    )
    t0 = time.monotonic()
    with pytest.raises(Unauthenticated, match=r"rank 0: 127\.0\.0\.1:") as e:
        connect(spec, b"another-jobs-token", transport=transport, connect_timeout_s=20)
    assert e.value.exit_code == EXIT_PERMANENT and time.monotonic() - t0 < 10


@pytest.mark.timeout(60)
def test_a_stranger_on_the_tcp_side_channel_is_refused_while_the_ring_keeps_working():
    ring = ring_procs.start(2, "pause", "tcp")  # the old name of grpc+tcp still works
    try:
        ready = [ring.event(r) for r in (0, 1)]
        assert [e["event"] for e in ready] == ["ready", "ready"]
        host, _ = split_address(ring.addresses[0])
        port = ready[0]["data_port"]  # the side channel, as rank 0 announced it over gRPC
        # 1: garbage instead of a handshake: one refusal byte, then closed
        with socket.create_connection((host, port), timeout=10) as s:
            assert s.recv(21).startswith(b"RTRH")
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n".ljust(56, b"-"))
            assert drain(s) == bytes([auth.REFUSED_TOKEN])
        # 2: a proper handshake with a guessed key, claiming to be the left neighbour
        with (
            socket.create_connection((host, port), timeout=10) as s,
            pytest.raises(auth.Unauthenticated, match="wrong token"),
        ):
            auth.client_handshake(s, b"not-the-token", 1, 2, "rank 0")
        # 3: the job's own token is not the side channel's key
        with (
            socket.create_connection((host, port), timeout=10) as s,
            pytest.raises(auth.KeyRefused, match="wrong token"),
        ):
            auth.client_handshake(s, ring.token, 1, 2, "rank 0")
        # 4: the key rank 0 gives its left neighbour at the rendezvous is accepted, but the
        # left neighbour is already connected
        answer = ring_procs.register(ring, 0, as_rank=1)
        assert answer["data_port"] == port and len(answer["data_key"]) == 2 * auth.KEY_BYTES
        with (
            socket.create_connection((host, port), timeout=10) as s,
            pytest.raises(ConnectionError, match="already connected"),
        ):
            auth.client_handshake(s, bytes.fromhex(answer["data_key"]), 1, 2, "rank 0")
        # 5: a worker of a job with another secret fails at once, permanently
        wrong_token_joins(ring, "tcp")
        ring.go(1)
        results = ring.finish()
    finally:
        ring.kill()
    assert [code for code, _ in results] == [0, 0], results
    assert results[0][1][-1] == {"event": "done", "rank": 0, "refused": 5}


@pytest.mark.timeout(60)
def test_grpc_calls_without_token_or_with_wrong_step_or_size_are_refused_state_untouched():
    ring = ring_procs.start(2, "pause", "grpc")
    try:
        assert [ring.event(r)["event"] for r in (0, 1)] == ["ready", "ready"]
        # rank 0 is now in its next allreduce (number len(STEP_SIZES), step 2, tag 0) waiting
        # for rank 1, which waits for our "go": every forged call lands in that window.
        seq, n0 = len(STEP_SIZES), STEP_SIZES[0]
        good = OpHeader(Kind.ALLREDUCE, seq, 2, 0, n0)
        with grpc.insecure_channel(ring.addresses[0]) as ch:
            push = ch.stream_unary("/ringtrain.Ring/Push")
            hello = ch.unary_unary("/ringtrain.Ring/Hello")

            def refused(metadata, messages=(b"\0" * 4,)):
                with pytest.raises(grpc.RpcError) as e:
                    push(iter(messages), metadata=metadata, timeout=15)
                return e.value.code()

            tok = ring.token
            assert refused(call_metadata(b"wrong", 1, 2, good)) == grpc.StatusCode.UNAUTHENTICATED
            assert refused(call_metadata(tok, 1, 2, good)[1:]) == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as e:
                hello(b"", metadata=call_metadata(b"wrong", 1, 2), timeout=15)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert refused(call_metadata(tok, 0, 2, good)) == grpc.StatusCode.PERMISSION_DENIED
            wrong_step = OpHeader(Kind.ALLREDUCE, seq, 3, 0, n0)
            assert (
                refused(call_metadata(tok, 1, 2, wrong_step)) == grpc.StatusCode.FAILED_PRECONDITION
            )
            stale = OpHeader(Kind.ALLREDUCE, 0, 1, 0, n0)
            assert refused(call_metadata(tok, 1, 2, stale)) == grpc.StatusCode.FAILED_PRECONDITION
            wrong_size = OpHeader(Kind.ALLREDUCE, seq, 2, 0, n0 + 1)
            assert refused(call_metadata(tok, 1, 2, wrong_size)) == grpc.StatusCode.INVALID_ARGUMENT
        wrong_token_joins(ring, "grpc")
        ring.go(1)
        results = ring.finish()
    finally:
        ring.kill()
    assert [code for code, _ in results] == [0, 0], results
    assert results[0][1][-1] == {"event": "done", "rank": 0, "refused": 8}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", DATA_PATHS)
def test_a_peer_killed_mid_allreduce_fails_the_others_with_the_retryable_code(transport):
    step_timeout_s = 5.0
    ring = ring_procs.start(
        3,
        "loop",
        transport,
        "--sizes",
        "3000000",
        "--chunk-bytes",
        "65536",
        "--step-timeout-s",
        str(step_timeout_s),
    )
    try:
        assert [ring.event(r)["event"] for r in range(3)] == ["started"] * 3
        killed_at = time.monotonic()
        ring.procs[2].send_signal(signal.SIGKILL)
        results = ring.finish(timeout_s=step_timeout_s * 3)
        elapsed = time.monotonic() - killed_at
    finally:
        ring.kill()
    assert results[2][0] == -signal.SIGKILL
    for rank in (0, 1):
        code, events = results[rank]
        assert code == EXIT_RETRYABLE, events
        err = events[-1]
        assert err["event"] == "error" and err["type"] in ("RingError", "PeerTimeout")
        assert (
            err["message"].startswith(f"rank {rank} step ") and " peer 127.0.0.1:" in err["message"]
        )
    assert elapsed < step_timeout_s  # detected from the broken connections, not the timeout


@pytest.mark.timeout(30)
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_peer_that_never_comes_up_times_out_at_connect(transport):

    addrs = tuple(f"127.0.0.1:{p}" for p in free_ports(2))
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout, match=f"rank 0 step -1 peer {addrs[1]}") as e:
        connect(
            ClusterSpec(cluster={"worker": addrs}, task_index=0),
            b"t",
            connect_timeout_s=1.0,
            transport=transport,
        )
    assert e.value.exit_code == EXIT_RETRYABLE
    assert time.monotonic() - t0 < 5


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_taken_ring_port_is_a_retryable_ring_error(transport):
    from ringtrain.errors import RingError

    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen(1)
        addrs = (f"127.0.0.1:{s.getsockname()[1]}", "127.0.0.1:1")
        with pytest.raises(RingError, match=f"rank 0 step -1 peer {addrs[0]}: cannot listen"):
            connect(
                ClusterSpec(cluster={"worker": addrs}, task_index=0),
                b"t",
                connect_timeout_s=1.0,
                transport=transport,
            )


def test_bad_arguments_are_refused_before_any_socket():
    from ringtrain.errors import InvalidSpec

    spec = ClusterSpec(cluster={"worker": ("127.0.0.1:1", "127.0.0.1:2")}, task_index=0)
    with pytest.raises(InvalidSpec, match="ring token is empty"):
        connect(spec, b"")
    with pytest.raises(InvalidSpec, match="ring transport 'udp'"):
        connect(spec, b"t", transport="udp")


@pytest.mark.timeout(30)
def test_misuse_fails_loudly_and_leaves_the_ring_usable():
    """Two ranks in threads of this process (real sockets): wrong buffers are refused with a
    clear error before any byte moves, and the ring keeps working afterwards."""
    import threading

    addrs = tuple(f"127.0.0.1:{p}" for p in free_ports(2))
    colls = [None, None]

    def join(rank):
        colls[rank] = connect(
            ClusterSpec(cluster={"worker": addrs}, task_index=rank), b"t", connect_timeout_s=10
        )

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        c0 = colls[0]
        with pytest.raises(
            TypeError, match="allreduce_mean_: needs a float32 or float16 numpy array"
        ):
            c0.allreduce_mean_(np.zeros(4))
        with pytest.raises(ValueError, match="C-contiguous"):
            c0.allreduce_mean_(np.zeros(8, np.float32)[::2])
        with pytest.raises(ValueError, match="root 2 outside ring of size 2"):
            c0.broadcast_(np.zeros(4, np.float32), root=2)
        bufs = [np.full((3, 5), 1.0, np.float32), np.full((3, 5), 4.0, np.float32)]
        t = threading.Thread(target=colls[1].allreduce_mean_, args=(bufs[1],))
        t.start()
        c0.allreduce_mean_(bufs[0])
        t.join()
        assert (bufs[0] == 2.5).all() and (bufs[1] == 2.5).all()
    finally:
        for c in colls:
            c.close()


@pytest.mark.timeout(30)
def test_close_from_another_thread_ends_a_blocked_allreduce_at_once():
    """The worker's SIGTERM path: closing the ring must not wait for the step timeout."""
    import threading

    from ringtrain.errors import RingError

    addrs = tuple(f"127.0.0.1:{p}" for p in free_ports(2))
    colls = [None, None]

    def join(rank):
        colls[rank] = connect(
            ClusterSpec(cluster={"worker": addrs}, task_index=rank),
            b"t",
            connect_timeout_s=10,
            step_timeout_s=60,
        )

    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    errors = []

    def blocked():  # rank 1 never joins this allreduce
        try:
            colls[0].allreduce_mean_(np.ones(10, np.float32), step=5)
        except RingError as e:
            errors.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    t0 = time.monotonic()
    colls[0].close()
    t.join(timeout=20)
    colls[1].close()
    assert not t.is_alive() and time.monotonic() - t0 < 10
    assert len(errors) == 1 and errors[0].rank == 0 and errors[0].step == 5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport,ops", [("tcp", 1000), ("grpc+shm", 1000), ("grpc", 400)])
def test_peak_memory_stays_flat_over_many_allreduces(transport, ops):
    """Peak RSS after warm-up (100 collectives) must not grow with more collectives; gRPC runs
    fewer because each of its collectives costs milliseconds of call set-up."""
    ring = ring_procs.start(
        2, "rss", transport, "--sizes", "262144", "--chunk-bytes", "65536", "--ops", str(ops)
    )
    try:
        results = ring.finish(timeout_s=50)
    finally:
        ring.kill()
    for code, events in results:
        assert code == 0, events
        rss = events[0]
        # 1 MiB per collective: a leak of even a few KiB each would show as MiB
        assert rss["kib_at_end"] - rss["kib_at_100"] < 4096, rss


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", DATA_PATHS)
def test_a_frozen_peer_fails_the_others_after_the_step_timeout(transport):
    """SIGSTOP: the peer's sockets stay open but nothing moves (a hung node). The step timeout
    or the control plane's watchdog, whichever fires first (the watchdog may: it is built to
    find frozen peers early), must tell, with PeerTimeout and the retryable code, naming the
    frozen rank; never later than the step timeout plus slack."""
    step_timeout_s = 2.0
    ring = ring_procs.start(
        3,
        "loop",
        transport,
        "--sizes",
        "3000000",
        "--chunk-bytes",
        "65536",
        "--step-timeout-s",
        str(step_timeout_s),
    )
    try:
        assert [ring.event(r)["event"] for r in range(3)] == ["started"] * 3
        frozen_at = time.monotonic()
        ring.procs[2].send_signal(signal.SIGSTOP)
        errors = [ring.event(r) for r in (0, 1)]
        elapsed = time.monotonic() - frozen_at
    finally:
        ring.kill()  # SIGKILL also ends a stopped process
    assert [e["exit_code"] for e in errors] == [EXIT_RETRYABLE] * 2, errors
    assert "PeerTimeout" in {e["type"] for e in errors}, errors
    assert any(ring.addresses[2] in e["message"] for e in errors), errors
    assert elapsed < step_timeout_s + 5
