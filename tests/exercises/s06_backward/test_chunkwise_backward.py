"""Tests of exercise s06.chunkwise_backward: reference B's gradients against the complex-step derivative
of the delta-rule form of KDA (oracle.py), at one chunk and many, a short last chunk, chunks of one
token, gates down to 0.5 and beta at 0 and 1."""

import numpy as np
import pytest

from stages.common.compare import assert_close
from tests.exercises.s06_backward.oracle import assert_gradients_close, backward_inputs, gradients, score_gradients

STAGE = "s06_backward"
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state")
SCORE_GRADIENTS = ("dA_qk", "dM")


@pytest.fixture
def chunkwise_backward(target_module):
    return target_module(STAGE, "chunkwise_backward.py").chunkwise_backward


@pytest.mark.parametrize("B, N, H, d_k, d_v, chunk_size", [
    (1, 8, 1, 4, 3, 8),  # one chunk
    (2, 11, 2, 5, 3, 4),  # three chunks, the last one short
    (1, 12, 2, 4, 4, 3),  # four chunks
    (1, 5, 1, 3, 2, 8),  # a chunk longer than the sequence
    (1, 6, 2, 4, 3, 1),  # chunks of one token: T = I, M = 0
])
def test_matches_complex_step(chunkwise_backward, B, N, H, d_k, d_v, chunk_size):
    x, do, S_0, dS_N = backward_inputs(B, N, H, d_k, d_v, seed=N + chunk_size)
    result = chunkwise_backward(x.q, x.k, x.v, x.g, x.beta, do, chunk_size, S_0, dS_N)
    assert_gradients_close(result._asdict(), gradients(x.q, x.k, x.v, x.g, x.beta, do, S_0, dS_N), GRADIENTS,
                           chunk_size=chunk_size)


def test_gentle_gates_and_no_states(chunkwise_backward):
    """The benchmark's gates [0.9, 0.999], S_0 = 0 and no gradient for S_N: the output's gradient alone."""
    x, do, _, _ = backward_inputs(1, 16, 1, 8, 4, seed=5, gate_range=(0.9, 0.999))
    result = chunkwise_backward(x.q, x.k, x.v, x.g, x.beta, do, 8)
    assert_gradients_close(result._asdict(), gradients(x.q, x.k, x.v, x.g, x.beta, do), GRADIENTS, chunk_size=8)


def test_inputs_unchanged_and_a_second_call_agrees(chunkwise_backward):
    x, do, S_0, dS_N = backward_inputs(1, 10, 2, 4, 3, seed=4)
    arguments = (x.q, x.k, x.v, x.g, x.beta, do, 4, S_0, dS_N)
    before = [np.copy(a) for a in arguments]
    first = chunkwise_backward(*arguments)
    second = chunkwise_backward(*arguments)
    for original, after in zip(before, arguments):
        assert np.array_equal(original, after), "an input changed during the call"
    for name in GRADIENTS:
        assert np.array_equal(getattr(first, name), getattr(second, name)), f"{name} differs between two calls"


def test_strong_gates_at_full_chunk_length(chunkwise_backward):
    """Every other key channel at g = -50 per token over chunks of 16: a decay formed above the
    diagonal (e^{+750}) overflows, and a product with a 0/1 mask makes it NaN."""
    from tests.exercises.strong_gates import STRONG_CHUNK, STRONG_LOG_GATE, assert_finite

    x, do, S_0, dS_N = backward_inputs(1, 2 * STRONG_CHUNK, 1, 4, 3, seed=50)
    x.g[..., ::2] = STRONG_LOG_GATE
    result = chunkwise_backward(x.q, x.k, x.v, x.g, x.beta, do, STRONG_CHUNK, S_0, dS_N)
    for name in GRADIENTS:
        assert_finite(getattr(result, name), f"every other key channel ({name})")
    assert_gradients_close(result._asdict(), gradients(x.q, x.k, x.v, x.g, x.beta, do, S_0, dS_N), GRADIENTS,
                           chunk_size=STRONG_CHUNK)


@pytest.mark.parametrize("B, N, H, d_k, d_v, chunk_size", [
    (2, 11, 2, 5, 3, 4),  # three chunks, the last one short
    (1, 5, 1, 3, 2, 8),  # a chunk longer than the sequence
    (1, 6, 2, 4, 3, 1),  # chunks of one token: M = 0
])
def test_returns_what_only_a_chunked_form_has(chunkwise_backward, B, N, H, d_k, d_v, chunk_size):
    """dLoss/dA_qk and dLoss/dM of every chunk, a row per token, against the complex step through the
    chunk's forward (oracle.score_gradients): a token-by-token backward forms neither."""
    x, do, S_0, dS_N = backward_inputs(B, N, H, d_k, d_v, seed=N + chunk_size)
    result = chunkwise_backward(x.q, x.k, x.v, x.g, x.beta, do, chunk_size, S_0, dS_N)
    missing = [name for name in SCORE_GRADIENTS if not hasattr(result, name)]
    assert not missing, (f"chunkwise_backward returned a {type(result).__name__} without {', '.join(missing)}: it "
                         "returns a ChunkwiseGradients, the gradients with those of every chunk's scores")
    expected = score_gradients(x.q, x.k, x.v, x.g, x.beta, do, chunk_size, S_0, dS_N)
    for name in SCORE_GRADIENTS:
        assert_close(getattr(result, name), expected[name], rel_l2=1e-12, chunk_size=chunk_size,
                     name=f"{name} (a token-by-token backward never forms it: reference B is the chunked algorithm)",
                     axes=("batch", "token", "head", "column of the chunk"))
