"""Shared pytest fixtures: a seeded generator, and the worker-thread count restored after every test
(tests that compare thread counts change it; results never depend on it, the speed of later tests does)."""
import numpy as np
import pytest

import fadev


@pytest.fixture(autouse=True)
def _restore_num_threads():
    n = fadev.get_num_threads()
    yield
    fadev.set_num_threads(n)


@pytest.fixture
def rng(request):
    """A generator seeded from the test's name, so each test draws its own reproducible numbers."""
    seed = sum(request.node.name.encode()) * 7919
    return np.random.default_rng(seed)
