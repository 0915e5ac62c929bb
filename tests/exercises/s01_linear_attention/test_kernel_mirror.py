"""Tests of exercise s01.kernel_mirror: reference C against the quadratic form of linear attention."""

import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.oracles import causal_linear_attention

STAGE = "s01_linear_attention"


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
    x = make_inputs(2, N, 3, 4, 6, seed=N + block_dv)
    actual = kernel_mirror(x.q, x.k, x.v, chunk_size, block_dv)
    assert_close(actual, causal_linear_attention(x.q, x.k, x.v), rel_l2=1e-12, chunk_size=chunk_size)


def test_independent_of_block_dv(kernel_mirror):
    x = make_inputs(1, 24, 2, 4, 6, seed=5)
    by_block = [kernel_mirror(x.q, x.k, x.v, 8, block_dv) for block_dv in (1, 2, 3, 6)]
    for other in by_block[1:]:
        assert_close(other, by_block[0], rel_l2=1e-14, chunk_size=8, name="the output with another block_dv")


def test_rejects_block_dv_that_does_not_divide_d_v(kernel_mirror):
    x = make_inputs(1, 8, 1, 4, 6, seed=6)
    with pytest.raises(ValueError, match="block_dv"):
        kernel_mirror(x.q, x.k, x.v, 4, 4)
