"""Tests of exercise s01.chunkwise: reference B against the quadratic form of linear attention."""

import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.oracles import causal_linear_attention
from tests.exercises.chunk_checks import assert_chunk_quantities

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
    actual = chunkwise(x.q, x.k, x.v, chunk_size).o
    assert_close(actual, causal_linear_attention(x.q, x.k, x.v), rel_l2=1e-12, chunk_size=chunk_size)


def test_rejects_bad_chunk_size(chunkwise):
    x = make_inputs(1, 8, 1, 4, 4, seed=4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunkwise(x.q, x.k, x.v, 0)


@pytest.mark.parametrize("N, chunk_size", [(19, 4), (6, 1), (5, 16)])
def test_returns_what_only_a_chunked_form_has(chunkwise, N, chunk_size):
    """The state as each chunk starts, each chunk's scores, a row per token: the chunked
    algorithm's own quantities, which a token-by-token loop never forms (tests/exercises/chunk_checks.py)."""
    x = make_inputs(2, N, 2, 6, 5, seed=N)
    assert_chunk_quantities(chunkwise(x.q, x.k, x.v, chunk_size), x, chunk_size)
