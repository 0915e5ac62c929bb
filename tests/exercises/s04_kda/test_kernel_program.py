"""Tests of exercise s04.kernel_program: KDA token by token as a TileLang program.

On any machine the program runs through the tile interpreter: in float64 it must equal reference A
(only its fp32 state rounds), with channel gates, betas at 0 and 1 among the inputs, a length that is
no multiple of anything and two blocks of value columns; in fp16 within fp16's rounding of it; at
strong gates (no exponent split here: any gate is in range) finite and as close. It writes only its
output. With nvcc it compiles for sm_90a without spills; on a GPU it runs.
"""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.common.oracles import kda_delta_rule
from stages.s04_kda.reference import recurrent
from tests.exercises.build_checks import assert_writes_only
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, build, compile_for_sm90a, run_on_cpu, run_on_gpu
from tests.exercises.library_values import from_library
from tests.exercises.strong_gates import STRONG_LOG_GATE, assert_finite

STAGE = "s04_kda"
SHAPE = (2, 37, 2, 16, 16)  # B, N, H, d_k, d_v: 37 tokens, no chunk to be a multiple of
BLOCK_DV = 8  # two blocks of value columns
OUT_IDX = [5]


@pytest.fixture
def build_recurrent_program(target_module):
    return target_module(STAGE, "kernel_program.py").build_recurrent_program


def _inputs(seed, gate_range=(0.5, 0.999)):
    """Channel gates in `gate_range`, betas over [0, 1] with exact zeros and ones among them."""
    x = make_inputs(*SHAPE, gate="channel", gate_range=gate_range, beta_range=(0.0, 1.0), seed=seed)
    x.beta[:, ::7] = 0.0  # a token that writes nothing and erases nothing
    x.beta[:, 3::7] = 1.0  # a token whose key's old value is erased entirely
    return x


def _run(build_recurrent_program, x, dtype):
    program = build(build_recurrent_program, *SHAPE, block_dv=BLOCK_DV, dtype=dtype)
    return run_on_cpu(program, [x.q, x.k, x.v, x.g, x.beta], out_idx=OUT_IDX)


def test_float64_program_equals_reference_a(build_recurrent_program):
    x = _inputs(seed=11)
    # the state is fp32: each step rounds d_k products to 2^-24, and the decays (<= 1) damp old errors
    assert_close(_run(build_recurrent_program, x, "float64"), from_library(recurrent, x.q, x.k, x.v, x.g, x.beta),
                 rel_l2=64 * UNIT_ROUNDOFF["float64"], name="the interpreted float64 program")


def test_fp16_program_within_rounding(build_recurrent_program):
    x = _inputs(seed=12, gate_range=(0.9, 0.999))
    # q, k, v and o are rounded to fp16 once each; the state stays fp32
    assert_close(_run(build_recurrent_program, x, "float16"), from_library(recurrent, x.q, x.k, x.v, x.g, x.beta),
                 rel_l2=4 * UNIT_ROUNDOFF["float16"], name="the interpreted fp16 program")


def test_strong_gates(build_recurrent_program):
    x = _inputs(seed=13)
    x.g[..., ::2] = STRONG_LOG_GATE  # every other key channel forgets at every token
    actual = _run(build_recurrent_program, x, "float64")
    assert_finite(actual, "every other key channel")
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g, x.beta), rel_l2=64 * UNIT_ROUNDOFF["float64"],
                 name=f"the interpreted float64 program, g = {STRONG_LOG_GATE:g} on every other key channel")


def test_writes_only_its_output(build_recurrent_program):
    assert_writes_only(build(build_recurrent_program, *SHAPE, block_dv=BLOCK_DV), outputs=OUT_IDX)


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills(build_recurrent_program):
    compile_for_sm90a(build(build_recurrent_program, 1, 4096, 8, 128, 128))


@pytest.mark.gpu
def test_runs_on_gpu(build_recurrent_program):
    B, N, H, d_k, d_v = 1, 256, 2, 64, 64
    x = make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=(0.9, 0.999), beta_range=(0.1, 0.9), seed=8)
    program = build(build_recurrent_program, B, N, H, d_k, d_v)
    o = run_on_gpu(program, [x.q, x.k, x.v, x.g, x.beta], OUT_IDX, ["float16"] * 3 + ["float32"] * 2)
    expected = kda_delta_rule(x.q, x.k, x.v, x.g, x.beta)
    print(f"s04 token-by-token exercise kernel fp16: {error_report(o, expected)}")
    assert np.isfinite(o).all()
    assert_close(o, expected, rel_l2=5e-3)
