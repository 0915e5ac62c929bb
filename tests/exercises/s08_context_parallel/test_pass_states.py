"""Tests of exercise s08.pass_states: one sequence cut into ranks of uneven lengths, each rank's map and
final state from zero made here from the tokens (the map as a product of the tokens' factors, the
states by the delta-rule form of KDA); the pass must give every rank the state one pass over the whole
sequence has at the rank's first token, and the state after the last token."""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from tests.exercises.s05_fast_kda.oracle import kda_delta_rule

STAGE = "s08_context_parallel"
STATE_AXES = ("head", "key channel", "value channel")


@pytest.fixture
def pass_states(target_module):
    return target_module(STAGE, "pass_states.py").pass_states


def token_map(k, g, beta):
    """F_t = (I - beta_t k_t k_t^T) Diag(a_t) per head, (H, d_k, d_k): one token's action on S^T."""
    d_k = k.shape[-1]
    return np.stack([(np.eye(d_k) - b * np.outer(key, key)) @ np.diag(np.exp(gate)) for key, gate, b in zip(k, g, beta)])


def rank_summaries(x, boundaries):
    """(A_r, Z_r) of each rank: the product of its tokens' factors, the later token on the left, and
    its final state from zero."""
    H, d_k = x.q.shape[2], x.q.shape[3]
    transitions, zero_states = [], []
    for start, end in zip(boundaries[:-1], boundaries[1:]):
        A = np.tile(np.eye(d_k), (H, 1, 1))
        for t in range(start, end):
            A = token_map(x.k[0, t], x.g[0, t], x.beta[0, t]) @ A
        transitions.append(A)
        zero_states.append(kda_delta_rule(*(a[:, start:end] for a in (x.q, x.k, x.v, x.g, x.beta)))[1][0])
    return np.stack(transitions), np.stack(zero_states)


def one_pass_states(x, boundaries, initial_state):
    """The state one pass over the whole sequence has before each rank's first token, and at the end."""
    states = [kda_delta_rule(*(a[:, :end] for a in (x.q, x.k, x.v, x.g, x.beta)), initial_state[None])[1][0]
              for end in boundaries]
    return states[:-1], states[-1]


def check(incoming, final, expected_incoming, expected_final):
    assert len(incoming) == len(expected_incoming), f"got {len(incoming)} incoming states for {len(expected_incoming)} ranks"
    for r, (state, expected) in enumerate(zip(incoming, expected_incoming)):
        assert_close(np.asarray(state), expected, rel_l2=1e-12, name=f"the state rank {r} starts from", axes=STATE_AXES)
    assert_close(np.asarray(final), expected_final, rel_l2=1e-12, name="the state after the last rank", axes=STATE_AXES)


@pytest.mark.parametrize("boundaries, d_v", [((0, 5, 6, 17, 30), 4), ((0, 9, 21, 30), 3), ((0, 30), 4), ((0, 15, 30), 4)],
                         ids=["four ranks", "d_v != d_k", "one rank", "two ranks"])
def test_each_rank_starts_where_one_pass_is(pass_states, boundaries, d_v):
    """Strong per-channel gates (a in [0.5, 1]) and beta in [0, 1], from a nonzero initial state."""
    x = make_inputs(1, 30, 2, 4, d_v, gate="channel", gate_range=(0.5, 1.0), beta_range=(0.0, 1.0), seed=len(boundaries))
    S0 = np.random.default_rng(d_v).standard_normal((2, 4, d_v))
    transitions, zero_states = rank_summaries(x, boundaries)
    incoming, final = pass_states(transitions, zero_states, S0)
    check(incoming, final, *one_pass_states(x, boundaries, S0))


def test_two_ranks_from_zero(pass_states):
    """The split a first test would try: two ranks and no initial state. Rank 1 starts from rank 0's
    final state, and the state after it is rank 1's tokens applied to that."""
    x = make_inputs(1, 20, 2, 4, 4, gate="channel", gate_range=(0.5, 1.0), beta_range=(0.0, 1.0), seed=5)
    transitions, zero_states = rank_summaries(x, (0, 8, 20))
    incoming, final = pass_states(transitions, zero_states, np.zeros((2, 4, 4)))
    check(incoming, final, *one_pass_states(x, (0, 8, 20), np.zeros((2, 4, 4))))


def test_a_rank_whose_sequence_begins_on_it_forgets_the_state(pass_states):
    """A packed batch where rank 1's last sequence begins on it: its map is zero, so rank 2 starts from
    that sequence's state alone (rank 1's Z), whatever ranks 0 and 1 received."""
    x = make_inputs(1, 24, 2, 4, 4, gate="channel", gate_range=(0.5, 1.0), beta_range=(0.0, 1.0), seed=9)
    S0 = np.random.default_rng(9).standard_normal((2, 4, 4))
    transitions, zero_states = rank_summaries(x, (0, 8, 16, 24))
    transitions[1] = 0.0
    incoming, final = pass_states(transitions, zero_states, S0)
    expected = [S0, transitions[0] @ S0 + zero_states[0], zero_states[1]]
    check(incoming, final, expected, transitions[2] @ zero_states[1] + zero_states[2])


def test_inputs_unchanged(pass_states):
    """The maps, the zero-start states and the initial state come back as they went in: the
    distributed implementation passes its own summaries, and still needs them after the pass."""
    x = make_inputs(1, 12, 2, 4, 3, gate="channel", gate_range=(0.5, 1.0), beta_range=(0.0, 1.0), seed=2)
    transitions, zero_states = rank_summaries(x, (0, 4, 7, 12))
    S0 = np.random.default_rng(2).standard_normal((2, 4, 3))
    inputs = [transitions, zero_states, S0]
    before = [a.copy() for a in inputs]
    pass_states(*inputs)
    for name, original, after in zip(("transitions", "zero_states", "initial_state"), before, inputs):
        assert np.array_equal(original, after), f"{name} changed during the call"
