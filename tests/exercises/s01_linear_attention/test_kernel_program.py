"""Tests of exercise s01.kernel_program: the chunk loop of stage 1's TileLang kernel.

On any machine the program runs through the tile interpreter: in float64 it must equal reference C
(only its fp32 accumulators round), in fp16 it must match the exact result within fp16's rounding.
With nvcc it compiles for sm_90a without spills; on a GPU it runs.
"""

import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.s01_linear_attention.reference import kernel_mirror, recurrent
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, build, compile_for_sm90a, run_on_cpu, run_on_gpu
from tests.exercises.library_values import from_library

STAGE = "s01_linear_attention"
TILES = dict(chunk_size=16, block_dv=16)


@pytest.fixture
def build_program(target_module):
    return target_module(STAGE, "kernel_program.py").build_program


@pytest.mark.parametrize(
    "B, N, H, d_k, d_v",
    [
        (1, 16, 2, 32, 16),  # one chunk, one block of value columns
        (2, 64, 2, 32, 32),  # four chunks: the state carries over; two blocks of value columns
    ],
)
def test_float64_program_equals_reference_c(build_program, B, N, H, d_k, d_v):
    x = make_inputs(B, N, H, d_k, d_v, seed=N + d_v)
    program = build(build_program, B, N, H, d_k, d_v, dtype="float64", **TILES)
    actual = run_on_cpu(program, [x.q, x.k, x.v], out_idx=[3])
    expected = from_library(kernel_mirror, x.q, x.k, x.v, TILES["chunk_size"], TILES["block_dv"])
    # fp32 accumulators: each output sums O(C + d_k) products, each rounded to 2^-24
    assert_close(actual, expected, rel_l2=64 * UNIT_ROUNDOFF["float64"], chunk_size=TILES["chunk_size"],
                 name="the interpreted float64 program")


def test_fp16_program_within_rounding(build_program):
    B, N, H, d_k, d_v = 1, 64, 2, 32, 32
    x = make_inputs(B, N, H, d_k, d_v, seed=3)
    program = build(build_program, B, N, H, d_k, d_v, dtype="float16", **TILES)
    actual = run_on_cpu(program, [x.q, x.k, x.v], out_idx=[3])
    # q, k, v, the masked scores and the state are each rounded to fp16 once: a few units of 2^-11
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v), rel_l2=4 * UNIT_ROUNDOFF["float16"],
                 chunk_size=TILES["chunk_size"], name="the interpreted fp16 program")


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills(build_program):
    compile_for_sm90a(build(build_program, 1, 4096, 8, 128, 128))


@pytest.mark.gpu
def test_runs_on_gpu(build_program):
    B, N, H, d_k, d_v = 2, 1024, 4, 128, 128
    x = make_inputs(B, N, H, d_k, d_v, seed=8)
    actual = run_on_gpu(build(build_program, B, N, H, d_k, d_v), [x.q, x.k, x.v], [3], ["float16"] * 3)
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v), rel_l2=4 * UNIT_ROUNDOFF["float16"], chunk_size=64,
                 name="the fp16 kernel on the GPU")
