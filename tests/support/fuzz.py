"""The fuzzers' one budget and rule (issue 35, decision 0211): every property test in
``make test`` runs a fixed number of examples, derandomized — the same examples on every run
and machine, so CI is reproducible and a red run can be replayed — with no example database.
A case a fuzzer finds (locally, e.g. with ``HYPOTHESIS_PROFILE``-free exploratory runs) is kept
as an ``@example(...)`` on its test: the repository's seed corpus, replayed first on every run."""

from __future__ import annotations

from hypothesis import HealthCheck, settings


def fuzz(max_examples: int) -> settings:
    """``@fuzz(50)``: ``max_examples`` derandomized examples, no deadline (CI machines are
    loaded), no example database (derandomize implies none; the corpus is ``@example``)."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )
