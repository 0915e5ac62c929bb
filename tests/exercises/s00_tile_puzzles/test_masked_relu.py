"""Tests of puzzle s00.masked_relu: O = max(A, 0) for a length that is not a multiple of the block.

A lane past the end that loads or stores stops the interpreter with OutOfRange (on a GPU it reads or
writes another buffer's memory), so the lengths here end inside the last block and just past it."""

import numpy as np
import pytest

from tests.exercises.kernel_checks import build, compile_for_sm90a
from tests.exercises.s00_tile_puzzles.puzzle_checks import assert_matches_spec, run_puzzle, small_integers

STAGE = "s00_tile_puzzles"
BLOCK = 32


@pytest.fixture
def masked_relu(target_module):
    return target_module(STAGE, "masked_relu.py").masked_relu


@pytest.mark.parametrize("N", [2 * BLOCK, 2 * BLOCK + 5, 2 * BLOCK + 1])  # whole blocks; a last block of 5, of 1
def test_relu_of_every_element_and_nothing_past_the_end(masked_relu, N):
    a = small_integers(N + 7, (N,))

    def hint(wrong, actual):
        if np.any(wrong & (a < 0) & (actual == a)):
            return "negative elements are stored as they are: O[i] is the larger of A[i] and 0"
        if wrong[(N // BLOCK) * BLOCK:].all() and not wrong[:(N // BLOCK) * BLOCK].any():
            return "only the last block, the one that reaches past N, is wrong: its lanes below N must still store"
        return None

    assert_matches_spec(run_puzzle(masked_relu, (N,), [a], [1], block=BLOCK), np.maximum(a, 0), name="O", hint=hint)


@pytest.mark.compile
def test_compiles_for_sm90a(masked_relu):
    compile_for_sm90a(build(masked_relu, 2 * BLOCK + 5, block=BLOCK))
