"""Tests of exercise s05.block_inverse: the inverse by blocks against NumPy's inverse."""

import numpy as np
import pytest

from stages.common.compare import assert_close, assert_rule

STAGE = "s05_fast_kda"


@pytest.fixture
def block_inverse(target_module):
    return target_module(STAGE, "block_inverse.py").block_inverse


@pytest.mark.parametrize(
    "C, block",
    [
        (64, 16),  # the kernel's chunk: four sub-blocks
        (12, 3),  # four sub-blocks of three rows
        (8, 4),  # two sub-blocks
        (6, 1),  # one-row sub-blocks: plain forward substitution
    ],
)
def test_equals_numpy_inverse(block_inverse, C, block):
    rng = np.random.default_rng(C + block)
    L = np.tril(rng.uniform(-0.5, 0.5, (C, C)), -1)
    expected = np.linalg.inv(np.eye(C) + L)
    actual = block_inverse(L, block)
    assert_close(actual, expected, max_abs=1e-12 * np.max(np.abs(expected)), name="T = (I + L)^{-1}",
                 axes=("row", "column"))


def test_identity_for_zero_l(block_inverse):
    assert_close(block_inverse(np.zeros((8, 8)), 4), np.eye(8), max_abs=0.0, name="T for L = 0", axes=("row", "column"))


LIBRARY_SOLVERS = ("inv", "pinv", "solve", "tensorinv", "tensorsolve", "lstsq")


def test_builds_the_inverse_without_a_library_solver(block_inverse, monkeypatch):
    """The kernel has no inverse to call: the exercise builds T from substitutions and products."""
    called = []
    for name in LIBRARY_SOLVERS:
        library_function = getattr(np.linalg, name)
        monkeypatch.setattr(np.linalg, name, lambda *args, _f=library_function, _n=name, **kwargs: (
            called.append(_n), _f(*args, **kwargs))[1])
    L = np.tril(np.random.default_rng(3).uniform(-0.5, 0.5, (8, 8)), -1)
    block_inverse(L, 4)
    assert_rule(not called, "block_inverse builds T by forward substitution and GEMM-shaped merges, "
                "without a library inverse or solver", f"it called np.linalg.{', np.linalg.'.join(sorted(set(called)))}")
