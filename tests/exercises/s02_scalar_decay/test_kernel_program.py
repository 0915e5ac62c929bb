"""Tests of exercise s02.kernel_program: the decays of stage 2's TileLang kernel.

On any machine the program runs through the tile interpreter: in float64 it must equal reference C
(only its fp32 accumulators and fp32 decays round), in fp16 it must match the exact result within
fp16's rounding. With nvcc it compiles for sm_90a without spills; on a GPU it runs.

The gates reach down to alpha = 0.5 and the sequences span several chunks: g = 0 or a single chunk
hides a state decayed in the wrong order and a decay counted from the wrong start.
"""

import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.s02_scalar_decay.reference import kernel_mirror, recurrent
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, build, compile_for_sm90a, run_on_cpu, run_on_gpu
from tests.exercises.library_values import from_library

STAGE = "s02_scalar_decay"
TILES = dict(chunk_size=16, block_dv=16)
GATE_RANGE = (0.5, 0.99)


@pytest.fixture
def build_program(target_module):
    return target_module(STAGE, "kernel_program.py").build_program


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


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills(build_program):
    compile_for_sm90a(build(build_program, 1, 4096, 8, 128, 128))


@pytest.mark.gpu
def test_runs_on_gpu(build_program):
    B, N, H, d_k, d_v = 2, 1024, 4, 128, 128
    x = make_inputs(B, N, H, d_k, d_v, gate="head", gate_range=GATE_RANGE, seed=8)
    actual = run_on_gpu(build(build_program, B, N, H, d_k, d_v), [x.q, x.k, x.v, x.g], [4],
                        ["float16"] * 3 + ["float32"])
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g), rel_l2=4 * UNIT_ROUNDOFF["float16"], chunk_size=64,
                 name="the fp16 kernel on the GPU")
