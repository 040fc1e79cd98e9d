"""`ringtrain worker` as a process: flags in, the collective chosen, signals, exit code out.

Pipeline position: the edge of the trainer. :func:`main` reads flags and environment once into a
``TrainerConfig``; ``--report`` prints the IPU memory report and stops; a process whose TF_CONFIG
task is ``evaluator`` runs :mod:`.evaluator`; otherwise :func:`connect` picks the collective (none
for a single worker, the ring when TF_CONFIG names peers: gRPC control plane, data path
``grpc+tcp`` or ``grpc`` as ``--ring-transport`` says; Open MPI with ``--collective mpi``) and
``worker.Trainer`` runs the steps; a ring process first tunes glibc malloc
(``ring.malloc_tuning``). Every exception becomes an exit code via
``ringtrain.errors.exit_code_for`` and the termination log — except a peer's failure, after
which the process rejoins the ring in place (:mod:`.rejoin`); SIGTERM stops after the current
step, checkpoints, and exits 143.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from ringtrain.cluster import bind_host
from ringtrain.errors import (
    EXIT_OK,
    EXIT_RETRYABLE,
    EXIT_TERMINATED,
    RingError,
    describe,
    exit_code_for,
)
from ringtrain_trainer import elastic, evaluator, mpi, rejoin, report, ring
from ringtrain_trainer.collective import Collective, LocalCollective
from ringtrain_trainer.config import TrainerConfig
from ringtrain_trainer.ipu.device import blas_limits
from ringtrain_trainer.ring import malloc_tuning
from ringtrain_trainer.ring.tls import INSECURE_NOTE
from ringtrain_trainer.telemetry.metrics import RingMetrics, TrainerMetrics
from ringtrain_trainer.telemetry.server import MetricsServer
from ringtrain_trainer.telemetry.termlog import (
    own_termination_log,
    termination_log_flag,
    write_termination_log,
)
from ringtrain_trainer.worker import Trainer


def connect(
    cfg: TrainerConfig,
    metrics: TrainerMetrics | None = None,
    resized: threading.Event | None = None,
) -> Collective:
    """The collective for this process: local, the ring, or Open MPI. The ring reports to
    ``metrics`` from its start-up on (the peers it still waits for); ``resized`` (an elastic
    job's size changed) ends its forming."""
    if cfg.collective == "mpi":
        return mpi.connect(cfg.cluster)
    if cfg.cluster.world_size <= 1 and not (cfg.elastic_file and cfg.cluster.in_ring):
        return LocalCollective()
    malloc_tuning.tune()  # before the ring's threads first allocate

    observer = None if metrics is None else RingMetrics(metrics)
    if cfg.tls is None:
        print(f"ringtrain worker: {INSECURE_NOTE}", file=sys.stderr)
    return ring.connect(
        cfg.cluster,
        cfg.token,
        transport=cfg.ring_transport,
        step_timeout_s=cfg.ring_step_timeout_s,
        connect_timeout_s=cfg.ring_connect_timeout_s,
        health_timeout_s=cfg.ring_health_timeout_s,
        stall_s=cfg.ring_stall_warning_s,
        min_bytes_per_s=cfg.ring_min_bytes_per_s,
        observer=observer,
        tls=cfg.tls,
        encrypt_data=cfg.ring_encrypt_data,
        health_port=cfg.ring_health_port,
        shared_memory=cfg.ring_shared_memory,
        elastic=cfg.elastic_file is not None,
        resized=resized,
    )


def process_main(argv: list[str] | None = None) -> int:
    """`ringtrain worker` as the process itself, the only caller allowed to re-execute it."""
    return main(argv, rejoin_exec=rejoin.exec_again)


def main(
    argv: list[str] | None = None, rejoin_exec: Callable[[rejoin.Rejoins], None] | None = None
) -> int:
    """Train; returns the process exit code. With ``rejoin_exec`` a survivor of a peer's
    failure calls it (it replaces the process) once everything is closed, instead of returning."""
    argv = list(sys.argv[1:] if argv is None else argv)
    previous = rejoin.Rejoins.from_env()
    again: rejoin.Rejoins | None = None
    resize: tuple[elastic.Size, int, float] | None = None  # the new size, the stop step, seen at
    watcher: elastic.Watcher | None = None
    signalled = threading.Event()
    cfg: TrainerConfig | None = None
    trainer: Trainer | None = None
    collective: Collective | None = None
    server: MetricsServer | None = None
    restore_signals = lambda: None  # noqa: E731
    try:
        cfg = TrainerConfig.from_args(argv)
        if cfg.report:  # docs/trainer.md "IPU memory report"
            report.report(cfg, sys.stdout)
            return EXIT_OK
        metrics = TrainerMetrics()
        host = bind_host(a for role in cfg.cluster.cluster.values() for a in role)
        if cfg.cluster.task_type == "evaluator":  # beside the ring, never in it
            if cfg.metrics_port:
                server = MetricsServer(metrics, cfg.metrics_port, host)
            final = evaluator.run(cfg, metrics, _install_sigterm).to_dict()
            write_termination_log(cfg.termination_log, final)
            return EXIT_TERMINATED if final["terminated"] else EXIT_OK
        if cfg.metrics_port:  # up before the ring, so /status names the peers it waits for
            server = MetricsServer(metrics, cfg.metrics_port, host)
        if previous.total:
            metrics.rejoins.set(previous.total)
            print(
                f"ringtrain worker: rejoining the ring in place (rejoin {previous.total} of "
                f"this container)",
                file=sys.stderr,
            )
        if cfg.elastic_file:  # from before the ring forms: a resize may come meanwhile
            watcher = elastic.Watcher(cfg.elastic_file, cfg.elastic_size)
        collective = connect(cfg, metrics, watcher.found if watcher else None)
        metrics.watch_ring(collective)
        trainer = Trainer(cfg, collective, metrics=metrics)
        metrics.update_status(ring_size=trainer.world)
        resized = elastic.Resized.from_env(os.environ)
        if resized is not None and trainer.rank == 0:
            formed = time.time()

            def say(step: int) -> None:
                said = resized.event(formed, step)
                metrics.update_status(resize_step=step, resize_s=said["ring_formed_s"])
                print(json.dumps(said), flush=True)

            trainer.on_restored = say
        restore_signals = _install_sigterm(trainer.stop_requested, signalled)
        if watcher is not None:
            watcher.attach(trainer.stop_requested)
        with blas_limits(trainer.ipu.host_threads):
            final = trainer.run()
        if watcher is not None and final["terminated"] and not signalled.is_set():
            size = watcher.after_stop(signalled=False)
            if size is not None and trainer.rank < size.workers:
                resize = (size, trainer.step, watcher.seen_at)
            elif size is None and rejoin_exec is not None:
                # a peer's pod went (its stop came through the vote) and the size has not
                # changed yet: wait in this container for the peer, or for the job's new size
                again = previous.after(trainer.step)
                print(
                    f"ringtrain worker: the ring stopped without a resize at step "
                    f"{trainer.step}; rejoining it in this container (exec, no restart)",
                    file=sys.stderr,
                )
        write_termination_log(own_termination_log(cfg.termination_log, cfg, collective), final)
        return EXIT_TERMINATED if final["terminated"] else EXIT_OK
    except SystemExit:
        raise
    except BaseException as e:  # one place maps every failure to an exit code
        code = exit_code_for(e)
        print(f"ringtrain worker: {describe(e)}", file=sys.stderr)
        if collective is not None:  # the peers leave at once instead of timing out
            collective.fail(f"{type(e).__name__}: {e}", code)
        if watcher is not None and watcher.changed is not None and rejoin_exec is not None:
            assert cfg is not None  # a watcher is made from it
            if cfg.cluster.rank < watcher.changed.workers:  # resized meanwhile: form it anew
                step = -1 if trainer is None else trainer.step
                resize = (watcher.changed, step, watcher.seen_at)
                return code
        if rejoin_exec is not None and cfg is not None:
            again = rejoin.decide(
                e,
                ring_formed=collective is not None,
                step=None if trainer is None else trainer.step,
                limit=cfg.ring_rejoin_limit,
                previous=previous,
            )
            if again is not None:
                where = "while it formed" if trainer is None else f"at step {again.step}"
                print(
                    f"ringtrain worker: leaving the broken ring {where}; "
                    f"rejoining it in this container (exec, no restart; {again.streak} of "
                    f"--ring-rejoin-limit {cfg.ring_rejoin_limit} in a row)",
                    file=sys.stderr,
                )
                return code
            if (
                isinstance(e, RingError)
                and code == EXIT_RETRYABLE
                and previous.streak >= cfg.ring_rejoin_limit
            ):
                print(
                    f"ringtrain worker: not rejoining in place: {previous.streak} rejoins in "
                    f"a row without a completed step (--ring-rejoin-limit "
                    f"{cfg.ring_rejoin_limit}); exiting {code}",
                    file=sys.stderr,
                )
        if trainer is not None:
            trainer.metrics.update_status(phase="Failed")
        log = own_termination_log(
            cfg.termination_log if cfg is not None else termination_log_flag(argv), cfg, collective
        )
        if log:
            write_termination_log(log, {"event": "error", "error": describe(e), "exit_code": code})
        if code == 1:
            raise
        return code
    finally:
        restore_signals()
        if watcher is not None:
            watcher.close()
        if trainer is not None:
            trainer.close()
        if collective is not None:
            collective.close()
        if server is not None:
            server.close()
        if again is not None and rejoin_exec is not None:
            rejoin_exec(again)  # replaces this process: the ring's ports are free again
        if resize is not None and rejoin_exec is not None:
            size, step, seen_at = resize
            before = trainer.world if trainer else cfg.cluster.world_size if cfg else 0
            elastic.exec_resized(size, before, step, seen_at, drop=rejoin.ENV)


def _install_sigterm(
    stop_requested: threading.Event, signalled: threading.Event | None = None
) -> Callable[[], None]:
    """SIGTERM/SIGINT set ``stop_requested`` (and ``signalled``: this process was told to stop,
    not only its ring): the trainer finishes the current step, checkpoints, and exits 143
    (Python as PID 1 otherwise ignores SIGTERM and the pod waits out its whole grace period).
    Returns a function that puts the previous handlers back."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def handler(signum, frame):
        if signalled is not None:
            signalled.set()
        stop_requested.set()

    old = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}

    def restore() -> None:
        for s, h in old.items():
            signal.signal(s, h)

    return restore
