"""Tests of exercise s05.recurrence: the library's prepare, then the recurrence under test, against
the delta-rule form of KDA token by token."""

import dataclasses

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.s05_fast_kda.reference import prepare
from tests.exercises.s05_fast_kda.oracle import kda_delta_rule
from tests.exercises.library_values import from_library

STAGE = "s05_fast_kda"


@pytest.fixture
def recurrence(target_module):
    return target_module(STAGE, "recurrence.py").recurrence


def _inputs(N, seed):
    return make_inputs(2, N, 2, 8, 6, gate="channel", gate_range=(0.8, 0.999), beta_range=(0.1, 0.9), seed=seed)


@pytest.mark.parametrize(
    "N, chunk_size, block_dv",
    [
        (16, 16, 6),  # one chunk
        (64, 16, 6),  # many chunks
        (64, 8, 2),  # three blocks of value columns
        (37, 16, 3),  # N padded up to a multiple of chunk_size
    ],
)
def test_matches_delta_rule(recurrence, N, chunk_size, block_dv):
    x = _inputs(N, seed=N + block_dv)
    expected, expected_state = kda_delta_rule(x.q, x.k, x.v, x.g, x.beta)
    o, final_state = recurrence(from_library(prepare, x.q, x.k, x.v, x.g, x.beta, chunk_size, 4), block_dv)
    assert_close(o[:, :N], expected, rel_l2=1e-12, chunk_size=chunk_size)
    assert_close(final_state, expected_state, rel_l2=1e-12, name="the final state S^T",
                 axes=("batch", "head", "key channel", "value channel"))


def test_carries_the_state_across_calls(recurrence):
    x = _inputs(64, seed=9)
    expected, _ = kda_delta_rule(x.q, x.k, x.v, x.g, x.beta)
    state, outputs = None, []
    for rows in (slice(0, 32), slice(32, 64)):
        tensors = from_library(prepare, x.q[:, rows], x.k[:, rows], x.v[:, rows], x.g[:, rows], x.beta[:, rows], 16, 4)
        o, state = recurrence(tensors, 3, initial_state=state)
        outputs.append(o)
    assert_close(np.concatenate(outputs, axis=1), expected, rel_l2=1e-12, chunk_size=16)


def test_inputs_unchanged_and_a_second_call_agrees(recurrence):
    """The prepared tensors and the initial state come back as they went in (a caller reuses a state,
    as stage 7's prefill does), and a second call on them gives the same output and final state."""
    x = _inputs(48, seed=11)
    tensors = from_library(prepare, x.q, x.k, x.v, x.g, x.beta, 16, 4)
    initial_state = np.random.default_rng(11).standard_normal((2, 2, 8, 6))
    tensors_before = {field.name: getattr(tensors, field.name).copy() for field in dataclasses.fields(tensors)}
    state_before = initial_state.copy()
    first = recurrence(tensors, 3, initial_state=initial_state)
    assert np.array_equal(initial_state, state_before), "the initial state changed during the call"
    for name, before in tensors_before.items():
        assert np.array_equal(getattr(tensors, name), before), f"tensors.{name} changed during the call"
    second = recurrence(tensors, 3, initial_state=initial_state)
    for name, a, b in zip(("o", "the final state"), first, second):
        assert np.array_equal(a, b), f"{name} differs between two calls on the same inputs"
