"""Tests of puzzle s00.chunk_cumsum: G[t] = g[chunk start] + ... + g[t], the sum restarting at every
chunk."""

import numpy as np
import pytest

from tests.exercises.kernel_checks import build, compile_for_sm90a
from tests.exercises.s00_tile_puzzles.puzzle_checks import assert_matches_spec, run_puzzle, small_integers, wrong_blocks

STAGE = "s00_tile_puzzles"
C = 16


@pytest.fixture
def chunk_cumsum(target_module):
    return target_module(STAGE, "chunk_cumsum.py").chunk_cumsum


def within_chunks(g, reverse=False):
    chunks = g.reshape(-1, C)[:, ::-1] if reverse else g.reshape(-1, C)
    sums = np.cumsum(chunks, axis=1)
    return (sums[:, ::-1] if reverse else sums).ravel()


@pytest.mark.parametrize("num_chunks", [1, 4])
def test_sums_restart_at_every_chunk(chunk_cumsum, num_chunks):
    N = num_chunks * C
    g = small_integers(N, (N,), low=-4, high=0)  # log gates: zero or negative

    def hint(wrong, actual):
        if (actual == np.cumsum(g)).all():
            return "G runs on across chunks: each chunk's sum starts again from its own first element"
        if (actual == within_chunks(g, reverse=True)).all():
            return "each entry sums from itself to its chunk's end: the sum runs backwards (T.cumsum's `reverse`)"
        return f"the chunks with wrong entries: {wrong_blocks(wrong, C)}"

    assert_matches_spec(run_puzzle(chunk_cumsum, (N,), [g], [1], chunk_size=C), within_chunks(g), name="G", hint=hint)


@pytest.mark.compile
def test_compiles_for_sm90a(chunk_cumsum):
    compile_for_sm90a(build(chunk_cumsum, 4 * C, chunk_size=C))
