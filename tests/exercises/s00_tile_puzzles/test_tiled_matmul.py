"""Tests of puzzle s00.tiled_matmul: C = A B, tile by tile of C, walking K through shared memory."""

import numpy as np
import pytest

from tests.exercises.kernel_checks import build, compile_for_sm90a
from tests.exercises.s00_tile_puzzles.puzzle_checks import assert_matches_spec, run_puzzle, small_integers

STAGE = "s00_tile_puzzles"
TILE = 32


@pytest.fixture
def tiled_matmul(target_module):
    return target_module(STAGE, "tiled_matmul.py").tiled_matmul


# a square grid of 2 x 2 tiles over three tiles of K; and a grid two tiles tall, one wide
@pytest.mark.parametrize("M, N, K", [(64, 64, 96), (64, 32, 96)])
def test_product_in_every_tile(tiled_matmul, M, N, K):
    a, b = small_integers(M, (M, K), dtype=np.float16), small_integers(N + K, (K, N), dtype=np.float16)
    product = a.astype(np.float64) @ b.astype(np.float64)

    def hint(wrong, actual):
        first_k_tile = a[:, :TILE].astype(np.float64) @ b[:TILE].astype(np.float64)
        if (actual == first_k_tile).all() or (actual == a[:, -TILE:].astype(np.float64) @ b[-TILE:].astype(np.float64)).all():
            return "C holds the product of one tile of K only: every tile of the loop adds into C_f, cleared once before it"
        tiles = sorted({(int(r) // TILE, int(c) // TILE) for r, c in zip(*np.nonzero(wrong))})
        if all(by != bx for by, bx in tiles):
            return (f"only tiles off the diagonal are wrong, {tiles} as (by, bx): a load takes its tile by the "
                    "other block index (A's rows go with by, B's columns with bx)")
        return f"the tiles (by, bx) of C with wrong entries: {tiles}"

    assert_matches_spec(run_puzzle(tiled_matmul, (M, N, K), [a, b], [2], block_m=TILE, block_n=TILE, block_k=TILE),
                        product, name="C", hint=hint)


@pytest.mark.compile
def test_compiles_for_sm90a(tiled_matmul):
    compile_for_sm90a(build(tiled_matmul, 64, 32, 96, block_m=TILE, block_n=TILE, block_k=TILE))
