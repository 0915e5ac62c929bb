"""Tests of puzzle s00.gemm_tile: C = A W^T on the tensor cores, W stored N x K."""

import numpy as np
import pytest

from tests.exercises.kernel_checks import build, compile_for_sm90a
from tests.exercises.s00_tile_puzzles.puzzle_checks import assert_matches_spec, run_puzzle, small_integers

STAGE = "s00_tile_puzzles"


@pytest.fixture
def gemm_tile(target_module):
    return target_module(STAGE, "gemm_tile.py").gemm_tile


@pytest.mark.parametrize("M, N, K", [(32, 32, 32), (32, 16, 64)])  # square; and M, N, K all different
def test_product_with_the_transposed_weight(gemm_tile, M, N, K):
    a, w = small_integers(M, (M, K), dtype=np.float16), small_integers(N + K, (N, K), dtype=np.float16)
    expected = a.astype(np.float64) @ w.astype(np.float64).T

    def hint(wrong, actual):
        if N == K and (actual == a.astype(np.float64) @ w.astype(np.float64)).all():
            return "C is A W: W is stored N x K, so the GEMM reads it transposed (transpose_B)"
        return None

    assert_matches_spec(run_puzzle(gemm_tile, (M, N, K), [a, w], [2]), expected, name="C", hint=hint)


@pytest.mark.compile
def test_compiles_for_sm90a(gemm_tile):
    compile_for_sm90a(build(gemm_tile, 32, 16, 64))
