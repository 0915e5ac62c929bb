"""Tests of exercise s01.chunkwise: reference B against the quadratic form of linear attention."""

import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.oracles import causal_linear_attention

STAGE = "s01_linear_attention"


@pytest.fixture
def chunkwise(target_module):
    return target_module(STAGE, "chunkwise.py").chunkwise


@pytest.mark.parametrize(
    "N, chunk_size",
    [
        (8, 8),  # one chunk
        (32, 4),  # many chunks
        (19, 4),  # a shorter last chunk
        (6, 1),  # one token per chunk: only the diagonal is intra-chunk
        (5, 16),  # a chunk longer than the sequence
    ],
)
def test_matches_quadratic_form(chunkwise, N, chunk_size):
    x = make_inputs(2, N, 2, 6, 5, seed=N)
    actual = chunkwise(x.q, x.k, x.v, chunk_size)
    assert_close(actual, causal_linear_attention(x.q, x.k, x.v), rel_l2=1e-12, chunk_size=chunk_size)


def test_rejects_bad_chunk_size(chunkwise):
    x = make_inputs(1, 8, 1, 4, 4, seed=4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunkwise(x.q, x.k, x.v, 0)
