"""Tests of puzzle s00.histogram: counts of each value, by threads that add into shared bins.

In the interpreter every thread runs each statement at once: threads that add into one bin with a
plain read-add-write all read the same old count, and all but one add is lost, as on a GPU."""

import numpy as np
import pytest

from tests.exercises.kernel_checks import build, compile_for_sm90a
from tests.exercises.s00_tile_puzzles.puzzle_checks import assert_matches_spec, run_puzzle

STAGE = "s00_tile_puzzles"
THREADS, BINS = 64, 10


@pytest.fixture
def histogram(target_module):
    return target_module(STAGE, "histogram.py").histogram


@pytest.mark.parametrize("N", [THREADS, 5 * THREADS + 7])  # one value a thread; five rounds and a partial one
def test_counts_of_every_value(histogram, N):
    values = np.random.default_rng(N).integers(0, BINS, N).astype(np.int32)
    expected = np.bincount(values, minlength=BINS)

    def hint(wrong, actual):
        if (actual[wrong] < expected[wrong]).all():
            return ("bins count fewer values than they hold: threads that add into one bin at the same time each read "
                    "the old count and write it back plus 1, so all but one of their adds is lost; an atomic add "
                    "(T.atomic_add) makes each read-add-write indivisible")
        return None

    assert_matches_spec(run_puzzle(histogram, (N, BINS), [values], [1], threads=THREADS), expected, name="Counts",
                        hint=hint)


@pytest.mark.compile
def test_compiles_for_sm90a(histogram):
    compile_for_sm90a(build(histogram, 5 * THREADS + 7, BINS, threads=THREADS))
