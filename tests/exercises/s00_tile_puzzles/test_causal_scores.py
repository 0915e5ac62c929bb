"""Tests of puzzle s00.causal_scores: each chunk's Q K^T with the future (j > r) masked to 0 and the
diagonal kept."""

import numpy as np
import pytest

from tests.exercises.kernel_checks import build, compile_for_sm90a
from tests.exercises.s00_tile_puzzles.puzzle_checks import assert_matches_spec, run_puzzle, small_integers

STAGE = "s00_tile_puzzles"
C, d = 16, 32


@pytest.fixture
def causal_scores(target_module):
    return target_module(STAGE, "causal_scores.py").causal_scores


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_masked_scores_of_every_chunk(causal_scores, num_chunks):
    N = num_chunks * C
    q, k = small_integers(N, (N, d), dtype=np.float16), small_integers(N + 1, (N, d), dtype=np.float16)
    scores = np.einsum("crd,cjd->crj", *(x.astype(np.float64).reshape(num_chunks, C, d) for x in (q, k)))
    causal = np.tril(np.ones((C, C), dtype=bool))

    def hint(wrong, actual):
        diagonal = np.eye(C, dtype=bool)
        if wrong[:, diagonal].any() and (actual[:, diagonal] == 0).all():
            return "the diagonal is 0: a query sees its own key (the mask keeps j <= r)"
        if wrong[:, ~causal].any():
            return "entries above the diagonal (j > r, the future) are not 0"
        if wrong[:, causal].any():
            return "entries on or below the diagonal differ from Q_c K_c^T: check the GEMM's operands and flags"
        return None

    assert_matches_spec(run_puzzle(causal_scores, (N, d), [q, k], [2], chunk_size=C), np.where(causal, scores, 0),
                        name="S", hint=hint)


@pytest.mark.compile
def test_compiles_for_sm90a(causal_scores):
    compile_for_sm90a(build(causal_scores, 3 * C, d, chunk_size=C))
