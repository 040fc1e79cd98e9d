"""``ringtrain operator``: run the kopf operator, plus /healthz and /metrics on one port.

The health endpoint is served from the operator's own event loop, so it fails exactly when the
loop that runs the handlers is stuck; the metrics come from the operator's own registry.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

import kopf
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from . import __version__, handlers, networkpolicy
from .kube import Kube, count_requests, load_config
from .metrics import OperatorMetrics

#: The prefix of kopf's annotations and finalizer on TrainingJobs.
PREFIX = "ringtrain.io"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ringtrain operator", description=__doc__)
    scope = p.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        help="watch this namespace (repeatable); default: all namespaces",
    )
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true", help="watch the whole cluster (the default)"
    )
    p.add_argument(
        "--kubeconfig",
        default=None,
        help="kubeconfig file (default: in-cluster, else $KUBECONFIG / ~/.kube/config)",
    )
    p.add_argument(
        "--listen",
        default="0.0.0.0:8080",
        metavar="HOST:PORT",
        help="address of /healthz and /metrics (default %(default)s)",
    )
    p.add_argument("--verbose", "-v", action="store_true")
    net = p.add_argument_group("per-job NetworkPolicy (the chart's networkPolicy.*)")
    net.add_argument(
        "--network-policy",
        action="store_true",
        help="create a NetworkPolicy per job: the ring port only from the same "
        "job, the metrics port only from the monitoring namespaces and the "
        "operator",
    )
    net.add_argument(
        "--metrics-namespace-labels",
        type=networkpolicy.parse_labels,
        default="kubernetes.io/metadata.name=monitoring",
        metavar="K=V,...",
        help="labels of the namespaces that may scrape :9400 (default %(default)s)",
    )
    net.add_argument(
        "--operator-pod-labels",
        type=networkpolicy.parse_labels,
        default="app.kubernetes.io/name=ringtrain",
        metavar="K=V,...",
        help="labels of the operator's pods, which read the chief's /status "
        "(default %(default)s); their namespace is $POD_NAMESPACE",
    )
    return p.parse_args(argv)


def network_settings(
    args: argparse.Namespace, pod_namespace: str | None
) -> networkpolicy.Settings | None:
    """The NetworkPolicy settings from the flags; None without ``--network-policy``."""
    if not args.network_policy:
        return None
    return networkpolicy.Settings(
        metrics_namespace_labels=args.metrics_namespace_labels,
        operator_namespace=pod_namespace or None,
        operator_pod_labels=args.operator_pod_labels,
    )


def health_app(metrics: OperatorMetrics) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def metrics_view(_: web.Request) -> web.Response:
        body = generate_latest(metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics_view)
    return app


def operator_settings(args: argparse.Namespace) -> kopf.OperatorSettings:
    """All of kopf's settings, made here only.

    kopf's own bookkeeping stays under ringtrain.io and out of the status we own. Namespaced mode
    needs no cluster-wide read access at all: kopf's scanning (a watch on namespaces and on CRDs)
    is off, the given namespaces are taken as they are, and the TrainingJob resource is
    discovered once at start-up (install the CRD first, as Helm does)."""
    settings = kopf.OperatorSettings()
    settings.persistence.finalizer = f"{PREFIX}/finalizer"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    settings.posting.level = logging.WARNING  # kopf's own warnings about a job become Events
    settings.scanning.disabled = bool(args.namespace)
    # kopf watches no resource (the informers do: issue 22); these settings matter only if a
    # resource handler is added again. Its per-object worker would live a second after the
    # object's last event, not 5 s, and a watch is renewed every 10 minutes, so a silently dead
    # connection is noticed.
    settings.batching.idle_timeout = 1.0
    settings.watching.server_timeout = 600
    settings.watching.client_timeout = 660
    return settings


async def serve(args: argparse.Namespace, memo: kopf.Memo) -> None:
    host, _, port = args.listen.rpartition(":")
    runner = web.AppRunner(health_app(memo.metrics))
    await runner.setup()
    await web.TCPSite(runner, host or "0.0.0.0", int(port)).start()
    try:
        await kopf.operator(
            settings=operator_settings(args),
            standalone=True,
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            memo=memo,
        )
    finally:
        await runner.cleanup()


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:  # kopf's per-object INFO lines, should a resource handler return
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    api = load_config(args.kubeconfig)
    metrics = OperatorMetrics()
    count_requests(api, metrics.api_requests)
    memo = handlers.new_memo(
        Kube(api),
        metrics,
        network_settings(args, os.environ.get("POD_NAMESPACE")),
        namespaces=args.namespace,
    )
    logging.getLogger(__name__).info("ringtrain operator %s starting", __version__)
    asyncio.run(serve(args, memo))
    return 0
