"""Tests of exercise s06.recurrent_backward: reference A's gradients against the complex-step
derivative of the delta-rule form of KDA (oracle.py), with gates down to 0.5, beta at 0 and 1."""

import numpy as np
import pytest

from tests.exercises.s06_backward.oracle import assert_gradients_close, backward_inputs, gradients

STAGE = "s06_backward"
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state")


@pytest.fixture
def recurrent_backward(target_module):
    return target_module(STAGE, "recurrent_backward.py").recurrent_backward


@pytest.mark.parametrize("B, N, H, d_k, d_v, with_states", [
    (1, 6, 1, 4, 3, True),  # S_0 and dLoss/dS_N given
    (2, 9, 2, 5, 4, True),  # batches and heads
    (1, 7, 2, 3, 5, False),  # from S_0 = 0, the output's gradient only; d_v > d_k
])
def test_matches_complex_step(recurrent_backward, B, N, H, d_k, d_v, with_states):
    x, do, S_0, dS_N = backward_inputs(B, N, H, d_k, d_v, seed=N + d_k)
    S_0, dS_N = (S_0, dS_N) if with_states else (None, None)
    result = recurrent_backward(x.q, x.k, x.v, x.g, x.beta, do, S_0, dS_N)
    assert_gradients_close(result._asdict(), gradients(x.q, x.k, x.v, x.g, x.beta, do, S_0, dS_N), GRADIENTS)


def test_forward_outputs(recurrent_backward):
    """o and the final state come back too, as the forward's."""
    from tests.exercises.s06_backward.oracle import kda_forward

    x, do, S_0, _ = backward_inputs(1, 5, 2, 4, 3, seed=2)
    o, final_state = kda_forward(*(a[None] for a in (x.q, x.k, x.v, x.g, x.beta, S_0)))
    result = recurrent_backward(x.q, x.k, x.v, x.g, x.beta, do, S_0)
    assert_gradients_close({"o": result.o, "final_state": result.final_state},
                           {"o": o[0], "final_state": final_state[0]}, ("o", "final_state"))


def test_inputs_unchanged_and_a_second_call_agrees(recurrent_backward):
    x, do, S_0, dS_N = backward_inputs(1, 6, 2, 4, 3, seed=4)
    arguments = (x.q, x.k, x.v, x.g, x.beta, do, S_0, dS_N)
    before = [a.copy() for a in arguments]
    first = recurrent_backward(*arguments)
    second = recurrent_backward(*arguments)
    for original, after in zip(before, arguments):
        assert np.array_equal(original, after), "an input changed during the call"
    for name in GRADIENTS:
        assert np.array_equal(getattr(first, name), getattr(second, name)), f"{name} differs between two calls"
