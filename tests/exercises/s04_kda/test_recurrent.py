"""Tests of exercise s04.recurrent: reference A against the delta-rule form of KDA (stages/common/oracles.py)."""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.oracles import kda_delta_rule

STAGE = "s04_kda"


@pytest.fixture
def recurrent(target_module):
    return target_module(STAGE, "recurrent.py").recurrent


def _inputs(B, N, H, d_k, d_v, seed):
    return make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=(0.5, 0.999), beta_range=(0.1, 0.9), seed=seed)


def test_first_token_writes_beta_v_k(recurrent):
    """S_0 = 0, so S_1 = beta_1 v_1 k_1^T whatever the gate: o_1 = beta_1 (q_1 . k_1) v_1."""
    x = _inputs(1, 1, 1, 4, 3, seed=1)
    expected = x.beta[0, 0, 0] * (x.q[0, 0, 0] @ x.k[0, 0, 0]) * x.v[0, 0, 0]
    assert_close(recurrent(x.q, x.k, x.v, x.g, x.beta)[0, 0, 0], expected, rtol=1e-12, name="o of the first token", axes=("channel",))


@pytest.mark.parametrize("B, N, H, d_k, d_v", [(1, 5, 1, 4, 4), (2, 17, 3, 8, 5)])
def test_matches_delta_rule_form(recurrent, B, N, H, d_k, d_v):
    x = _inputs(B, N, H, d_k, d_v, seed=2)
    expected = kda_delta_rule(x.q, x.k, x.v, x.g, x.beta)
    assert_close(recurrent(x.q, x.k, x.v, x.g, x.beta), expected, rel_l2=1e-12)


def test_rejects_mismatched_shapes(recurrent):
    x = _inputs(1, 4, 2, 4, 4, seed=3)
    with pytest.raises(ValueError, match="k"):
        recurrent(x.q, x.k[:, :3], x.v, x.g, x.beta)
    with pytest.raises(ValueError, match="g must have shape"):
        recurrent(x.q, x.k, x.v, x.g[..., 0], x.beta)
