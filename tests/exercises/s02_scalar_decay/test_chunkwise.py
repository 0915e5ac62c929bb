"""Tests of exercise s02.chunkwise: reference B against the quadratic form with a decay per head."""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.oracles import causal_linear_attention, scalar_decay_attention
from tests.exercises.chunk_checks import assert_chunk_quantities
from tests.exercises.strong_gates import STRONG_CHUNK, STRONG_LOG_GATE, assert_finite

STAGE = "s02_scalar_decay"


@pytest.fixture
def chunkwise(target_module):
    return target_module(STAGE, "chunkwise.py").chunkwise


@pytest.mark.parametrize(
    "N, chunk_size",
    [
        (8, 8),  # one chunk
        (32, 4),  # many chunks
        (19, 4),  # a shorter last chunk
        (6, 1),  # one token per chunk: all decay goes through the state
        (5, 16),  # a chunk longer than the sequence
    ],
)
def test_matches_quadratic_form(chunkwise, N, chunk_size):
    x = make_inputs(2, N, 2, 6, 5, gate="head", gate_range=(0.5, 0.99), seed=N)
    actual = chunkwise(x.q, x.k, x.v, x.g, chunk_size).o
    assert_close(actual, scalar_decay_attention(x.q, x.k, x.v, x.g), rel_l2=1e-12, chunk_size=chunk_size)


def test_no_decay_is_linear_attention(chunkwise):
    x = make_inputs(1, 20, 2, 4, 4, seed=7)
    actual = chunkwise(x.q, x.k, x.v, np.zeros(2), 8).o
    assert_close(actual, causal_linear_attention(x.q, x.k, x.v), rel_l2=1e-12)


def test_rejects_bad_chunk_size(chunkwise):
    x = make_inputs(1, 8, 1, 4, 4, gate="head", seed=4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunkwise(x.q, x.k, x.v, x.g, 0)


def test_strong_gates_at_full_chunk_length(chunkwise):
    x = make_inputs(1, 3 * STRONG_CHUNK, 2, 4, 3, gate="head", gate_range=(0.5, 0.99), seed=50)
    x.g[0] = STRONG_LOG_GATE  # head 0 forgets at once; head 1 keeps its gate
    actual = chunkwise(x.q, x.k, x.v, x.g, STRONG_CHUNK).o
    assert_finite(actual, "head 0")
    assert_close(actual, scalar_decay_attention(x.q, x.k, x.v, x.g), rel_l2=1e-12, chunk_size=STRONG_CHUNK)


@pytest.mark.parametrize("N, chunk_size", [(19, 4), (6, 1), (5, 16)])
def test_returns_what_only_a_chunked_form_has(chunkwise, N, chunk_size):
    """The state as each chunk starts, each chunk's scores, a row per token: the chunked
    algorithm's own quantities, which a token-by-token loop never forms (tests/exercises/chunk_checks.py)."""
    x = make_inputs(2, N, 2, 6, 5, gate="head", gate_range=(0.5, 0.99), seed=N)
    assert_chunk_quantities(chunkwise(x.q, x.k, x.v, x.g, chunk_size), x, chunk_size)
