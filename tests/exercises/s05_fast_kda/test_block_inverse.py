"""Tests of exercise s05.block_inverse: the inverse by blocks against NumPy's inverse."""

import numpy as np
import pytest

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
    assert np.max(np.abs(actual - expected)) <= 1e-12 * np.max(np.abs(expected))


def test_identity_for_zero_l(block_inverse):
    np.testing.assert_array_equal(block_inverse(np.zeros((8, 8)), 4), np.eye(8))
