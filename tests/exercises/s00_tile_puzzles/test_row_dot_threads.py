"""Tests of puzzle s00.row_dot_threads: one thread per row, each summing its row's products in a
variable of its own. A variable read before it is given a value stops the interpreter with
ReadBeforeWrite (on a GPU the register holds whatever it held)."""

import pytest

from tests.exercises.kernel_checks import build, compile_for_sm90a
from tests.exercises.s00_tile_puzzles.puzzle_checks import assert_matches_spec, run_puzzle, small_integers, wrong_blocks

STAGE = "s00_tile_puzzles"
THREADS, D = 32, 16


@pytest.fixture
def row_dot_threads(target_module):
    return target_module(STAGE, "row_dot_threads.py").row_dot_threads


@pytest.mark.parametrize("M", [THREADS, 2 * THREADS + 5])  # whole blocks; a last block that reaches past M
def test_dot_product_of_every_row(row_dot_threads, M):
    a, b = small_integers(M, (M, D)), small_integers(M + 1, (M, D))

    def hint(wrong, actual):
        return f"the blocks of {THREADS} rows (one a thread) with wrong entries: {wrong_blocks(wrong, THREADS)}"

    assert_matches_spec(run_puzzle(row_dot_threads, (M, D), [a, b], [2], threads=THREADS), (a * b).sum(axis=1),
                        name="O", hint=hint)


@pytest.mark.compile
def test_compiles_for_sm90a(row_dot_threads):
    compile_for_sm90a(build(row_dot_threads, 2 * THREADS + 5, D, threads=THREADS))
