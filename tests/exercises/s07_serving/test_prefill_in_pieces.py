"""Tests of exercise s07.prefill_in_pieces: pieces of any sizes through a forward pass with a state
in and out (the delta-rule form of KDA), against one pass over the whole prompt."""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.oracles import kda_delta_rule_from_state
from tests.exercises.s05_fast_kda.oracle import kda_delta_rule

STAGE = "s07_serving"


@pytest.fixture
def prefill_in_pieces(target_module):
    return target_module(STAGE, "prefill_in_pieces.py").prefill_in_pieces


@pytest.mark.parametrize("pieces, d_v", [((1, 3, 20, 16, 24), 4), ((30, 34), 5), ((64,), 4), ((0, 9, 0, 55), 4)])
def test_pieces_equal_one_pass(prefill_in_pieces, pieces, d_v):
    """Every output and the state after the last token, from a nonzero initial state (d_k = d_v = 4,
    where a state of the wrong layout still has the right shape, and d_v = 5)."""
    x = make_inputs(2, 64, 2, 4, d_v, gate="channel", gate_range=(0.5, 1.0), beta_range=(0.1, 0.9), seed=sum(pieces))
    S0 = np.random.default_rng(len(pieces)).standard_normal((2, 2, 4, d_v))
    expected_o, expected_state = kda_delta_rule(x.q, x.k, x.v, x.g, x.beta, S0)
    o, state = prefill_in_pieces(kda_delta_rule_from_state, x.q, x.k, x.v, x.g, x.beta, list(pieces), initial_state=S0)
    assert_close(o, expected_o, rel_l2=1e-12)
    assert_close(state, expected_state, rel_l2=1e-12, name="the state after the last piece",
                 axes=("batch", "head", "key channel", "value channel"))


def test_inputs_unchanged(prefill_in_pieces):
    """The initial state and every input come back as they went in: a server keeps the prompt's state
    of before the prefill (a retried request starts from it again)."""
    x = make_inputs(1, 24, 2, 4, 3, gate="channel", gate_range=(0.5, 1.0), beta_range=(0.1, 0.9), seed=3)
    S0 = np.random.default_rng(3).standard_normal((1, 2, 4, 3))
    inputs = [x.q, x.k, x.v, x.g, x.beta, S0]
    before = [a.copy() for a in inputs]
    prefill_in_pieces(kda_delta_rule_from_state, *inputs[:5], [10, 14], initial_state=S0)
    for name, original, after in zip(("q", "k", "v", "g", "beta", "initial_state"), before, inputs):
        assert np.array_equal(original, after), f"{name} changed during the call"
