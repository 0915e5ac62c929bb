"""Tests of exercise s02.kernel_mirror: reference C against the quadratic form with a decay per head."""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.oracles import causal_linear_attention, scalar_decay_attention
from tests.exercises.strong_gates import STRONG_CHUNK, STRONG_LOG_GATE, assert_finite

STAGE = "s02_scalar_decay"


@pytest.fixture
def kernel_mirror(target_module):
    return target_module(STAGE, "kernel_mirror.py").kernel_mirror


@pytest.mark.parametrize(
    "N, chunk_size, block_dv",
    [
        (8, 8, 6),  # one chunk, one block of value columns
        (32, 8, 6),  # many chunks
        (32, 8, 2),  # three blocks of value columns
        (21, 8, 3),  # N padded up to a multiple of chunk_size
    ],
)
def test_matches_quadratic_form(kernel_mirror, N, chunk_size, block_dv):
    x = make_inputs(2, N, 3, 4, 6, gate="head", gate_range=(0.5, 0.99), seed=N + block_dv)
    actual = kernel_mirror(x.q, x.k, x.v, x.g, chunk_size, block_dv)
    assert_close(actual, scalar_decay_attention(x.q, x.k, x.v, x.g), rel_l2=1e-12, chunk_size=chunk_size)


def test_independent_of_block_dv(kernel_mirror):
    x = make_inputs(1, 24, 2, 4, 6, gate="head", seed=5)
    by_block = [kernel_mirror(x.q, x.k, x.v, x.g, 8, block_dv) for block_dv in (1, 2, 3, 6)]
    for other in by_block[1:]:
        assert_close(other, by_block[0], rel_l2=1e-14, chunk_size=8, name="the output with another block_dv")


def test_no_decay_is_linear_attention(kernel_mirror):
    x = make_inputs(1, 20, 2, 4, 4, seed=8)
    actual = kernel_mirror(x.q, x.k, x.v, np.zeros(2), 8, 2)
    assert_close(actual, causal_linear_attention(x.q, x.k, x.v), rel_l2=1e-12)


def test_rejects_block_dv_that_does_not_divide_d_v(kernel_mirror):
    x = make_inputs(1, 8, 1, 4, 6, gate="head", seed=6)
    with pytest.raises(ValueError, match="block_dv"):
        kernel_mirror(x.q, x.k, x.v, x.g, 4, 4)


def test_strong_gates_at_full_chunk_length(kernel_mirror):
    x = make_inputs(1, 3 * STRONG_CHUNK, 2, 4, 6, gate="head", gate_range=(0.5, 0.99), seed=50)
    x.g[0] = STRONG_LOG_GATE  # head 0 forgets at once; head 1 keeps its gate
    actual = kernel_mirror(x.q, x.k, x.v, x.g, STRONG_CHUNK, 3)
    assert_finite(actual, "head 0")
    assert_close(actual, scalar_decay_attention(x.q, x.k, x.v, x.g), rel_l2=1e-12, chunk_size=STRONG_CHUNK)
