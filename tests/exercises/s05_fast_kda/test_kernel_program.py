"""Tests of exercise s05.kernel_program: the block inverse's merges in stage 5's prepare kernel.

On any machine the program runs through the tile interpreter: in float64 its six outputs must equal
reference C's prepare (W and U within the TF32 rounding of the merges, the others within fp32's); in
fp16, followed by the recurrence (in NumPy: the recurrence kernel is exercise s05.build_kernel, a stub
in the handout), its output must match reference A within fp16's rounding.
With nvcc it compiles for sm_90a without spills; on a GPU it runs.
"""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.s04_kda.reference import recurrent
from stages.s05_fast_kda.reference import SUB_BLOCK, prepare
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, build, compile_for_sm90a, run_on_cpu, run_on_gpu
from tests.exercises.library_values import from_library
from tests.exercises.s05_fast_kda.oracle import chunk_recurrence
from tests.exercises.strong_gates import STRONG_LOG_GATE

STAGE = "s05_fast_kda"
OUTPUTS = ("w", "u", "q_decayed", "k_to_chunk_end", "a_qk", "chunk_decay")  # the program's out_idx order
PREPARE_OUT = [5, 6, 7, 8, 9, 10]
# The merges are fp32 GEMMs, which the tensor cores (and the interpreter) run on TF32 operands:
# 10 explicit mantissa bits, unit roundoff 2^-11, even in a float64 program.
TF32_UNIT_ROUNDOFF = 2.0**-11


@pytest.fixture
def build_prepare_program(target_module):
    return target_module(STAGE, "kernel_program.py").build_prepare_program


def _inputs(B, N, H, d_k, d_v, gate_range, seed):
    return make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=gate_range, beta_range=(0.1, 0.9), seed=seed)


@pytest.mark.parametrize(
    "B, N, H, d_k, d_v, chunk_size, gate_range",
    [
        # two chunks of four sub-blocks, gates near 1: the merged blocks of T are as large as the diagonal ones
        (1, 128, 2, 32, 32, 64, (0.9, 0.999)),
        # four chunks of two sub-blocks, strong gates: the anchors' range, a merge of one block row each
        (2, 128, 1, 32, 32, 32, (0.5, 0.999)),
    ],
)
def test_float64_program_equals_reference_c(build_prepare_program, B, N, H, d_k, d_v, chunk_size, gate_range):
    x = _inputs(B, N, H, d_k, d_v, gate_range, seed=N + chunk_size)
    program = build(build_prepare_program, B, N, H, d_k, d_v, chunk_size, dtype="float64")
    actual = run_on_cpu(program, [x.q, x.k, x.v, x.g, x.beta], out_idx=PREPARE_OUT)
    expected = from_library(prepare, x.q, x.k, x.v, x.g, x.beta, chunk_size)
    for name, output in zip(OUTPUTS, actual):
        if name in ("w", "u"):
            # W and U read every entry of T; its merged blocks are two products of TF32 operands,
            # each rounding by at most about 2^-11 relative, partly cancelling over the L2 sum
            bound = 2 * TF32_UNIT_ROUNDOFF
        else:
            # no merge: the gates' fp32 cumulative sum over up to 64 rows, and fp32 accumulators
            bound = 64 * UNIT_ROUNDOFF["float64"]
        axes = ("batch", "chunk", "head", "channel") if name == "chunk_decay" else None
        assert_close(output, getattr(expected, name), rel_l2=bound, name=f"{name} of the interpreted float64 program",
                     axes=axes, chunk_size=None if name == "chunk_decay" else chunk_size)


def test_fp16_program_within_rounding(build_prepare_program):
    B, N, H, d_k, d_v, chunk_size = 1, 128, 2, 32, 32, 64
    x = _inputs(B, N, H, d_k, d_v, (0.5, 0.999), seed=3)
    prepared = run_on_cpu(build(build_prepare_program, B, N, H, d_k, d_v, chunk_size, dtype="float16"),
                          [x.q, x.k, x.v, x.g, x.beta], out_idx=PREPARE_OUT)
    actual, _ = chunk_recurrence(*prepared)
    # q, k, v and the five stored operands are each rounded to fp16 once: a few units of 2^-11
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g, x.beta), rel_l2=4 * UNIT_ROUNDOFF["float16"],
                 chunk_size=chunk_size, name="the interpreted fp16 prepare program, then the recurrence")


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills(build_prepare_program):
    compile_for_sm90a(build(build_prepare_program, 1, 4096, 8, 128, 128))


@pytest.mark.gpu
def test_runs_on_gpu(build_prepare_program):
    B, N, H, d_k, d_v, chunk_size = 2, 1024, 4, 128, 128, 64
    x = _inputs(B, N, H, d_k, d_v, (0.5, 0.999), seed=8)
    prepared = run_on_gpu(build(build_prepare_program, B, N, H, d_k, d_v, chunk_size),
                          [x.q, x.k, x.v, x.g, x.beta], PREPARE_OUT, ["float16"] * 3 + ["float32"] * 2)
    actual, _ = chunk_recurrence(*prepared)
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g, x.beta), rel_l2=4 * UNIT_ROUNDOFF["float16"],
                 chunk_size=chunk_size, name="the fp16 prepare kernel on the GPU, then the recurrence")


def test_fp16_program_takes_the_exact_path_where_a_sub_block_is_wide(build_prepare_program):
    """Gates that flag some diagonal sub-blocks for the exact path and not others. In the fp16 program a
    sub-block's anchored factors stay on the GEMMs up to a span of FAST_SPAN_LOG["float16"] (5.5
    e-folds); a log gate of STRONG_LOG_GATE puts its widest factor on the sub-block's first row (the
    gate on the row after it: e^{gamma_first - gamma_middle}) in chunk 0's first sub-block and on its
    last row (the gate on that row: e^{gamma_middle - gamma_last}) in chunk 0's third, in half the key
    channels; every other sub-block keeps gates of 0.9 or more (0.84 e-folds), on the fast path."""
    B, N, H, d_k, d_v, chunk_size = 1, 128, 1, 32, 32, 64
    x = _inputs(B, N, H, d_k, d_v, (0.9, 0.999), seed=8)
    first_row_of_block_0, last_row_of_block_2 = 0, 2 * SUB_BLOCK + SUB_BLOCK - 1
    x.g[0, first_row_of_block_0 + 1, 0, ::2] = STRONG_LOG_GATE
    x.g[0, last_row_of_block_2, 0, 1::2] = STRONG_LOG_GATE
    prepared = run_on_cpu(build(build_prepare_program, B, N, H, d_k, d_v, chunk_size, dtype="float16"),
                          [x.q, x.k, x.v, x.g, x.beta], out_idx=PREPARE_OUT)
    actual, _ = chunk_recurrence(*prepared)
    assert np.isfinite(actual).all(), (
        "the output has inf or NaN where a diagonal sub-block's gates are strong: is every wide sub-block "
        "flagged (its span from its first row to its last), and does its exact result stay where it is written?")
    assert_close(actual, from_library(recurrent, x.q, x.k, x.v, x.g, x.beta), rel_l2=4 * UNIT_ROUNDOFF["float16"],
                 chunk_size=chunk_size, name="the interpreted fp16 prepare program with two wide sub-blocks, then the recurrence")
