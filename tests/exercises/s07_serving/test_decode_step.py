"""Tests of exercise s07.decode_step: decode steps over a pool against the delta-rule form of KDA,
each sequence from the state in its slot; the slots in no particular order, the rest of the pool kept."""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from tests.exercises.s05_fast_kda.oracle import kda_delta_rule

STAGE = "s07_serving"
POOL_AXES = ("slot", "head", "key channel", "value channel")


@pytest.fixture
def decode_step(target_module):
    return target_module(STAGE, "decode_step.py").decode_step


def _case(B, N, P, seed):
    x = make_inputs(B, N, 2, 4, 3, gate="channel", gate_range=(0.5, 1.0), beta_range=(0.1, 0.9), seed=seed)
    pool = np.random.default_rng(seed).standard_normal((P, 2, 4, 3))
    return x, pool


@pytest.mark.parametrize("slots", [[4, 1, 2], [2, 0], [1, 0]], ids=["scattered", "out of order", "swapped"])
def test_steps_continue_each_sequence_from_its_slot(decode_step, slots):
    """N steps: every output and every new state that of the sequence's own state, and no slot
    outside `slots` changes."""
    slots = np.array(slots)
    x, pool = _case(len(slots), 4, 6, seed=len(slots) + slots[0])
    expected_o, expected_states = kda_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool[slots])
    others = np.setdiff1d(np.arange(len(pool)), slots)
    kept = pool[others].copy()
    o = np.stack([decode_step(*(np.ascontiguousarray(a[:, t]) for a in (x.q, x.k, x.v, x.g, x.beta)), pool, slots)
                  for t in range(4)], axis=1)
    assert_close(o, expected_o, rel_l2=1e-12)
    assert_close(pool[slots], expected_states, rel_l2=1e-12, name="the states in the sequences' slots", axes=POOL_AXES)
    assert np.array_equal(pool[others], kept), "a slot that no sequence of the batch owns changed"


def test_only_the_pool_changes(decode_step):
    """q, k, v, g, beta and slots come back as they went in: only the pool is the step's to update."""
    slots = np.array([2, 0])
    x, pool = _case(len(slots), 1, 3, seed=7)
    inputs = [np.ascontiguousarray(a[:, 0]) for a in (x.q, x.k, x.v, x.g, x.beta)] + [slots]
    before = [a.copy() for a in inputs]
    decode_step(*inputs[:5], pool, inputs[5])
    for name, original, after in zip(("q", "k", "v", "g", "beta", "slots"), before, inputs):
        assert np.array_equal(original, after), f"{name} changed during the call"
