"""The ring's watchdog: finds a frozen or cut-off neighbour within seconds and names stragglers.

A SIGKILLed peer is seen at once (the kernel closes its sockets); a frozen one (SIGSTOP, a hung
node) or one whose network is cut keeps its sockets open and would only be noticed by the step
timeout. So this thread Health-checks both ring neighbours over the control channel every
``PERIOD_S`` with a short deadline. A neighbour that has answered no check for
``health_timeout_s`` *while a collective is waiting* is declared lost: the collective is
interrupted with a ``PeerTimeout`` naming it and the other peers are told. Between collectives
nothing is declared (a peer that finished training and exited is not a failure), and the step
timeout stays the last resort for a peer that answers health checks but sends nothing.

A peer that answers health checks and sends one byte every few seconds restarts the step
timeout on every byte and would hold the ring forever (issue 20), so each collective also has a
deadline (``RingCollective.deadline_s``: the step timeout plus its bytes at the
``ring_min_bytes_per_s`` floor). Past it the watchdog asks every peer how many of its bytes it
has received (``State``); the rank with the smallest share is the one starved at the source, so
every rank names the same link, its left neighbour → it, and leaves as from a frozen peer.

Horovod's stall check: a collective in flight longer than ``stall_s`` is logged, counted
(``observer.stalled``) and reported in ``/status`` with the ranks that have not started it yet,
asked over the control channel (``State``); a rank that does not answer is listed too.
"""

from __future__ import annotations

import json
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringtrain.errors import PeerTimeout
from ringtrain_trainer.ring import schedule
from ringtrain_trainer.ring.control import SERVICE, ControlPlane, log

#: Seconds between two rounds of health checks (two tiny unary calls each).
PERIOD_S = 0.5


class Watchdog:
    def __init__(
        self, control: ControlPlane, collective, *, health_timeout_s: float, stall_s: float
    ) -> None:
        self._control, self._coll = control, collective
        self._health_timeout_s, self._stall_s = health_timeout_s, stall_s
        rank, world = control.rank, control.world
        self._watched = sorted(set(schedule.neighbours(rank, world)) - {rank})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ring-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last_ok = {r: time.monotonic() for r in self._watched}
        stalled_seq, next_report = None, 0.0
        check_s = max(0.1, min(1.0, self._health_timeout_s / 2))
        while not self._stop.wait(PERIOD_S):
            answered = check(self._control, self._watched, check_s)
            now = time.monotonic()
            for r, ok in answered.items():
                if ok:
                    last_ok[r] = now
            pos = self._coll.position
            if pos is None or self._coll.broken:
                if stalled_seq is not None:
                    stalled_seq = None
                    self._coll.observer.stalled(None)
                continue
            header, since = pos
            lost = [r for r in self._watched if now - last_ok[r] > self._health_timeout_s]
            if lost:
                r = lost[0]
                err = PeerTimeout(
                    f"{self._control.name(r)} answered no health check for "
                    f"{now - last_ok[r]:.1f} s while this rank waited in {header.describe()} "
                    "(frozen or cut off)",
                    rank=self._control.rank,
                    step=header.step,
                    peer=self._control.addresses[r],
                )
                log(str(err))
                self._coll.interrupt(err, "lost", tell_peers=True)
                return
            if now - since > self._coll.deadline_s(header):
                err = self._too_slow(header, now - since)
                log(str(err))
                self._coll.interrupt(err, "timeout", tell_peers=True)
                return
            if now - since >= self._stall_s and (stalled_seq != header.seq or now >= next_report):
                stalled_seq, next_report = header.seq, now + self._stall_s
                self._report(header, now - since)

    def _too_slow(self, header, waited_s: float) -> PeerTimeout:
        """The PeerTimeout for a collective past its deadline, naming the slowest link: the
        rank that has received the smallest share of its bytes (ties: the lowest rank) and the
        left neighbour that should have sent them."""
        c, coll = self._control, self._coll
        shares = {c.rank: (coll.received, coll.expected_bytes(header))}
        peers = [r for r in range(c.world) if r != c.rank]
        for r, st in states(c, peers, 1.0).items():
            cur = (st or {}).get("current") or {}
            if cur.get("seq") == header.seq and isinstance(cur.get("received"), int):
                shares[r] = (cur["received"], int(cur.get("expected") or 0))
        victim = min(shares, key=lambda r: (shares[r][0] / shares[r][1] if shares[r][1] else 1, r))
        got, want = shares[victim]
        src = schedule.left(victim, c.world)
        return PeerTimeout(
            f"{c.name(src)} delivered {got} of {want} bytes to {c.name(victim)} in "
            f"{waited_s:.1f} s of {header.describe()}, past its deadline of "
            f"{coll.deadline_s(header):.1f} s (the step timeout plus its bytes at "
            f"{coll.min_bytes_per_s:,.0f} B/s, ring.minBytesPerSecond): a live but too slow link",
            rank=c.rank,
            step=header.step,
            peer=c.addresses[src],
        )

    def _report(self, header, waited_s: float) -> None:
        """Ask every peer where it is; those that have not started this collective (or do
        not answer) are the ones it waits for."""
        c = self._control
        peers = [r for r in range(c.world) if r != c.rank]
        missing = []
        for r, st in states(c, peers, 1.0).items():
            if st is None:
                missing.append({"rank": r, "name": c.names[r], "at": "not answering"})
            elif st["started"] <= header.seq:
                cur = st.get("current")
                missing.append(
                    {
                        "rank": r,
                        "name": c.names[r],
                        "at": "between collectives"
                        if cur is None
                        else f"step {cur['step']} tag {cur['tag']}",
                    }
                )
        report = {
            "seq": header.seq,
            "step": header.step,
            "tag": header.tag,
            "waited_s": round(waited_s, 1),
            "missing": missing,
        }
        who = ", ".join(f"{m['name']} ({m['at']})" for m in missing) or "nobody known"
        log(
            f"rank {c.rank}: stalled {waited_s:.0f} s in {header.describe()}: not delivered by "
            f"{who}"
        )
        self._coll.observer.stalled(report)

    def stop(self) -> None:
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=3)


def states(control: ControlPlane, ranks: list[int], timeout_s: float) -> dict[int, dict | None]:
    """Each peer's ``State`` (None where it did not answer in time)."""
    md = control.metadata()
    calls = {
        r: control.channel(r)
        .unary_unary(f"/{SERVICE}/State", request_serializer=None, response_deserializer=None)
        .future(b"", metadata=md, timeout=timeout_s)
        for r in ranks
    }
    out: dict[int, dict | None] = {}
    for r, call in calls.items():
        try:
            out[r] = json.loads(call.result())
        except (grpc.RpcError, ValueError):
            out[r] = None
    return out


def check(control: ControlPlane, ranks: list[int], timeout_s: float) -> dict[int, bool]:
    """Health/Check of ``ranks`` in parallel: True where the peer answered SERVING."""
    calls = {
        r: health_pb2_grpc.HealthStub(control.channel(r)).Check.future(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
        )
        for r in ranks
    }
    out = {}
    for r, call in calls.items():
        try:
            out[r] = call.result().status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            out[r] = False
    return out
