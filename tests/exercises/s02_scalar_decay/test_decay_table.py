"""Tests of exercise s02.decay_table: Gamma against powers of alpha, in float64 and in fp16."""

import numpy as np
import pytest

STAGE = "s02_scalar_decay"


@pytest.fixture
def decay_table(target_module):
    return target_module(STAGE, "decay_table.py").decay_table


def powers_of_alpha(alpha, size):
    """alpha^(i - j) for j <= i, else 0, from integer powers: no exponentials, no cumulative sums."""
    offsets = np.arange(size)[:, None] - np.arange(size)[None, :]
    return np.where(offsets >= 0, np.power(alpha, np.maximum(offsets, 0).astype(float)), 0.0)


@pytest.mark.parametrize("alpha, size", [(0.9, 8), (0.5, 16), (1.0, 5)])
def test_matches_powers_of_alpha_in_float64(decay_table, alpha, size):
    table = decay_table(np.log(alpha), size)
    assert table.dtype == np.float64
    np.testing.assert_allclose(table, powers_of_alpha(alpha, size), rtol=1e-13, atol=0)


FP16_UNIT_ROUNDOFF = 2.0**-11  # the largest relative error of one rounding to fp16 (normal numbers)
FP16_HALF_SUBNORMAL_SPACING = 2.0**-25  # the largest absolute error of one rounding below 2^-14


@pytest.mark.parametrize("alpha", [0.95, 0.8, 0.5, 0.2])
def test_fp16_table_is_finite_and_rounded_once(decay_table, alpha):
    """At C = 64 in fp16: every entry finite, and alpha^(i - j) rounded once to fp16, no worse."""
    size = 64
    table = decay_table(np.log(alpha), size, np.float16)
    assert table.dtype == np.float16
    assert np.isfinite(table).all(), f"{int((~np.isfinite(table)).sum())} entries are inf or NaN"
    np.testing.assert_allclose(table.astype(np.float64), powers_of_alpha(alpha, size),
                               rtol=FP16_UNIT_ROUNDOFF, atol=FP16_HALF_SUBNORMAL_SPACING)


def test_one_on_the_diagonal_zero_above(decay_table):
    table = decay_table(np.log(0.7), 12, np.float32)
    assert (np.diag(table) == 1).all()
    assert (np.triu(table, 1) == 0).all()
