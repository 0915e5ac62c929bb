"""Tests of exercise s04.tune_kernel: the KDA kernel of stage 4 brought under a cost target.

The values: through the tile interpreter, in float64 against reference C (only fp32 rounds) and in
fp16 against reference A within fp16's rounding, with channel gates, betas at 0 and 1 among the
inputs, four chunks and two blocks of value columns. The cost: each count of
stages.common.program_cost within 5% of the library kernel's at COST_SHAPE, the target computed here
from the library (tests/exercises/tune_checks.py). On a GPU, its time against the library kernel's.
"""

import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.program_cost import counted_cost
from stages.s04_kda.reference import kernel_mirror, recurrent
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, assert_close_in_precision, build, run_on_cpu
from tests.exercises.library_values import from_library
from tests.exercises.tune_checks import COUNTS, assert_cost_within_target, assert_time_within_target

STAGE = "s04_kda"
SHAPE = (2, 64, 2, 32, 32)  # B, N, H, d_k, d_v: four chunks of 16, two blocks of value columns
TILES = dict(chunk_size=16, block_dv=16)
COST_SHAPE = (1, 1024, 4, 128, 128)  # B, N, H, d_k, d_v: the kernel's head dims, 16 chunks, 16 programs


@pytest.fixture
def build_program(target_module):
    return target_module(STAGE, "tune_kernel.py").build_program


def _inputs(gate_range, seed):
    """Channel gates in `gate_range`, betas over [0, 1] with exact zeros and ones among them."""
    x = make_inputs(*SHAPE, gate="channel", gate_range=gate_range, beta_range=(0.0, 1.0), seed=seed)
    x.beta[:, ::7] = 0.0  # a token that writes nothing and erases nothing
    x.beta[:, 3::7] = 1.0  # a token whose key's old value is erased entirely
    return x


def _run(build_program, x, dtype):
    return run_on_cpu(build(build_program, *SHAPE, dtype=dtype, **TILES), [x.q, x.k, x.v, x.g, x.beta], out_idx=[5])


def test_float64_program_equals_reference_c(build_program):
    x = _inputs((0.5, 0.999), seed=11)
    expected = from_library(kernel_mirror, x.q, x.k, x.v, x.g, x.beta, TILES["chunk_size"], TILES["block_dv"])
    # fp32 accumulators and fp32 exponentials: each output sums O(C + d_k) terms rounded to 2^-24
    assert_close(_run(build_program, x, "float64"), expected, rel_l2=64 * UNIT_ROUNDOFF["float64"],
                 chunk_size=TILES["chunk_size"], name="the interpreted float64 program")


def test_fp16_program_within_rounding(build_program):
    x = _inputs((0.9, 0.999), seed=12)
    # q, k, v and each GEMM operand are rounded to fp16 once: a few units of 2^-11
    assert_close_in_precision(_run(build_program, x, "float16"), from_library(recurrent, x.q, x.k, x.v, x.g, x.beta),
                              rel_l2=4 * UNIT_ROUNDOFF["float16"], chunk_size=TILES["chunk_size"],
                              name="the interpreted fp16 program")


def library_cost(B, N, H, d_k, d_v):
    """The counts of the library kernel at its default tiles: the target."""
    from stages.s04_kda.kernel import build_program as library_program

    return counted_cost(library_program(B, N, H, d_k, d_v))


@pytest.mark.parametrize("count", list(COUNTS))
def test_cost_within_target(build_program, count):
    target = from_library(library_cost, *COST_SHAPE)
    assert_cost_within_target(build(build_program, *COST_SHAPE), target, count)


@pytest.mark.gpu
def test_time_within_target(build_program):
    from stages.s04_kda.kernel import PASS_CONFIGS
    from stages.s04_kda.kernel import build_program as library_program

    B, N, H, d_k, d_v = 1, 8192, 16, 128, 128
    x = make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=(0.9, 0.999), beta_range=(0.1, 0.9), seed=5)
    assert_time_within_target(build(build_program, B, N, H, d_k, d_v),
                              lambda: library_program(B, N, H, d_k, d_v),
                              [x.q, x.k, x.v, x.g, x.beta], ["float16"] * 3 + ["float32"] * 2, out_idx=[5],
                              pass_configs=PASS_CONFIGS)
