"""``ringtrain status|list|wait|delete``: the client's calls on the command line.

Pipeline position: ``ringtrain.cli`` dispatches each verb to one function here; each builds a
:class:`.client.TrainerClient` for ``--backend`` (default ``local``: run dirs under ``--root``,
``.ringtrain/runs`` as ``ringtrain run``'s default, so a run started by hand is found too) and
prints what it returns — a line for people, or ``--json`` (one object, a list for ``list``).
``ringtrain logs`` reads a local run dir through :mod:`ringtrain_localrun.logs` (its own messages)
and a cluster job's pods through the kube backend. Exit codes: 0 done (``wait``: the job
Succeeded), 1 the job Failed, 2 no such job, 124 ``wait --timeout`` ran out (as timeout(1)).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ringtrain_localrun import logs as localrun_logs

from .client import TrainerClient
from .jobs import JobFailed, JobNotFound, JobStatus, JobTimeout

EXIT_FAILED, EXIT_NOT_FOUND, EXIT_TIMEOUT = 1, 2, 124


def parser(verb: str, what: str, name: bool = True) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"ringtrain {verb}", description=what)
    if name:
        p.add_argument(
            "name",
            metavar="JOB",
            help="a job's name (locally: its run dir's name, a job name for its newest run, "
            "or a run dir's path)",
        )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument(
        "--backend",
        choices=("local", "kubernetes"),
        default="local",
        help="where the job runs (default %(default)s)",
    )
    p.add_argument("--root", metavar="DIR", help="local run dirs' parent (default .ringtrain/runs)")
    p.add_argument("-n", "--namespace", default="default", help="a cluster job's namespace")
    p.add_argument("--kubeconfig", help="a cluster's kubeconfig (default $KUBECONFIG)")
    return p


def _client(args: argparse.Namespace) -> TrainerClient:
    return TrainerClient(
        args.backend, root=args.root, namespace=args.namespace, kubeconfig=args.kubeconfig
    )


def _line(st: JobStatus) -> str:
    step = "-" if st.step is None else str(st.step)
    step += f"/{st.total_steps}" if st.total_steps else ""
    acc = f"{st.test_accuracy:.2%}" if st.test_accuracy is not None else "-"
    return f"{st.name:<40} {st.phase or '-':<11} step {step:<9} test accuracy {acc}"


def _show(st: JobStatus, as_json: bool) -> None:
    if as_json:
        print(json.dumps(st.to_dict()))
        return
    print(_line(st))
    if st.reason or st.message:
        print(f"  {st.reason}: {st.message}")
    for label, value in (("export", st.export), ("where", st.location)):
        if value:
            print(f"  {label:<7}{value}")


def _run(verb: str, args: argparse.Namespace, call: Any) -> int:
    try:
        return int(call())
    except JobNotFound as e:
        print(f"ringtrain {verb}: {e}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except TimeoutError as e:
        print(f"ringtrain {verb}: {e}", file=sys.stderr)
        return EXIT_TIMEOUT


def status_main(argv: list[str]) -> int:
    args = parser("status", "Print a job's phase, progress and accuracy.").parse_args(argv)

    def call() -> int:
        st = _client(args).backend.status(args.name)
        _show(st, args.json)
        return EXIT_FAILED if st.phase == "Failed" else 0

    return _run("status", args, call)


def list_main(argv: list[str]) -> int:
    args = parser("list", "List the jobs and their phases.", name=False).parse_args(argv)
    jobs = _client(args).list_jobs()
    if args.json:
        print(json.dumps([j.to_dict() for j in jobs]))
    else:
        for j in jobs:
            print(_line(j))
    return 0


def wait_main(argv: list[str]) -> int:
    p = parser("wait", "Wait for a job to end; exit 0 when it succeeded, 1 when it failed.")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="give up after (exit 124)")
    args = p.parse_args(argv)

    def call() -> int:
        client = _client(args)
        try:
            # the progress line on a terminal; --json keeps stdout to its one object
            progress = False if args.json else None
            st = client.wait_for_job(args.name, timeout=args.timeout, progress=progress)
        except JobFailed:
            _show(client.backend.status(args.name), args.json)
            return EXIT_FAILED
        except JobTimeout as e:
            print(f"ringtrain wait: {e}", file=sys.stderr)
            return EXIT_TIMEOUT
        _show(st, args.json)
        return 0

    return _run("wait", args, call)


def logs_main(argv: list[str]) -> int:
    p = parser(
        "logs",
        "Print a job's replica logs: a local run's (<run dir>/pods/<pod>/log, rotated at 10 MiB "
        "into log.1) or, with --backend kubernetes, its pods' (their main container).",
    )
    localrun_logs.replica_args(p)
    args = p.parse_args(argv)
    if args.backend == "local" and args.root is None:
        return localrun_logs.main(
            [args.name, *(["--replica", args.replica] if args.replica else [])]
            + (["--follow"] if args.follow else [])
        )

    def call() -> int:
        return _client(args).backend.logs(args.name, args.replica, args.follow, sys.stdout)

    return _run("logs", args, call)


def delete_main(argv: list[str]) -> int:
    args = parser(
        "delete", "Stop a job if it runs and delete it (locally: its run dir)."
    ).parse_args(argv)

    def call() -> int:
        client = _client(args)
        name = client.backend.status(args.name).name
        client.delete_job(args.name)
        print(json.dumps({"deleted": name}) if args.json else f"deleted {name}")
        return 0

    return _run("delete", args, call)
