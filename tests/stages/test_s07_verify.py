"""Stage 7's verify pass of speculative decoding: `verify_step` runs T drafted tokens per sequence from
the state in its slot and keeps the state after each; `accept_drafts` keeps, per sequence, the state
after the drafts it accepted. Checked against stage 6's reference A (its own initial-state code, the
paper layout), run on each sequence alone: the outputs of all T drafts, the state kept for 0, some and
all drafts accepted, a decode step after it; the pool's other slots untouched; bad inputs refused
before the pool is written."""

import numpy as np
import pytest

from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.s06_backward.reference import recurrent_backward
from stages.s07_serving.reference import accept_drafts, decode_step, verify_step

B, T, H, D_K, D_V, P = 3, 4, 2, 5, 3, 6
SLOTS = np.array([4, 1, 3])  # scattered, not the batch's order
ACCEPTED = np.array([2, 0, 4])  # some drafts, none, all


def _drafts(seed=0, T=T):
    """T drafted tokens per sequence: strong gates (a down to 0.3), beta in [0, 1] with entries 0 and 1."""
    x = make_inputs(B, T, H, D_K, D_V, gate="channel", gate_range=(0.3, 1.0), beta_range=(0.0, 1.0), seed=seed)
    x.beta[:, 1::3] = 0.0
    x.beta[:, 2::3] = 1.0
    return x


def _pool(seed=1):
    return np.random.default_rng(seed).standard_normal((P, H, D_K, D_V))


def _alone(x, b, tokens, state):
    """Sequence b's first `tokens` drafts alone through stage 6's reference A from `state` (H, d_k, d_v):
    (o (tokens, H, d_v), the state after them)."""
    drafts = (a[b:b + 1, :tokens] for a in (x.q, x.k, x.v, x.g, x.beta))
    alone = recurrent_backward(*drafts, np.zeros((1, tokens, H, D_V)), state[None])
    return alone.o[0], alone.final_state[0]


def test_verify_returns_every_draft_and_the_state_after_each_without_writing_the_pool():
    x, pool = _drafts(), _pool()
    before = pool.copy()
    o, drafted_states = verify_step(x.q, x.k, x.v, x.g, x.beta, pool, SLOTS)
    assert o.shape == (B, T, H, D_V) and drafted_states.shape == (B, T, H, D_K, D_V)
    assert np.array_equal(pool, before), "verify_step wrote the pool before the drafts were accepted"
    for b in range(B):
        for tokens in range(1, T + 1):
            expected_o, expected_state = _alone(x, b, tokens, before[SLOTS[b]])
            assert error_report(drafted_states[b, tokens - 1], expected_state).rel_l2 <= 1e-12, (b, tokens)
        assert error_report(o[b], expected_o).rel_l2 <= 1e-12, b


def test_accepting_drafts_keeps_the_state_after_them_and_decoding_goes_on_from_there():
    """Sequence 0 accepts 2 drafts, 1 none, 2 all: each slot holds the state after those tokens alone, a
    decode step from it equals one pass over the accepted drafts and the next token, other slots unchanged."""
    x, pool = _drafts(seed=2), _pool(seed=3)
    before = pool.copy()
    _, drafted_states = verify_step(x.q, x.k, x.v, x.g, x.beta, pool, SLOTS)
    accept_drafts(pool, SLOTS, drafted_states, ACCEPTED)
    for b, (slot, accepted) in enumerate(zip(SLOTS, ACCEPTED)):
        if accepted == 0:
            assert np.array_equal(pool[slot], before[slot]), "no draft accepted: the state must stay as it was"
        else:
            expected = _alone(x, b, accepted, before[slot])[1]
            assert error_report(pool[slot], expected).rel_l2 <= 1e-12, b
    others = [s for s in range(P) if s not in SLOTS]
    assert np.array_equal(pool[others], before[others]), "a slot of another sequence changed"

    following = make_inputs(B, 1, H, D_K, D_V, gate="channel", gate_range=(0.3, 1.0), seed=4)
    o_next = decode_step(*(a[:, 0] for a in (following.q, following.k, following.v, following.g, following.beta)),
                         pool, SLOTS)
    for b, (slot, accepted) in enumerate(zip(SLOTS, ACCEPTED)):
        tokens = [np.concatenate([a[b:b + 1, :accepted], n[b:b + 1]], axis=1)
                  for a, n in zip((x.q, x.k, x.v, x.g, x.beta),
                                  (following.q, following.k, following.v, following.g, following.beta))]
        expected = recurrent_backward(*tokens, np.zeros((1, accepted + 1, H, D_V)), before[slot][None]).o[0, -1]
        assert error_report(o_next[b], expected).rel_l2 <= 1e-12, b


def test_one_draft_accepted_is_one_decode_step():
    x, pool = _drafts(seed=5, T=1), _pool(seed=6)
    stepped = pool.copy()
    o, drafted_states = verify_step(x.q, x.k, x.v, x.g, x.beta, pool, SLOTS)
    accept_drafts(pool, SLOTS, drafted_states, np.ones(B, dtype=np.int64))
    o_step = decode_step(*(a[:, 0] for a in (x.q, x.k, x.v, x.g, x.beta)), stepped, SLOTS)
    assert np.array_equal(o[:, 0], o_step) and np.array_equal(pool, stepped)


@pytest.mark.parametrize("accepted, message", [
    (np.array([2, 0, 5]), r"accepted must lie in \[0, T\] = \[0, 4\]"),
    (np.array([2, -1, 4]), r"accepted must lie in \[0, T\]"),
    (np.array([2.0, 0.0, 4.0]), "accepted must be an integer numpy.ndarray"),
    (np.array([2, 0]), r"accepted must be an integer numpy.ndarray of shape \(B,\) = \(3,\)"),
])
def test_accept_refuses_bad_counts_and_leaves_the_pool(accepted, message):
    x, pool = _drafts(seed=7), _pool(seed=8)
    _, drafted_states = verify_step(x.q, x.k, x.v, x.g, x.beta, pool, SLOTS)
    before = pool.copy()
    with pytest.raises(ValueError, match=message):
        accept_drafts(pool, SLOTS, drafted_states, accepted)
    assert np.array_equal(pool, before)


def test_verify_and_accept_refuse_bad_inputs():
    x, pool = _drafts(seed=9), _pool(seed=10)
    with pytest.raises(ValueError, match="at least one drafted token"):
        verify_step(*(a[:, :0] for a in (x.q, x.k, x.v, x.g, x.beta)), pool, SLOTS)
    with pytest.raises(ValueError, match="slots must be distinct"):
        verify_step(x.q, x.k, x.v, x.g, x.beta, pool, np.array([4, 1, 4]))
    _, drafted_states = verify_step(x.q, x.k, x.v, x.g, x.beta, pool, SLOTS)
    with pytest.raises(ValueError, match=r"drafted_states must be \(B, T, H, d_k, d_v\)"):
        accept_drafts(pool, SLOTS, drafted_states[:, :, :, :2], ACCEPTED)
    with pytest.raises(ValueError, match=r"slots must have shape \(B,\) = \(3,\)"):
        accept_drafts(pool, SLOTS[:2], drafted_states, ACCEPTED)
