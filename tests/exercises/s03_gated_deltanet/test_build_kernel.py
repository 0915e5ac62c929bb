"""Tests of exercise s03.build_kernel: stage 3's TileLang kernel, written whole.

They check what any correct program does, never how the course's is written: its values through the
tile interpreter (float64 against reference C, fp16 against reference A, strong gates, a zero-padded
length), that it writes only O, the ordering constraints on its TIR, and the H200's budgets (shared
memory from the TIR; with nvcc, no spills). tests/course/test_build_exercises.py runs them on a second
program, which pairs beta otherwise and tiles otherwise.

beta varies from token to token (equal betas hide a beta on the wrong side of the solve), one case
also has tokens with beta = 0 and beta = 1; the gates reach down to alpha = 0.5 and the sequences span
several chunks (g = 0 or a single chunk hides a decay left out).
"""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.program_cost import counted_cost
from stages.s03_gated_deltanet.reference import kernel_mirror, recurrent
from tests.exercises.build_checks import (BUDGET_HEAD_DIM, assert_cost_near_the_course_kernel,
                                          assert_fits_shared_memory,
                                          assert_respects_ordering_constraints, assert_writes_only, padded_to_chunks)
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, build, compile_for_sm90a, run_on_cpu, run_on_gpu
from tests.exercises.library_values import from_library

STAGE = "s03_gated_deltanet"
TILES = dict(chunk_size=16, block_dv=16)
COST_SHAPE = (1, 1024, 4, 128, 128)  # B, N, H, d_k, d_v: the kernel's head dims, 16 chunks at C = 64
GATE_RANGE = (0.5, 0.99)
STRONG_LOG_GATE = -50.0  # a decay of e^-50 at one token: the state forgets all before it
# float64 programs: fp32 GEMMs, gates and substitution, a unit of 2^-24 per term: (C + d_k) + C + C
FLOAT64_BOUND = 80 * UNIT_ROUNDOFF["float64"]
FP16_BOUND = 5 * UNIT_ROUNDOFF["float16"]  # nine fp16 roundings of at most u/2, none amplified


@pytest.fixture
def build_program(target_module):
    return target_module(STAGE, "build_kernel.py").build_program


def _inputs(B, N, H, d_k, d_v, seed, beta_at_0_and_1=False):
    x = make_inputs(B, N, H, d_k, d_v, gate="token", gate_range=GATE_RANGE, beta_range=(0.1, 0.9), seed=seed)
    if beta_at_0_and_1:
        x.beta[:, 3::7] = 0.0  # these tokens write nothing
        x.beta[:, 5::7] = 1.0  # these erase what the state held along their key
    return x


def _run(build_program, x, dtype):
    B, N_padded, H, d_k = x.q.shape
    program = build(build_program, B, N_padded, H, d_k, x.v.shape[-1], dtype=dtype, **TILES)
    return run_on_cpu(program, [x.q, x.k, x.v, x.g, x.beta], out_idx=[5])


@pytest.mark.parametrize(
    "B, N, H, d_k, d_v, beta_at_0_and_1",
    [
        (1, 16, 2, 32, 16, False),  # one chunk, one block of value columns
        (2, 64, 2, 32, 32, False),  # four chunks: the state carries over, decayed; two blocks of value columns
        (2, 64, 2, 32, 32, True),  # the same with some beta at 0 and some at 1
    ],
)
def test_float64_program_equals_reference_c(build_program, B, N, H, d_k, d_v, beta_at_0_and_1):
    x = _inputs(B, N, H, d_k, d_v, seed=N + d_v + beta_at_0_and_1, beta_at_0_and_1=beta_at_0_and_1)
    expected = from_library(kernel_mirror, x.q, x.k, x.v, x.g, x.beta, TILES["chunk_size"], TILES["block_dv"])
    assert_close(_run(build_program, x, "float64"), expected, rel_l2=FLOAT64_BOUND, chunk_size=TILES["chunk_size"],
                 name="the interpreted float64 program")


def test_fp16_program_within_rounding(build_program):
    x = _inputs(1, 64, 2, 32, 32, seed=3, beta_at_0_and_1=True)
    assert_close(_run(build_program, x, "float16"), from_library(recurrent, x.q, x.k, x.v, x.g, x.beta),
                 rel_l2=FP16_BOUND, chunk_size=TILES["chunk_size"], name="the interpreted fp16 program")


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_strong_gates(build_program, dtype):
    x = _inputs(1, 64, 2, 32, 32, seed=50)
    x.g[:, 5::11] = STRONG_LOG_GATE  # within chunks and on their first rows (token 16 = 5 + 11)
    actual = _run(build_program, x, dtype)
    assert np.isfinite(actual).all(), f"the {dtype} program gives inf or NaN with g = {STRONG_LOG_GATE} at some tokens"
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g, x.beta),
                 rel_l2=FLOAT64_BOUND if dtype == "float64" else FP16_BOUND, chunk_size=TILES["chunk_size"],
                 name=f"the interpreted {dtype} program, g = {STRONG_LOG_GATE} at some tokens")


def test_length_not_a_multiple_of_the_chunk(build_program):
    N = 45  # three chunks of 16, the last one 13 tokens and 3 of padding (g = 0, beta = 0)
    x = _inputs(1, N, 2, 32, 32, seed=45, beta_at_0_and_1=True)
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
    from stages.s03_gated_deltanet.kernel import build_program as library_program

    return counted_cost(library_program(B, N, H, d_k, d_v))


def test_cost_near_the_course_kernel(build_program):
    assert_cost_near_the_course_kernel(build(build_program, *COST_SHAPE), from_library(library_cost, *COST_SHAPE))


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills(build_program):
    compile_for_sm90a(build(build_program, 1, 4096, 8, BUDGET_HEAD_DIM, BUDGET_HEAD_DIM))


@pytest.mark.gpu
def test_runs_on_gpu_and_a_second_call_agrees(build_program):
    B, N, H, d_k, d_v = 2, 1024, 4, 128, 128
    x = _inputs(B, N, H, d_k, d_v, seed=8, beta_at_0_and_1=True)
    program = build(build_program, B, N, H, d_k, d_v)
    arguments, dtypes = [x.q, x.k, x.v, x.g, x.beta], ["float16"] * 3 + ["float32"] * 2
    actual = run_on_gpu(program, arguments, [5], dtypes)
    assert_close(actual, from_library(recurrent, *arguments), rel_l2=FP16_BOUND, chunk_size=64,
                 name="the fp16 kernel on the GPU")
    # on a GPU the output starts as whatever memory held: a row the program never writes shows here
    assert np.array_equal(run_on_gpu(program, arguments, [5], dtypes), actual), "a second call gave another answer"
