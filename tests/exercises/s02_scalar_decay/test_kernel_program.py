"""Tests of exercise s02.kernel_program: linear attention with a decay per head, token by token, as a
TileLang program.

On any machine the program runs through the tile interpreter: in float64 it must equal reference A
(only its fp32 state rounds), with gates down to alpha = 0.5, a length that is no multiple of
anything and two blocks of value columns; in fp16 within fp16's rounding of it; at a strong gate
finite and as close. It writes only its output. With nvcc it compiles for sm_90a without spills; on a
GPU it runs.
"""

import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.s02_scalar_decay.reference import recurrent
from tests.exercises.build_checks import assert_writes_only
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, build, compile_for_sm90a, run_on_cpu, run_on_gpu
from tests.exercises.library_values import from_library
from tests.exercises.strong_gates import STRONG_LOG_GATE, assert_finite

STAGE = "s02_scalar_decay"
SHAPE = (2, 37, 2, 16, 16)  # B, N, H, d_k, d_v: 37 tokens, no chunk to be a multiple of
BLOCK_DV = 8  # two blocks of value columns
GATE_RANGE = (0.5, 0.99)
OUT_IDX = [4]


@pytest.fixture
def build_recurrent_program(target_module):
    return target_module(STAGE, "kernel_program.py").build_recurrent_program


def _run(build_recurrent_program, x, dtype):
    program = build(build_recurrent_program, *SHAPE, block_dv=BLOCK_DV, dtype=dtype)
    return run_on_cpu(program, [x.q, x.k, x.v, x.g], out_idx=OUT_IDX)


def test_float64_program_equals_reference_a(build_recurrent_program):
    x = make_inputs(*SHAPE, gate="head", gate_range=GATE_RANGE, seed=11)
    # the state is fp32: each step rounds d_k products to 2^-24, and the decay (<= 1) damps old errors
    assert_close(_run(build_recurrent_program, x, "float64"), from_library(recurrent, x.q, x.k, x.v, x.g),
                 rel_l2=64 * UNIT_ROUNDOFF["float64"], name="the interpreted float64 program")


def test_fp16_program_within_rounding(build_recurrent_program):
    x = make_inputs(*SHAPE, gate="head", gate_range=GATE_RANGE, seed=12)
    # q, k, v and o are rounded to fp16 once each; the state stays fp32
    assert_close(_run(build_recurrent_program, x, "float16"), from_library(recurrent, x.q, x.k, x.v, x.g),
                 rel_l2=4 * UNIT_ROUNDOFF["float16"], name="the interpreted fp16 program")


def test_strong_gate(build_recurrent_program):
    x = make_inputs(*SHAPE, gate="head", gate_range=GATE_RANGE, seed=13)
    x.g[0] = STRONG_LOG_GATE  # head 0 forgets all but the last token; head 1 keeps its gate
    actual = _run(build_recurrent_program, x, "float64")
    assert_finite(actual, "head 0")
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g), rel_l2=64 * UNIT_ROUNDOFF["float64"],
                 name=f"the interpreted float64 program, g = {STRONG_LOG_GATE:g} on head 0")


def test_writes_only_its_output(build_recurrent_program):
    assert_writes_only(build(build_recurrent_program, *SHAPE, block_dv=BLOCK_DV), outputs=OUT_IDX)


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills(build_recurrent_program):
    compile_for_sm90a(build(build_recurrent_program, 1, 4096, 8, 128, 128))


@pytest.mark.gpu
def test_runs_on_gpu(build_recurrent_program):
    B, N, H, d_k, d_v = 2, 256, 4, 128, 128
    x = make_inputs(B, N, H, d_k, d_v, gate="head", gate_range=GATE_RANGE, seed=8)
    actual = run_on_gpu(build(build_recurrent_program, B, N, H, d_k, d_v), [x.q, x.k, x.v, x.g], OUT_IDX,
                        ["float16"] * 3 + ["float32"])
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g), rel_l2=4 * UNIT_ROUNDOFF["float16"],
                 name="the fp16 token-by-token program on the GPU")
