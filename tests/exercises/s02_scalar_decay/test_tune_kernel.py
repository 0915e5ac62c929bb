"""Tests of exercise s02.tune_kernel: stage 2's kernel brought under a cost target.

The values: through the tile interpreter, in float64 against reference C (only fp32 rounds) and in
fp16 against reference A within fp16's rounding, with gates down to alpha = 0.5, one chunk and four
chunks with two blocks of value columns.
The cost: each count of stages.common.program_cost within 5% of the library kernel's at COST_SHAPE,
the target computed here from the library (tests/exercises/tune_checks.py). On a GPU, its time against
the library kernel's.
"""

import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.program_cost import counted_cost
from stages.s02_scalar_decay.reference import kernel_mirror, recurrent
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, build, run_on_cpu
from tests.exercises.library_values import from_library
from tests.exercises.tune_checks import COUNTS, assert_cost_within_target, assert_time_within_target

STAGE = "s02_scalar_decay"
COST_SHAPE = (1, 1024, 4, 128, 128)  # B, N, H, d_k, d_v: the kernel's head dims, 16 chunks, 16 programs
TILES = dict(chunk_size=16, block_dv=16)
GATE_RANGE = (0.5, 0.99)


@pytest.fixture
def build_program(target_module):
    return target_module(STAGE, "tune_kernel.py").build_program


@pytest.mark.parametrize(
    "B, N, H, d_k, d_v",
    [
        (1, 16, 2, 32, 16),  # one chunk, one block of value columns
        (2, 64, 2, 32, 32),  # four chunks: the state carries over, decayed; two blocks of value columns
    ],
)
def test_float64_program_equals_reference_c(build_program, B, N, H, d_k, d_v):
    x = make_inputs(B, N, H, d_k, d_v, gate="head", gate_range=GATE_RANGE, seed=N + d_v)
    program = build(build_program, B, N, H, d_k, d_v, dtype="float64", **TILES)
    actual = run_on_cpu(program, [x.q, x.k, x.v, x.g], out_idx=[4])
    expected = from_library(kernel_mirror, x.q, x.k, x.v, x.g, TILES["chunk_size"], TILES["block_dv"])
    # fp32 accumulators: each output sums O(C + d_k) products, each rounded to 2^-24; each decay is
    # one fp32 exp2 of a product of fp32 numbers, a few units of 2^-24 more
    assert_close(actual, expected, rel_l2=64 * UNIT_ROUNDOFF["float64"], chunk_size=TILES["chunk_size"],
                 name="the interpreted float64 program")


def test_fp16_program_within_rounding(build_program):
    B, N, H, d_k, d_v = 1, 64, 2, 32, 32
    x = make_inputs(B, N, H, d_k, d_v, gate="head", gate_range=GATE_RANGE, seed=3)
    program = build(build_program, B, N, H, d_k, d_v, dtype="float16", **TILES)
    actual = run_on_cpu(program, [x.q, x.k, x.v, x.g], out_idx=[4])
    # q, k, v, the decayed scores, key_decay ⊙ V and the state are each rounded to fp16 once: at most
    # u/2 each, 3u if they all added up; the decays are <= 1 and amplify none of them
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g), rel_l2=4 * UNIT_ROUNDOFF["float16"],
                 chunk_size=TILES["chunk_size"], name="the interpreted fp16 program")


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
