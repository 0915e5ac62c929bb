"""What the puzzles' tests share: a puzzle's program built and run through the tile interpreter
(tests/exercises/kernel_checks.py: a program that does not build, or that the interpreter stops,
fails with TileLang's or the interpreter's message), and an exact comparison with the puzzle's
NumPy specification whose failure says which elements are wrong, how, and what that usually means.

The inputs are small integers, so every sum, product and GEMM a puzzle computes is exact in its
dtype (a few hundred terms of at most 16 each, far below 2^11 in fp16 operands and 2^24 in fp32
sums): the comparison is equality, and one wrong element is a wrong program, never rounding.
"""

import numpy as np
import pytest

from stages.common.interpreter import never_written
from tests.exercises.kernel_checks import build, run_on_cpu


def small_integers(seed, shape, low=-4, high=4, dtype=np.float32):
    """Integers drawn from [low, high], as `dtype`: exact operands for every puzzle's arithmetic."""
    return np.random.default_rng(seed).integers(low, high + 1, shape).astype(dtype)


def run_puzzle(function, args, inputs, out_idx, **options):
    """function(*args, **options)'s program run by the interpreter on `inputs`; its outputs."""
    __tracebackhide__ = True
    return run_on_cpu(build(function, *args, **options), inputs, out_idx)


def assert_matches_spec(actual, expected, *, name, hint=None):
    """`actual` equals `expected` element for element; else a failure that names the first wrong
    element (never stored, or its value beside the spec's), how many are wrong, and hint(wrong,
    actual)'s diagnosis where it has one (`wrong`: the boolean mask of the wrong elements)."""
    __tracebackhide__ = True
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape:
        pytest.fail(f"{name} has shape {actual.shape}, the spec {expected.shape}", pytrace=False)
    unstored = never_written(actual)
    wrong = unstored | (np.where(unstored, 0, actual) != expected)
    if not wrong.any():
        return
    first = tuple(int(i) for i in np.unravel_index(int(np.argmax(wrong)), wrong.shape))
    at = f"{name}[{', '.join(map(str, first))}]"
    if unstored[first]:
        what = f"{at}, was never stored (the program wrote nothing there)"
    else:
        what = f"{at}, is {actual[first].item():g} where the spec gives {expected[first].item():g}"
    lines = [f"{name} is wrong at {int(wrong.sum())} of {wrong.size} elements; the first, {what}"]
    if unstored.any() and not unstored[first]:
        lines.append(f"{int(unstored.sum())} of its elements were never stored")
    diagnosis = hint(wrong, np.where(unstored, np.nan, actual)) if hint is not None else None
    if diagnosis:
        lines.append(diagnosis)
    pytest.fail("\n".join(lines), pytrace=False)


def wrong_blocks(wrong, block, axis=0):
    """The indices of the blocks of `block` elements along `axis` that hold a wrong element."""
    per_element = wrong.any(axis=tuple(a for a in range(wrong.ndim) if a != axis))
    return sorted({int(i) // block for i in np.flatnonzero(per_element)})
