"""Tests of exercise s04.kernel_mirror: reference C against the delta-rule form of KDA
(stages/common/oracles.py), on inputs where no catalog bug hides: gates that differ by channel, random beta,
several chunks, several blocks of value columns."""

import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.oracles import kda_delta_rule
from tests.exercises.strong_gates import STRONG_CHUNK, STRONG_LOG_GATE, assert_finite

STAGE = "s04_kda"


@pytest.fixture
def kernel_mirror(target_module):
    return target_module(STAGE, "kernel_mirror.py").kernel_mirror


def _inputs(N, seed):
    return make_inputs(2, N, 3, 4, 6, gate="channel", gate_range=(0.5, 0.999), beta_range=(0.1, 0.9), seed=seed)


@pytest.mark.parametrize(
    "N, chunk_size, block_dv",
    [
        (8, 8, 6),  # one chunk, one block of value columns
        (32, 8, 6),  # many chunks: the state must carry over
        (32, 8, 2),  # three blocks of value columns
        (21, 8, 3),  # N padded up to a multiple of chunk_size
    ],
)
def test_matches_delta_rule_form(kernel_mirror, N, chunk_size, block_dv):
    x = _inputs(N, seed=N + block_dv)
    actual = kernel_mirror(x.q, x.k, x.v, x.g, x.beta, chunk_size, block_dv)
    assert_close(actual, kda_delta_rule(x.q, x.k, x.v, x.g, x.beta), rel_l2=1e-12, chunk_size=chunk_size)


@pytest.mark.parametrize("sub_chunk_size", [1, 2, 4])
def test_sub_chunks_match_delta_rule_form(kernel_mirror, sub_chunk_size):
    x = _inputs(24, seed=5)
    actual = kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 8, 3, sub_chunk_size=sub_chunk_size)
    assert_close(actual, kda_delta_rule(x.q, x.k, x.v, x.g, x.beta), rel_l2=1e-12, chunk_size=8)


def test_independent_of_block_dv(kernel_mirror):
    x = _inputs(24, seed=6)
    by_block = [kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 8, block_dv) for block_dv in (1, 2, 3, 6)]
    for other in by_block[1:]:
        assert_close(other, by_block[0], rel_l2=1e-14, chunk_size=8, name="the output with another block_dv")


def test_rejects_block_dv_that_does_not_divide_d_v(kernel_mirror):
    x = _inputs(8, seed=7)
    with pytest.raises(ValueError, match="block_dv"):
        kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 4, 4)


def test_strong_gates_at_full_chunk_length(kernel_mirror):
    x = make_inputs(1, 3 * STRONG_CHUNK, 2, 4, 6, gate="channel", gate_range=(0.5, 0.999), beta_range=(0.1, 0.9), seed=50)
    x.g[..., ::2] = STRONG_LOG_GATE  # every other key channel forgets at every token
    # sub-chunks of 2 keys keep the exponent split's e^{origin - gamma} within float64 (at most e^100):
    # a whole chunk's split would overflow by design, the reason for stage 4's gate lower bound
    actual = kernel_mirror(x.q, x.k, x.v, x.g, x.beta, STRONG_CHUNK, 3, sub_chunk_size=2)
    assert_finite(actual, "every other key channel")
    assert_close(actual, kda_delta_rule(x.q, x.k, x.v, x.g, x.beta), rel_l2=1e-12, chunk_size=STRONG_CHUNK)
