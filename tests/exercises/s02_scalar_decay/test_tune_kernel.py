"""Tests of exercise s02.tune_kernel: stage 2's kernel brought under a cost target.

The values: the kernel exercise's own tests (test_kernel_program.py), run on this file's program:
through the tile interpreter in float64 against reference C and in fp16 against the exact result.
The cost: each count of stages.common.program_cost within 5% of the library kernel's at COST_SHAPE,
the target computed here from the library (tests/exercises/tune_checks.py). On a GPU, its time against
the library kernel's.
"""

import pytest

from stages.common.program_cost import counted_cost
from tests.exercises.kernel_checks import build
from tests.exercises.library_values import from_library
from tests.exercises.s02_scalar_decay.test_kernel_program import (  # noqa: F401  (run here on this program)
    test_float64_program_equals_reference_c, test_fp16_program_within_rounding)
from tests.exercises.tune_checks import COUNTS, assert_cost_within_target, assert_time_within_target

STAGE = "s02_scalar_decay"
COST_SHAPE = (1, 1024, 4, 128, 128)  # B, N, H, d_k, d_v: the kernel's head dims, 16 chunks, 16 programs


@pytest.fixture
def build_program(target_module):
    return target_module(STAGE, "tune_kernel.py").build_program


def library_cost(B, N, H, d_k, d_v):
    """The counts of the library kernel at its default tiles: the target."""
    from stages.s02_scalar_decay.kernel import build_program as library_program

    return counted_cost(library_program(B, N, H, d_k, d_v))


@pytest.mark.parametrize("count", list(COUNTS))
def test_cost_within_target(build_program, count):
    target = from_library(library_cost, *COST_SHAPE)
    assert_cost_within_target(build(build_program, *COST_SHAPE), target, count)


@pytest.mark.gpu
def test_time_within_target(build_program):
    from stages.common.inputs import make_inputs
    from stages.s02_scalar_decay.kernel import build_program as library_program

    B, N, H, d_k, d_v = 1, 8192, 16, 128, 128
    x = make_inputs(B, N, H, d_k, d_v, gate="head", gate_range=(0.9, 0.999), seed=5)
    assert_time_within_target(build(build_program, B, N, H, d_k, d_v),
                              lambda: library_program(B, N, H, d_k, d_v),
                              [x.q, x.k, x.v, x.g], ["float16"] * 3 + ["float32"], out_idx=[4])
