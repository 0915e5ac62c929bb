"""Tests of exercise s06.intra_gradients: the library's kernels before it (stage 5's prepare, then
stage 6's chunk_states, state_gradients and state_products), then the intra-chunk program under test;
its dq, dk, dv, dg and dbeta against the complex-step derivative of KDA (oracle.py)."""

import numpy as np
import pytest

from stages.s05_fast_kda.reference import prepare
from stages.s06_backward.reference import chunk_states, state_gradients, state_products
from tests.exercises.library_values import from_library
from tests.exercises.s06_backward.oracle import assert_gradients_close, backward_inputs, gradients

STAGE = "s06_backward"
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta")


@pytest.fixture
def intra_gradients(target_module):
    return target_module(STAGE, "intra_gradients.py").intra_gradients


def _arguments(x, do, S_0, dS_N, chunk_size, sub_block, block_dv):
    """The library's kernels before the intra-chunk one, in the backward's order (N a multiple of
    chunk_size); returns the intra-chunk program's arguments."""
    tensors = from_library(prepare, x.q, x.k, x.v, x.g, x.beta, chunk_size, sub_block)
    states = from_library(chunk_states, tensors, block_dv, S_0)
    state_grads = from_library(state_gradients, tensors, do, block_dv, dS_N)
    products = from_library(state_products, tensors, states, state_grads, do)
    return (x.q, x.k, x.v, x.g, x.beta, do, states.v_new, state_grads.dv_new, products, chunk_size, sub_block)


@pytest.mark.parametrize("B, N, H, d_k, d_v, chunk_size, sub_block, block_dv", [
    (1, 8, 1, 4, 3, 8, 8, 3),  # one chunk, one sub-block
    (1, 16, 2, 4, 4, 8, 4, 2),  # two chunks of two sub-blocks: the slabs
    (2, 24, 1, 5, 3, 8, 2, 1),  # three chunks of four sub-blocks
    (1, 6, 1, 4, 3, 1, 1, 3),  # chunks of one token
])
def test_matches_complex_step(intra_gradients, B, N, H, d_k, d_v, chunk_size, sub_block, block_dv):
    x, do, S_0, dS_N = backward_inputs(B, N, H, d_k, d_v, seed=N + sub_block)
    actual = dict(zip(GRADIENTS, intra_gradients(*_arguments(x, do, S_0, dS_N, chunk_size, sub_block, block_dv))))
    assert_gradients_close(actual, gradients(x.q, x.k, x.v, x.g, x.beta, do, S_0, dS_N), GRADIENTS,
                           chunk_size=chunk_size)


def test_inputs_unchanged(intra_gradients):
    x, do, S_0, dS_N = backward_inputs(1, 16, 1, 4, 3, seed=3)
    arguments = _arguments(x, do, S_0, dS_N, 8, 4, 3)
    arrays = arguments[:8]
    before = [a.copy() for a in arrays]
    intra_gradients(*arguments)
    for original, after in zip(before, arrays):
        assert np.array_equal(original, after), "an input changed during the call"


def test_strong_gates_at_full_chunk_length(intra_gradients):
    """Every other key channel at g = -50 per token over chunks of 16 (sub-blocks of 2, whose anchored
    factors stay within e^50): every gradient finite and right."""
    from tests.exercises.strong_gates import STRONG_CHUNK, STRONG_LOG_GATE, assert_finite

    x, do, S_0, dS_N = backward_inputs(1, 2 * STRONG_CHUNK, 1, 4, 3, seed=50)
    x.g[..., ::2] = STRONG_LOG_GATE
    actual = dict(zip(GRADIENTS, intra_gradients(*_arguments(x, do, S_0, dS_N, STRONG_CHUNK, 2, 3))))
    for name in GRADIENTS:
        assert_finite(actual[name], f"every other key channel ({name})")
    assert_gradients_close(actual, gradients(x.q, x.k, x.v, x.g, x.beta, do, S_0, dS_N), GRADIENTS,
                           chunk_size=STRONG_CHUNK)
