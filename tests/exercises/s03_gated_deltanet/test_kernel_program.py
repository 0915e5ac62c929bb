"""Tests of exercise s03.kernel_program: the UT transform of stage 3's TileLang kernel.

On any machine the program runs through the tile interpreter: in float64 it must equal reference C
(only its fp32 accumulators, gates and substitution round), in fp16 it must match the exact result
within fp16's rounding. With nvcc it compiles for sm_90a without spills; on a GPU it runs.

beta varies from token to token (equal betas hide a beta applied on the wrong side of the solve),
one case also has tokens with beta = 0 (nothing written) and beta = 1 (the old value erased); the
gates reach down to alpha = 0.5 and the sequences span several chunks (g = 0 or a single chunk hides
a decay left out).
"""

import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.s03_gated_deltanet.reference import kernel_mirror, recurrent
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, build, compile_for_sm90a, run_on_cpu, run_on_gpu
from tests.exercises.library_values import from_library

STAGE = "s03_gated_deltanet"
TILES = dict(chunk_size=16, block_dv=16)
GATE_RANGE = (0.5, 0.99)


@pytest.fixture
def build_program(target_module):
    return target_module(STAGE, "kernel_program.py").build_program


def _inputs(B, N, H, d_k, d_v, seed, beta_at_0_and_1=False):
    x = make_inputs(B, N, H, d_k, d_v, gate="token", gate_range=GATE_RANGE, beta_range=(0.1, 0.9), seed=seed)
    if beta_at_0_and_1:
        x.beta[:, 3::7] = 0.0  # these tokens write nothing
        x.beta[:, 5::7] = 1.0  # these erase what the state held along their key
    return x


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
    program = build(build_program, B, N, H, d_k, d_v, dtype="float64", **TILES)
    actual = run_on_cpu(program, [x.q, x.k, x.v, x.g, x.beta], out_idx=[5])
    expected = from_library(kernel_mirror, x.q, x.k, x.v, x.g, x.beta, TILES["chunk_size"], TILES["block_dv"])
    # fp32 accumulators and fp32 gates: the GEMMs sum O(C + d_k) products, the substitution O(C) more
    # in fp32 (on I + L, well conditioned for unit keys and beta <= 1), gamma is a prefix sum of C fp32
    # gates; a unit of 2^-24 per term: (C + d_k) + C + C = 80 for C = 16, d_k = 32
    assert_close(actual, expected, rel_l2=80 * UNIT_ROUNDOFF["float64"], chunk_size=TILES["chunk_size"],
                 name="the interpreted float64 program")


def test_fp16_program_within_rounding(build_program):
    B, N, H, d_k, d_v = 1, 64, 2, 32, 32
    x = _inputs(B, N, H, d_k, d_v, seed=3, beta_at_0_and_1=True)
    program = build(build_program, B, N, H, d_k, d_v, dtype="float16", **TILES)
    actual = run_on_cpu(program, [x.q, x.k, x.v, x.g, x.beta], out_idx=[5])
    # q, k, v, W, the state, A_qk, V_new and the decayed Q and K are each rounded to fp16 once: at
    # most u/2 each, 4.5u if all nine added up; the decays are <= 1 and the delta rule's updates
    # contract (unit keys, beta <= 1), so none is amplified
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g, x.beta), rel_l2=5 * UNIT_ROUNDOFF["float16"],
                 chunk_size=TILES["chunk_size"], name="the interpreted fp16 program")


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills(build_program):
    compile_for_sm90a(build(build_program, 1, 4096, 8, 128, 128))


@pytest.mark.gpu
def test_runs_on_gpu(build_program):
    B, N, H, d_k, d_v = 2, 1024, 4, 128, 128
    x = _inputs(B, N, H, d_k, d_v, seed=8, beta_at_0_and_1=True)
    actual = run_on_gpu(build(build_program, B, N, H, d_k, d_v), [x.q, x.k, x.v, x.g, x.beta], [5],
                        ["float16"] * 3 + ["float32"] * 2)
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g, x.beta), rel_l2=5 * UNIT_ROUNDOFF["float16"],
                 chunk_size=64, name="the fp16 kernel on the GPU")
