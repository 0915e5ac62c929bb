"""Tests of exercise s04.chunkwise: reference B against the delta-rule form of KDA (stages/common/oracles.py)."""

import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.oracles import kda_delta_rule
from tests.exercises.chunk_checks import assert_chunk_quantities
from tests.exercises.strong_gates import STRONG_CHUNK, STRONG_LOG_GATE, assert_finite

STAGE = "s04_kda"


@pytest.fixture
def chunkwise(target_module):
    return target_module(STAGE, "chunkwise.py").chunkwise


@pytest.mark.parametrize(
    "N, chunk_size",
    [
        (8, 8),  # one chunk
        (32, 4),  # many chunks
        (19, 4),  # a shorter last chunk
        (6, 1),  # one token per chunk: nothing to solve inside a chunk
        (5, 16),  # a chunk longer than the sequence
    ],
)
def test_matches_delta_rule_form(chunkwise, N, chunk_size):
    x = make_inputs(2, N, 2, 6, 5, gate="channel", gate_range=(0.5, 0.999), beta_range=(0.1, 0.9), seed=N)
    actual = chunkwise(x.q, x.k, x.v, x.g, x.beta, chunk_size).o
    assert_close(actual, kda_delta_rule(x.q, x.k, x.v, x.g, x.beta), rel_l2=1e-12, chunk_size=chunk_size)


def test_rejects_bad_chunk_size(chunkwise):
    x = make_inputs(1, 8, 1, 4, 4, gate="channel", beta_range=(0.1, 0.9), seed=4)
    with pytest.raises(ValueError, match="chunk_size"):
        chunkwise(x.q, x.k, x.v, x.g, x.beta, 0)


def test_strong_gates_at_full_chunk_length(chunkwise):
    x = make_inputs(1, 3 * STRONG_CHUNK, 2, 6, 5, gate="channel", gate_range=(0.5, 0.999), beta_range=(0.1, 0.9), seed=50)
    x.g[..., ::2] = STRONG_LOG_GATE  # every other key channel forgets at every token
    actual = chunkwise(x.q, x.k, x.v, x.g, x.beta, STRONG_CHUNK).o
    assert_finite(actual, "every other key channel")
    assert_close(actual, kda_delta_rule(x.q, x.k, x.v, x.g, x.beta), rel_l2=1e-12, chunk_size=STRONG_CHUNK)


@pytest.mark.parametrize("N, chunk_size", [(19, 4), (6, 1), (5, 16)])
def test_returns_what_only_a_chunked_form_has(chunkwise, N, chunk_size):
    """The state as each chunk starts, each chunk's scores and WY factors, a row per token: the chunked
    algorithm's own quantities, which a token-by-token loop never forms (tests/exercises/chunk_checks.py)."""
    x = make_inputs(2, N, 2, 6, 5, gate="channel", gate_range=(0.5, 0.999), beta_range=(0.1, 0.9), seed=N)
    assert_chunk_quantities(chunkwise(x.q, x.k, x.v, x.g, x.beta, chunk_size), x, chunk_size)
