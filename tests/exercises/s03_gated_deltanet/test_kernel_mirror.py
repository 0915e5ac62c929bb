"""Tests of exercise s03.kernel_mirror: reference C against the delta rule in its prediction-error form.

beta is random and the gates are well below 1 on every input, with several chunks and several blocks of
value columns: equal beta, g = 0 or a single chunk would hide some of the catalog's bugs."""

import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.oracles import delta_rule
from tests.exercises.strong_gates import STRONG_CHUNK, STRONG_LOG_GATE, assert_finite

STAGE = "s03_gated_deltanet"


@pytest.fixture
def kernel_mirror(target_module):
    return target_module(STAGE, "kernel_mirror.py").kernel_mirror


def _inputs(N, seed):
    return make_inputs(2, N, 3, 4, 6, gate="token", gate_range=(0.8, 0.99), beta_range=(0.1, 0.9), seed=seed)


@pytest.mark.parametrize(
    "N, chunk_size, block_dv",
    [
        (8, 8, 6),  # one chunk, one block of value columns
        (32, 8, 6),  # many chunks: the state must carry over, decayed
        (32, 8, 2),  # three blocks of value columns
        (21, 8, 3),  # N padded up to a multiple of chunk_size
    ],
)
def test_matches_delta_rule(kernel_mirror, N, chunk_size, block_dv):
    x = _inputs(N, seed=N + block_dv)
    actual = kernel_mirror(x.q, x.k, x.v, x.g, x.beta, chunk_size, block_dv)
    assert_close(actual, delta_rule(x.q, x.k, x.v, x.beta, x.g), rel_l2=1e-12, chunk_size=chunk_size)


def test_independent_of_block_dv(kernel_mirror):
    x = _inputs(24, seed=5)
    by_block = [kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 8, block_dv) for block_dv in (1, 2, 3, 6)]
    for other in by_block[1:]:
        assert_close(other, by_block[0], rel_l2=1e-14, chunk_size=8, name="the output with another block_dv")


def test_rejects_block_dv_that_does_not_divide_d_v(kernel_mirror):
    x = _inputs(8, seed=6)
    with pytest.raises(ValueError, match="block_dv"):
        kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 4, 4)


def test_strong_gates_at_full_chunk_length(kernel_mirror):
    x = make_inputs(1, 3 * STRONG_CHUNK, 2, 4, 6, gate="token", gate_range=(0.8, 0.99), beta_range=(0.1, 0.9), seed=50)
    x.g[:, :, 0] = STRONG_LOG_GATE  # head 0 forgets at every token; head 1 keeps its gates
    actual = kernel_mirror(x.q, x.k, x.v, x.g, x.beta, STRONG_CHUNK, 3)
    assert_finite(actual, "head 0")
    assert_close(actual, delta_rule(x.q, x.k, x.v, x.beta, x.g), rel_l2=1e-12, chunk_size=STRONG_CHUNK)
