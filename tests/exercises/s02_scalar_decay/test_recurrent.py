"""Tests of exercise s02.recurrent: reference A against the quadratic form with a decay per head."""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.oracles import causal_linear_attention, scalar_decay_attention

STAGE = "s02_scalar_decay"


@pytest.fixture
def recurrent(target_module):
    return target_module(STAGE, "recurrent.py").recurrent


def test_first_token_sees_itself_undecayed(recurrent):
    x = make_inputs(1, 1, 1, 4, 3, gate="head", gate_range=(0.5, 0.6), seed=1)
    expected = (x.q[0, 0, 0] @ x.k[0, 0, 0]) * x.v[0, 0, 0]
    assert_close(recurrent(x.q, x.k, x.v, x.g)[0, 0, 0], expected, rtol=1e-12, name="o of the first token", axes=("channel",))


@pytest.mark.parametrize("B, N, H, d_k, d_v", [(1, 5, 1, 4, 4), (2, 17, 3, 8, 5)])
def test_matches_quadratic_form(recurrent, B, N, H, d_k, d_v):
    x = make_inputs(B, N, H, d_k, d_v, gate="head", gate_range=(0.5, 0.99), seed=2)
    expected = scalar_decay_attention(x.q, x.k, x.v, x.g)
    assert_close(recurrent(x.q, x.k, x.v, x.g), expected, rel_l2=1e-12)


def test_no_decay_is_linear_attention(recurrent):
    x = make_inputs(2, 9, 2, 4, 3, seed=3)
    actual = recurrent(x.q, x.k, x.v, np.zeros(2))
    assert_close(actual, causal_linear_attention(x.q, x.k, x.v), rel_l2=1e-12)


def test_alpha_near_zero_keeps_only_the_current_token(recurrent):
    """alpha = e^-50: the state forgets everything but the token just written, o_t = (q_t . k_t) v_t."""
    x = make_inputs(1, 6, 2, 4, 3, seed=4)
    expected = np.einsum("bthd,bthd->bth", x.q, x.k)[..., None] * x.v
    actual = recurrent(x.q, x.k, x.v, np.full(2, -50.0))
    assert_close(actual, expected, rel_l2=1e-12)


def test_rejects_mismatched_shapes(recurrent):
    x = make_inputs(1, 4, 2, 4, 4, gate="head", seed=5)
    with pytest.raises(ValueError, match="k"):
        recurrent(x.q, x.k[:, :3], x.v, x.g)
    with pytest.raises(ValueError, match="g must have shape"):
        recurrent(x.q, x.k, x.v, np.zeros((1, 4, 2)))
