"""Tests of puzzle s00.column_sum: O[j] = the sum of column j of A, over a pipelined loop of row
tiles."""

import pytest

from tests.exercises.kernel_checks import build, compile_for_sm90a
from tests.exercises.s00_tile_puzzles.puzzle_checks import assert_matches_spec, run_puzzle, small_integers, wrong_blocks

STAGE = "s00_tile_puzzles"
BLOCK_N, BLOCK_D = 16, 16


@pytest.fixture
def column_sum(target_module):
    return target_module(STAGE, "column_sum.py").column_sum


@pytest.mark.parametrize("N, D", [(BLOCK_N, 2 * BLOCK_D), (4 * BLOCK_N, 2 * BLOCK_D)])  # one tile of rows; four
def test_sums_of_the_columns(column_sum, N, D):
    a = small_integers(N + D, (N, D))

    def hint(wrong, actual):
        if (actual == a[-BLOCK_N:].sum(axis=0)).all():
            return "O holds the sums of the last tile of rows only: the running sums must carry over the tiles"
        if (actual == a[:BLOCK_N].sum(axis=0)).all():
            return "O holds the sums of the first tile of rows only: every tile of the loop must be added"
        return f"the blocks of {BLOCK_D} columns with wrong sums: {wrong_blocks(wrong, BLOCK_D)}"

    assert_matches_spec(run_puzzle(column_sum, (N, D), [a], [1], block_n=BLOCK_N, block_d=BLOCK_D), a.sum(axis=0),
                        name="O", hint=hint)


@pytest.mark.compile
def test_compiles_for_sm90a(column_sum):
    compile_for_sm90a(build(column_sum, 4 * BLOCK_N, 2 * BLOCK_D, block_n=BLOCK_N, block_d=BLOCK_D))
