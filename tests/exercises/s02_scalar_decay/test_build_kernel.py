"""Tests of exercise s02.build_kernel: stage 2's TileLang kernel, written whole.

They check what any correct program does, never how the course's is written: its values through the
tile interpreter (float64 against reference C, fp16 against reference A, strong gates, a zero-padded
length), that it writes only O, the ordering constraints on its TIR, and the H200's budgets (shared
memory from the TIR; with nvcc, no spills). tests/course/test_build_exercises.py runs them on a second,
differently tiled program too.

The gates reach down to alpha = 0.5 and the sequences span several chunks: g = 0 or a single chunk
hides a state decayed in the wrong order and a decay counted from the wrong start.
"""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.program_cost import counted_cost
from stages.s02_scalar_decay.reference import kernel_mirror, recurrent
from tests.exercises.build_checks import (BUDGET_HEAD_DIM, assert_cost_near_the_course_kernel,
                                          assert_fits_shared_memory,
                                          assert_respects_ordering_constraints, assert_writes_only, padded_to_chunks)
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, build, compile_for_sm90a, run_on_cpu, run_on_gpu
from tests.exercises.library_values import from_library

STAGE = "s02_scalar_decay"
TILES = dict(chunk_size=16, block_dv=16)
COST_SHAPE = (1, 1024, 4, 128, 128)  # B, N, H, d_k, d_v: the kernel's head dims, 16 chunks at C = 64
GATE_RANGE = (0.5, 0.99)
STRONG_LOG_GATE = -50.0  # a decay of e^-50 per token: the state forgets all but the last token


@pytest.fixture
def build_program(target_module):
    return target_module(STAGE, "build_kernel.py").build_program


def _inputs(B, N, H, d_k, d_v, seed):
    return make_inputs(B, N, H, d_k, d_v, gate="head", gate_range=GATE_RANGE, seed=seed)


@pytest.mark.parametrize(
    "B, N, H, d_k, d_v",
    [
        (1, 16, 2, 32, 16),  # one chunk, one block of value columns
        (2, 64, 2, 32, 32),  # four chunks: the state carries over, decayed; two blocks of value columns
    ],
)
def test_float64_program_equals_reference_c(build_program, B, N, H, d_k, d_v):
    x = _inputs(B, N, H, d_k, d_v, seed=N + d_v)
    program = build(build_program, B, N, H, d_k, d_v, dtype="float64", **TILES)
    actual = run_on_cpu(program, [x.q, x.k, x.v, x.g], out_idx=[4])
    expected = from_library(kernel_mirror, x.q, x.k, x.v, x.g, TILES["chunk_size"], TILES["block_dv"])
    # fp32 accumulators and fp32 decays: each output sums O(C + d_k) products, each rounded to 2^-24
    assert_close(actual, expected, rel_l2=64 * UNIT_ROUNDOFF["float64"], chunk_size=TILES["chunk_size"],
                 name="the interpreted float64 program")


def test_fp16_program_within_rounding(build_program):
    B, N, H, d_k, d_v = 1, 64, 2, 32, 32
    x = _inputs(B, N, H, d_k, d_v, seed=3)
    program = build(build_program, B, N, H, d_k, d_v, dtype="float16", **TILES)
    actual = run_on_cpu(program, [x.q, x.k, x.v, x.g], out_idx=[4])
    # q, k, v, the decayed scores and operands and the state are each rounded to fp16 once; the
    # decays are <= 1 and amplify none of them
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g), rel_l2=4 * UNIT_ROUNDOFF["float16"],
                 chunk_size=TILES["chunk_size"], name="the interpreted fp16 program")


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_strong_gates(build_program, dtype):
    B, N, H, d_k, d_v = 1, 64, 2, 32, 32
    x = _inputs(B, N, H, d_k, d_v, seed=50)
    x.g[0] = STRONG_LOG_GATE  # head 0 forgets at once; head 1 keeps its gate in [0.5, 0.99]
    program = build(build_program, B, N, H, d_k, d_v, dtype=dtype, **TILES)
    actual = run_on_cpu(program, [x.q, x.k, x.v, x.g], out_idx=[4])
    assert np.isfinite(actual).all(), f"the {dtype} program gives inf or NaN with g = {STRONG_LOG_GATE} on head 0"
    bound = 64 * UNIT_ROUNDOFF["float64"] if dtype == "float64" else 4 * UNIT_ROUNDOFF["float16"]
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g), rel_l2=bound, chunk_size=TILES["chunk_size"],
                 name=f"the interpreted {dtype} program, g = {STRONG_LOG_GATE} on head 0")


def test_length_not_a_multiple_of_the_chunk(build_program):
    B, N, H, d_k, d_v = 1, 45, 2, 32, 32  # three chunks of 16, the last one 13 tokens and 3 of padding
    x = _inputs(B, N, H, d_k, d_v, seed=45)
    q, k, v = (padded_to_chunks(a, TILES["chunk_size"]) for a in (x.q, x.k, x.v))
    program = build(build_program, B, q.shape[1], H, d_k, d_v, dtype="float64", **TILES)
    actual = run_on_cpu(program, [q, k, v, x.g], out_idx=[4])[:, :N]
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g), rel_l2=64 * UNIT_ROUNDOFF["float64"],
                 chunk_size=TILES["chunk_size"], name="the interpreted float64 program on a zero-padded sequence")


def test_writes_only_its_output(build_program):
    assert_writes_only(build(build_program, 2, 64, 2, 32, 32, **TILES), outputs=[4])


def test_respects_ordering_constraints(build_program):
    assert_respects_ordering_constraints(build(build_program, 2, 64, 2, 32, 32, **TILES), constraints=[1, 2, 7])


def test_fits_the_shared_memory_of_an_h200(build_program):
    assert_fits_shared_memory(build(build_program, 1, 256, 2, BUDGET_HEAD_DIM, BUDGET_HEAD_DIM))


def library_cost(B, N, H, d_k, d_v):
    """The counts of the course's kernel at its default tiles."""
    from stages.s02_scalar_decay.kernel import build_program as library_program

    return counted_cost(library_program(B, N, H, d_k, d_v))


def test_cost_near_the_course_kernel(build_program):
    assert_cost_near_the_course_kernel(build(build_program, *COST_SHAPE), from_library(library_cost, *COST_SHAPE))


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills(build_program):
    compile_for_sm90a(build(build_program, 1, 4096, 8, BUDGET_HEAD_DIM, BUDGET_HEAD_DIM))


@pytest.mark.gpu
def test_runs_on_gpu_and_a_second_call_agrees(build_program):
    B, N, H, d_k, d_v = 2, 1024, 4, 128, 128
    x = _inputs(B, N, H, d_k, d_v, seed=8)
    program = build(build_program, B, N, H, d_k, d_v)
    dtypes = ["float16"] * 3 + ["float32"]
    actual = run_on_gpu(program, [x.q, x.k, x.v, x.g], [4], dtypes)
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g), rel_l2=4 * UNIT_ROUNDOFF["float16"],
                 chunk_size=64, name="the fp16 kernel on the GPU")
    # on a GPU the output starts as whatever memory held: a row the program never writes shows here
    assert np.array_equal(run_on_gpu(program, [x.q, x.k, x.v, x.g], [4], dtypes), actual), (
        "a second call gave another answer")
