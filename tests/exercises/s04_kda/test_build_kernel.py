"""Tests of exercise s04.build_kernel: the KDA kernel, written whole.

They check what any correct program does, never how the course's is written: its values through the
tile interpreter (float64 against reference C, fp16 against reference A, strong gates, a zero-padded
length), that it writes only O, the ordering constraints on its TIR, and the H200's budgets (shared
memory from the TIR; with nvcc, no spills). tests/course/test_build_exercises.py runs them on a second
program, which pairs beta otherwise and takes its exponentials elsewhere.

The gates differ per channel (equal channels hide a decay applied with one channel's rate), beta
spans [0, 1] with exact zeros and ones, and the sequences span several chunks.
"""

import math

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.program_cost import counted_cost
from stages.s04_kda.reference import kernel_mirror, recurrent
from tests.exercises.build_checks import (BUDGET_HEAD_DIM, assert_cost_near_the_course_kernel,
                                          assert_fits_shared_memory,
                                          assert_respects_ordering_constraints, assert_writes_only, padded_to_chunks)
from tests.exercises.kernel_checks import (UNIT_ROUNDOFF, assert_close_in_precision, build, compile_for_sm90a,
                                           run_on_cpu, run_on_gpu)
from tests.exercises.library_values import from_library

STAGE = "s04_kda"
TILES = dict(chunk_size=16, block_dv=16)
COST_SHAPE = (1, 1024, 4, 128, 128)  # B, N, H, d_k, d_v: the kernel's head dims, 16 chunks at C = 64
# Strong gates, each within what the kernel takes: -5 per token is e^{-80} across a chunk of 16, inside
# fp32's range on both sides of the split e^{gamma} e^{-gamma}; in fp16 the wrapper's bound is a decay
# of at most 2^-14 per chunk (stages/s04_kda/numerics.py), here reached by the last row of a chunk.
STRONG_LOG_GATE = {"float64": -5.0, "float16": -14 * math.log(2) / TILES["chunk_size"]}
FLOAT64_BOUND = 64 * UNIT_ROUNDOFF["float64"]  # fp32 accumulators and exponentials: O(C + d_k) terms of 2^-24
FP16_BOUND = 4 * UNIT_ROUNDOFF["float16"]  # q, k, v and each GEMM operand rounded to fp16 once


@pytest.fixture
def build_program(target_module):
    return target_module(STAGE, "build_kernel.py").build_program


def _inputs(B, N, H, d_k, d_v, gate_range, seed):
    """Channel gates in `gate_range`, betas over [0, 1] with exact zeros and ones among them."""
    x = make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=gate_range, beta_range=(0.0, 1.0), seed=seed)
    x.beta[:, ::7] = 0.0  # a token that writes nothing and erases nothing
    x.beta[:, 3::7] = 1.0  # a token whose key's old value is erased entirely
    return x


def _run(build_program, x, dtype):
    B, N, H, d_k = x.q.shape
    program = build(build_program, B, N, H, d_k, x.v.shape[-1], dtype=dtype, **TILES)
    return run_on_cpu(program, [x.q, x.k, x.v, x.g, x.beta], out_idx=[5])


@pytest.mark.parametrize(
    "B, N, H, d_k, d_v",
    [
        (1, 16, 2, 32, 16),  # one chunk, one block of value columns
        (2, 64, 2, 32, 32),  # four chunks: the state carries over, decayed; two blocks of value columns
    ],
)
def test_float64_program_equals_reference_c(build_program, B, N, H, d_k, d_v):
    x = _inputs(B, N, H, d_k, d_v, gate_range=(0.5, 0.999), seed=N + d_v)
    expected = from_library(kernel_mirror, x.q, x.k, x.v, x.g, x.beta, TILES["chunk_size"], TILES["block_dv"])
    assert_close(_run(build_program, x, "float64"), expected, rel_l2=FLOAT64_BOUND, chunk_size=TILES["chunk_size"],
                 name="the interpreted float64 program")


