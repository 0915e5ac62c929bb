"""Tests of exercise s02.decay_table: Gamma against powers of alpha, in float64 and in fp16."""

import numpy as np
import pytest

from stages.common.compare import assert_close, assert_rule

STAGE = "s02_scalar_decay"
AXES = ("row", "column")


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
    assert_rule(table.dtype == np.float64, "Gamma comes back in the dtype asked for", f"asked float64, got {table.dtype}")
    assert_close(table, powers_of_alpha(alpha, size), rtol=1e-13, name="Gamma", axes=AXES)


FP16_UNIT_ROUNDOFF = 2.0**-11  # the largest relative error of one rounding to fp16 (normal numbers)
FP16_HALF_SUBNORMAL_SPACING = 2.0**-25  # the largest absolute error of one rounding below 2^-14


@pytest.mark.parametrize("alpha", [0.95, 0.8, 0.5, 0.2])
def test_fp16_table_is_finite_and_rounded_once(decay_table, alpha):
    """At C = 64 in fp16: every entry finite, and alpha^(i - j) rounded once to fp16, no worse."""
    size = 64
    table = decay_table(np.log(alpha), size, np.float16)
    assert_rule(table.dtype == np.float16, "Gamma comes back in the dtype asked for", f"asked float16, got {table.dtype}")
    # NaN or inf fails here too, and the message says where the first one is
    assert_close(table, powers_of_alpha(alpha, size), rtol=FP16_UNIT_ROUNDOFF, atol=FP16_HALF_SUBNORMAL_SPACING,
                 name=f"Gamma in fp16 (alpha = {alpha})", axes=AXES)


def test_one_on_the_diagonal_zero_above(decay_table):
    table = decay_table(np.log(0.7), 12, np.float32)
    assert_rule((np.diag(table) == 1).all(), "Gamma is exactly 1 on its diagonal (alpha^0)",
                f"diagonal entries that are not 1: {_runs(np.flatnonzero(np.diag(table) != 1))}")
    assert_rule((np.triu(table, 1) == 0).all(), "Gamma is exactly 0 above its diagonal (j > i: no decay is defined)",
                f"rows with a nonzero entry above the diagonal: {_runs(np.flatnonzero(np.triu(table, 1).any(axis=1)))}")


def _runs(indices):
    return ", ".join(str(int(i)) for i in indices[:8]) + (", ..." if len(indices) > 8 else "")
