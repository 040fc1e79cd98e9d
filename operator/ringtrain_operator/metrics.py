"""The operator's Prometheus metrics, in a registry of its own (tests pass a fresh one)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from . import __version__, status

_FAILED_REASONS = {
    status.REASON_FAILED,
    status.REASON_DEADLINE,
    status.REASON_BACKOFF,
    status.REASON_INVALID,
}
STATES = (
    status.CREATED,
    status.RUNNING,
    status.RESTARTING,
    status.SUCCEEDED,
    status.FAILED,
    status.SUSPENDED,
)


class OperatorMetrics:
    """Counters fed by the reconciler's Events, a gauge of jobs by state, reconcile latency."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry

        def counter(what: str, doc: str) -> Counter:
            return Counter(f"ringtrain_operator_jobs_{what}", doc, ["job_namespace"], registry=r)

        self.created = counter("created", "TrainingJobs whose pods were first created")
        self.succeeded = counter("succeeded", "TrainingJobs that succeeded")
        self.failed = counter("failed", "TrainingJobs that failed (any reason)")
        self.restarted = counter("restarted", "restarts of TrainingJobs (Restarting transitions)")
        self.jobs = Gauge("ringtrain_operator_jobs", "TrainingJobs by state", ["state"], registry=r)
        self.reconcile_seconds = Histogram(
            "ringtrain_operator_reconcile_duration_seconds",
            "one reconcile of one TrainingJob",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.api_requests = Counter(
            "ringtrain_operator_api_requests",
            "requests to the Kubernetes API server (reconciles, informers, Events), by verb "
            "(the HTTP method; LIST and WATCH for a collection's GET) and resource",
            ["verb", "resource"],
            registry=r,
        )
        Gauge("ringtrain_operator_info", "operator build", ["version"], registry=r).labels(
            __version__
        ).set(1)
        self._by_reason = {
            status.REASON_CREATED: self.created,
            status.REASON_SUCCEEDED: self.succeeded,
            status.REASON_RESTARTING: self.restarted,
            **dict.fromkeys(_FAILED_REASONS, self.failed),
        }
        self._states: dict[tuple[str, str], str] = {}
        for s in STATES:
            self.jobs.labels(s).set(0)

    def record(self, namespace: str, name: str, decision: status.Decision) -> None:
        for ev in decision.events:
            if counter := self._by_reason.get(ev.reason):
                counter.labels(namespace).inc()
        state = decision.status.get("state")
        if state and self._states.get((namespace, name)) != state:
            self.forget(namespace, name)
            self._states[(namespace, name)] = state
            self.jobs.labels(state).inc()

    def forget(self, namespace: str, name: str) -> None:
        """A job left (deleted): it no longer counts in its state."""
        if (old := self._states.pop((namespace, name), None)) is not None:
            self.jobs.labels(old).dec()
