"""Tests of exercise s01.recurrent: reference A against the quadratic form of linear attention."""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.oracles import causal_linear_attention

STAGE = "s01_linear_attention"


@pytest.fixture
def recurrent(target_module):
    return target_module(STAGE, "recurrent.py").recurrent


def test_first_token_sees_itself(recurrent):
    x = make_inputs(1, 1, 1, 4, 3, seed=1)
    expected = (x.q[0, 0, 0] @ x.k[0, 0, 0]) * x.v[0, 0, 0]
    assert_close(recurrent(x.q, x.k, x.v)[0, 0, 0], expected, rtol=1e-12, name="o of the first token", axes=("channel",))


@pytest.mark.parametrize("B, N, H, d_k, d_v", [(1, 5, 1, 4, 4), (2, 17, 3, 8, 5)])
def test_matches_quadratic_form(recurrent, B, N, H, d_k, d_v):
    x = make_inputs(B, N, H, d_k, d_v, seed=2)
    assert_close(recurrent(x.q, x.k, x.v), causal_linear_attention(x.q, x.k, x.v), rel_l2=1e-12)


def test_rejects_mismatched_shapes(recurrent):
    x = make_inputs(1, 4, 2, 4, 4, seed=3)
    with pytest.raises(ValueError, match="k"):
        recurrent(x.q, x.k[:, :3], x.v)
