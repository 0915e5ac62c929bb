"""Tests of puzzle s00.copy_tile: O = A, block by block through shared memory."""

import pytest

from tests.exercises.kernel_checks import build, compile_for_sm90a
from tests.exercises.s00_tile_puzzles.puzzle_checks import assert_matches_spec, run_puzzle, small_integers, wrong_blocks

STAGE = "s00_tile_puzzles"
BLOCK = 32


@pytest.fixture
def copy_tile(target_module):
    return target_module(STAGE, "copy_tile.py").copy_tile


@pytest.mark.parametrize("N", [BLOCK, 4 * BLOCK])  # one block, and four: each must move its own slice
def test_output_is_the_input(copy_tile, N):
    a = small_integers(N, (N,))

    def hint(wrong, actual):
        blocks = wrong_blocks(wrong, BLOCK)
        copies_first = [b for b in blocks if (actual[b * BLOCK:(b + 1) * BLOCK] == a[:BLOCK]).all()]
        if copies_first:
            return (f"blocks {copies_first} hold A's first block, A[0:{BLOCK}]: block b's slice of A starts at "
                    f"b * block")
        return f"the blocks with wrong elements: {blocks} (block b owns O[b * {BLOCK}:(b + 1) * {BLOCK}])"

    assert_matches_spec(run_puzzle(copy_tile, (N,), [a], [1], block=BLOCK), a, name="O", hint=hint)


@pytest.mark.compile
def test_compiles_for_sm90a(copy_tile):
    compile_for_sm90a(build(copy_tile, 4 * BLOCK, block=BLOCK))
