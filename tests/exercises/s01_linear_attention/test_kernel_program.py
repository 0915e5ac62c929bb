"""Tests of exercise s01.kernel_program: linear attention token by token as a TileLang program.

On any machine the program runs through the tile interpreter: in float64 it must equal reference A
(only its fp32 state rounds), with a length that is no multiple of anything and two blocks of value
columns; in fp16 within fp16's rounding of it. It writes only its output. With nvcc it compiles for
sm_90a without spills; on a GPU it runs.
"""

import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.s01_linear_attention.reference import recurrent
from tests.exercises.build_checks import assert_writes_only
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, build, compile_for_sm90a, run_on_cpu, run_on_gpu
from tests.exercises.library_values import from_library

STAGE = "s01_linear_attention"
SHAPE = (2, 37, 2, 16, 16)  # B, N, H, d_k, d_v: 37 tokens, no chunk to be a multiple of
BLOCK_DV = 8  # two blocks of value columns
OUT_IDX = [3]


@pytest.fixture
def build_recurrent_program(target_module):
    return target_module(STAGE, "kernel_program.py").build_recurrent_program


def _run(build_recurrent_program, x, dtype):
    program = build(build_recurrent_program, *SHAPE, block_dv=BLOCK_DV, dtype=dtype)
    return run_on_cpu(program, [x.q, x.k, x.v], out_idx=OUT_IDX)


def test_float64_program_equals_reference_a(build_recurrent_program):
    x = make_inputs(*SHAPE, seed=11)
    # the state is fp32: it sums up to 37 rank-one terms, each rounded to 2^-24
    assert_close(_run(build_recurrent_program, x, "float64"), from_library(recurrent, x.q, x.k, x.v),
                 rel_l2=64 * UNIT_ROUNDOFF["float64"], name="the interpreted float64 program")


def test_fp16_program_within_rounding(build_recurrent_program):
    x = make_inputs(*SHAPE, seed=12)
    # q, k, v and o are rounded to fp16 once each; the state stays fp32
    assert_close(_run(build_recurrent_program, x, "float16"), from_library(recurrent, x.q, x.k, x.v),
                 rel_l2=4 * UNIT_ROUNDOFF["float16"], name="the interpreted fp16 program")


def test_writes_only_its_output(build_recurrent_program):
    assert_writes_only(build(build_recurrent_program, *SHAPE, block_dv=BLOCK_DV), outputs=OUT_IDX)


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills(build_recurrent_program):
    compile_for_sm90a(build(build_recurrent_program, 1, 4096, 8, 128, 128))


@pytest.mark.gpu
def test_runs_on_gpu(build_recurrent_program):
    B, N, H, d_k, d_v = 2, 256, 4, 128, 128
    x = make_inputs(B, N, H, d_k, d_v, seed=8)
    actual = run_on_gpu(build(build_recurrent_program, B, N, H, d_k, d_v), [x.q, x.k, x.v], OUT_IDX, ["float16"] * 3)
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v), rel_l2=4 * UNIT_ROUNDOFF["float16"],
                 name="the fp16 token-by-token program on the GPU")