def test_fp16_program_within_rounding(build_program):
    x = _inputs(2, 64, 2, 32, 32, gate_range=(0.9, 0.999), seed=12)
    assert_close_in_precision(_run(build_program, x, "float16"), from_library(recurrent, x.q, x.k, x.v, x.g, x.beta),
                              rel_l2=FP16_BOUND, chunk_size=TILES["chunk_size"], name="the interpreted fp16 program")


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_strong_gates(build_program, dtype):
    x = _inputs(1, 64, 2, 32, 32, gate_range=(0.9, 0.999), seed=50)
    x.g[..., ::5] = STRONG_LOG_GATE[dtype]  # every fifth channel decays as fast as the kernel allows
    actual = _run(build_program, x, dtype)
    assert np.isfinite(actual).all(), f"the {dtype} program gives inf or NaN with g = {STRONG_LOG_GATE[dtype]:.3g}"
    check = assert_close if dtype == "float64" else assert_close_in_precision
    check(actual, from_library(recurrent, x.q, x.k, x.v, x.g, x.beta),
          rel_l2=FLOAT64_BOUND if dtype == "float64" else FP16_BOUND, chunk_size=TILES["chunk_size"],
          name=f"the interpreted {dtype} program, g = {STRONG_LOG_GATE[dtype]:.3g} on every fifth channel")


def test_length_not_a_multiple_of_the_chunk(build_program):
    N = 45  # three chunks of 16, the last one 13 tokens and 3 of padding (g = 0, beta = 0)
    x = _inputs(1, N, 2, 32, 32, gate_range=(0.5, 0.999), seed=45)
    padded = type(x)(*(padded_to_chunks(a, TILES["chunk_size"]) for a in (x.q, x.k, x.v, x.g, x.beta)))
    assert_close(_run(build_program, padded, "float64")[:, :N], from_library(recurrent, x.q, x.k, x.v, x.g, x.beta),
                 rel_l2=FLOAT64_BOUND, chunk_size=TILES["chunk_size"],
                 name="the interpreted float64 program on a zero-padded sequence")


def test_writes_only_its_output(build_program):
    assert_writes_only(build(build_program, 2, 64, 2, 32, 32, **TILES), outputs=[5])


def test_respects_ordering_constraints(build_program):
    assert_respects_ordering_constraints(build(build_program, 2, 64, 2, 32, 32, **TILES), constraints=[1, 2, 7])


def test_fits_the_shared_memory_of_an_h200(build_program):
    assert_fits_shared_memory(build(build_program, 1, 256, 2, BUDGET_HEAD_DIM, BUDGET_HEAD_DIM))


def library_cost(B, N, H, d_k, d_v):
    """The counts of the course's kernel at its default tiles."""
    from stages.s04_kda.kernel import build_program as library_program

    return counted_cost(library_program(B, N, H, d_k, d_v))


def test_cost_near_the_course_kernel(build_program):
    assert_cost_near_the_course_kernel(build(build_program, *COST_SHAPE), from_library(library_cost, *COST_SHAPE))


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills(build_program):
    from stages.s04_kda.kernel import PASS_CONFIGS

    compile_for_sm90a(build(build_program, 1, 4096, 8, BUDGET_HEAD_DIM, BUDGET_HEAD_DIM), PASS_CONFIGS)


@pytest.mark.gpu
def test_runs_on_gpu_and_a_second_call_agrees(build_program):
    from stages.s04_kda.kernel import PASS_CONFIGS

    B, N, H, d_k, d_v = 2, 1024, 4, 128, 128
    x = _inputs(B, N, H, d_k, d_v, gate_range=(0.9, 0.999), seed=8)
    program = build(build_program, B, N, H, d_k, d_v)
    arguments, dtypes = [x.q, x.k, x.v, x.g, x.beta], ["float16"] * 3 + ["float32"] * 2
    actual = run_on_gpu(program, arguments, [5], dtypes, PASS_CONFIGS)
    assert_close_in_precision(actual, from_library(recurrent, *arguments), rel_l2=5e-3, chunk_size=64,
                              name="the fp16 kernel on the GPU")
    # on a GPU the output starts as whatever memory held: a row the program never writes shows here
    assert np.array_equal(run_on_gpu(program, arguments, [5], dtypes, PASS_CONFIGS), actual), (
        "a second call gave another answer")
