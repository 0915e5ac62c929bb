"""The comparison stage 0's puzzle tests share (tests/exercises/s00_tile_puzzles/puzzle_checks.py):
silent on a right output, and on a wrong one a message that names the first wrong element, tells an
element never stored from a wrong value, and adds the puzzle's diagnosis."""

import numpy as np
import pytest

from stages.common.interpreter import interpret
from tests.exercises.s00_tile_puzzles.puzzle_checks import assert_matches_spec, wrong_blocks


def test_a_right_output_passes():
    assert_matches_spec(np.arange(6.0).reshape(2, 3), np.arange(6).reshape(2, 3), name="O")


def test_a_wrong_value_is_named_with_the_spec_and_the_diagnosis():
    actual = np.array([0.0, 1.0, 5.0, 7.0])
    with pytest.raises(pytest.fail.Exception) as failure:
        assert_matches_spec(actual, np.arange(4), name="O", hint=lambda wrong, _: f"wrong at {np.flatnonzero(wrong)}")
    assert str(failure.value) == ("O is wrong at 2 of 4 elements; the first, O[2], is 5 where the spec gives 2\n"
                                  "wrong at [2 3]")


def test_an_element_never_stored_is_named_as_such():
    """An interpreter output the program stores only in part: the rest still holds the mark of an
    element nothing wrote, which the message tells from a wrong value."""
    import tilelang.language as T

    @T.prim_func
    def first_half(A: T.Tensor((8,), "float32"), O: T.Tensor((8,), "float32")):
        with T.Kernel(1, threads=32) as _block:
            for i in T.Parallel(4):
                O[i] = A[i]

    a = np.arange(8, dtype=np.float32)
    with pytest.raises(pytest.fail.Exception) as failure:
        assert_matches_spec(interpret(first_half, out_idx=[1])(a), a, name="O")
    assert str(failure.value) == "O is wrong at 4 of 8 elements; the first, O[4], was never stored (the program wrote nothing there)"


def test_wrong_blocks_lists_each_block_once():
    wrong = np.zeros((8, 3), dtype=bool)
    wrong[[1, 2, 7], 0] = True
    assert wrong_blocks(wrong, 2) == [0, 1, 3]
    assert wrong_blocks(wrong, 2, axis=1) == [0]
