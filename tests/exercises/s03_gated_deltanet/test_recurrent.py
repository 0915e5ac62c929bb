"""Tests of exercise s03.recurrent: reference A against the delta rule in its prediction-error form."""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.oracles import delta_rule

STAGE = "s03_gated_deltanet"


@pytest.fixture
def recurrent(target_module):
    return target_module(STAGE, "recurrent.py").recurrent


def _inputs(B, N, H, d_k, d_v, seed):
    return make_inputs(B, N, H, d_k, d_v, gate="token", gate_range=(0.8, 0.99), beta_range=(0.1, 0.9), seed=seed)


def test_first_token(recurrent):
    """From a zero state the first token writes beta v k^T, undecayed: o_0 = beta (q . k) v."""
    x = _inputs(1, 1, 1, 4, 3, seed=1)
    expected = x.beta[0, 0, 0] * (x.q[0, 0, 0] @ x.k[0, 0, 0]) * x.v[0, 0, 0]
    assert_close(recurrent(x.q, x.k, x.v, x.g, x.beta)[0, 0, 0], expected, rtol=1e-12, name="o of the first token", axes=("channel",))


@pytest.mark.parametrize("B, N, H, d_k, d_v", [(1, 5, 1, 4, 4), (2, 17, 3, 8, 5)])
def test_matches_delta_rule(recurrent, B, N, H, d_k, d_v):
    x = _inputs(B, N, H, d_k, d_v, seed=2)
    expected = delta_rule(x.q, x.k, x.v, x.beta, x.g)
    assert_close(recurrent(x.q, x.k, x.v, x.g, x.beta), expected, rel_l2=1e-12)


def test_g_zero_is_deltanet(recurrent):
    x = _inputs(2, 12, 2, 6, 4, seed=3)
    expected = delta_rule(x.q, x.k, x.v, x.beta)
    assert_close(recurrent(x.q, x.k, x.v, np.zeros_like(x.g), x.beta), expected, rel_l2=1e-12)


def test_rejects_mismatched_shapes(recurrent):
    x = _inputs(1, 4, 2, 4, 4, seed=4)
    with pytest.raises(ValueError, match="k"):
        recurrent(x.q, x.k[:, :3], x.v, x.g, x.beta)
    with pytest.raises(ValueError, match="beta"):
        recurrent(x.q, x.k, x.v, x.g, x.beta[:, :3])
