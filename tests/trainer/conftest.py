"""Shared fixtures of the trainer tests.

The test machine has two cores shared by several suites; OpenBLAS threads that spin while
another process holds a core make a step ~20x slower, so every trainer test runs numpy's BLAS
on one thread (results are bitwise the same; only the benchmark uses more).
"""

from __future__ import annotations

import numpy as np
import pytest
from thread_collective import ThreadGroup
from threadpoolctl import threadpool_limits

from ringtrain_trainer.data import dataset as data_mod
from ringtrain_trainer.engine import native


@pytest.fixture(autouse=True, scope="session")
def _one_blas_thread():
    with threadpool_limits(limits=1, user_api="blas"):
        yield


@pytest.fixture(scope="session")
def mnist5k() -> data_mod.Dataset:
    return data_mod.load_mnist5k()


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def thread_group():
    return ThreadGroup


@pytest.fixture(params=native.available())
def kernel_set(request) -> str:
    """Each kernel set this CPU runs, forced as ``RINGTRAIN_KERNELS`` forces it and restored
    after: a test that promises a kernel's bits (against numpy, or across sets) runs once per
    set, so an AVX-512 machine tests what AVX2-only ones run (issue 39)."""
    native.force(request.param)
    try:
        assert native.kernels is not None and native.kernels.isa() == request.param
        yield request.param
    finally:
        native.force(native.WIDEST or "")
