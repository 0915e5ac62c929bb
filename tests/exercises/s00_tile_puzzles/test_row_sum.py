"""Tests of puzzle s00.row_sum: O[r] = the sum of row r of A, by T.reduce_sum on a fragment."""

import pytest

from tests.exercises.kernel_checks import build, compile_for_sm90a
from tests.exercises.s00_tile_puzzles.puzzle_checks import assert_matches_spec, run_puzzle, small_integers, wrong_blocks

STAGE = "s00_tile_puzzles"
ROWS = 8
# D = 32: TileLang 0.1.15 finds no register layout for a reduction over 24 columns, say
D = 32


@pytest.fixture
def row_sum(target_module):
    return target_module(STAGE, "row_sum.py").row_sum


@pytest.mark.parametrize("M", [ROWS, 4 * ROWS])
def test_sums_of_the_rows(row_sum, M):
    a = small_integers(M, (M, D))

    def hint(wrong, actual):
        if (actual == a.sum(axis=0)[:M]).all():
            return "O holds sums of columns: T.reduce_sum's `dim` is the axis it sums over, the columns' axis 1"
        return f"the blocks of {ROWS} rows with wrong sums: {wrong_blocks(wrong, ROWS)}"

    assert_matches_spec(run_puzzle(row_sum, (M, D), [a], [1], rows=ROWS), a.sum(axis=1), name="O", hint=hint)


@pytest.mark.compile
def test_compiles_for_sm90a(row_sum):
    compile_for_sm90a(build(row_sum, 4 * ROWS, D, rows=ROWS))
