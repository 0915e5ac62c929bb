"""Tests of exercise s06.kernel_program: the reverse chunk loop of stage 6's backward as a TileLang
program, on tensors from the library's prepare (stage 5's reference C).

On any machine the program runs through the tile interpreter: in float64 its three outputs (dS^T at
every chunk end, dV_new, dS_0^T) must equal reference C's state_gradients within fp32's rounding
(the accumulators); in fp16 within a few units of fp16's. With nvcc it compiles for sm_90a without
spills; on a GPU it runs.
"""

import pytest

from stages.common.compare import assert_close
from stages.s05_fast_kda.reference import prepare
from stages.s06_backward.reference import state_gradients
from tests.exercises.build_checks import assert_stores_fenced, assert_writes_only
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, build, compile_for_sm90a, run_on_cpu, run_on_gpu
from tests.exercises.library_values import from_library
from tests.exercises.s06_backward.oracle import backward_inputs

STAGE = "s06_backward"
OUT_IDX = [7, 8, 9]  # D_states, dV_new, D_initial_state
OUTPUTS = (("d_states", ("batch", "chunk", "head", "key channel", "value channel")),
           ("dv_new", None), ("d_initial_state", ("batch", "head", "key channel", "value channel")))


@pytest.fixture
def build_state_gradient_program(target_module):
    return target_module(STAGE, "kernel_program.py").build_state_gradient_program


def _program_inputs(B, N, H, d_k, d_v, chunk_size, seed, gate_range=(0.5, 0.999)):
    """The program's inputs from the library's prepare, and reference C's state_gradients' result."""
    x, do, _, dS_N = backward_inputs(B, N, H, d_k, d_v, seed, gate_range)
    tensors = from_library(prepare, x.q, x.k, x.v, x.g, x.beta, chunk_size)
    inputs = [tensors.q_decayed, tensors.k_to_chunk_end, tensors.w, tensors.a_qk, tensors.chunk_decay, do, dS_N]
    return inputs, from_library(state_gradients, tensors, do, d_v, dS_N)


def _assert_outputs_close(actual, expected, rel_l2, chunk_size, what):
    __tracebackhide__ = True
    for (name, axes), output in zip(OUTPUTS, actual):
        assert_close(output, getattr(expected, name), rel_l2=rel_l2, name=f"{name} of the {what}", axes=axes,
                     chunk_size=chunk_size if name == "dv_new" else None)


@pytest.mark.parametrize("B, N, H, d_k, d_v, chunk_size, block_dv", [
    (1, 128, 2, 32, 32, 32, 16),  # four chunks, two blocks of value columns
    (2, 64, 1, 32, 16, 64, 16),  # one chunk
])
def test_float64_program_equals_reference_c(build_state_gradient_program, B, N, H, d_k, d_v, chunk_size, block_dv):
    inputs, expected = _program_inputs(B, N, H, d_k, d_v, chunk_size, seed=N + chunk_size)
    program = build(build_state_gradient_program, B, N, H, d_k, d_v, chunk_size, block_dv, dtype="float64")
    actual = run_on_cpu(program, inputs, out_idx=OUT_IDX)
    # fp32 accumulators (and fp32 gates) carried across up to four chunks: measured 0.45-0.64 u
    _assert_outputs_close(actual, expected, 4 * UNIT_ROUNDOFF["float64"], chunk_size, "interpreted float64 program")


def test_fp16_program_within_rounding(build_state_gradient_program):
    B, N, H, d_k, d_v, chunk_size, block_dv = 1, 128, 1, 32, 32, 32, 32
    inputs, expected = _program_inputs(B, N, H, d_k, d_v, chunk_size, seed=3)
    program = build(build_state_gradient_program, B, N, H, d_k, d_v, chunk_size, block_dv, dtype="float16")
    actual = run_on_cpu(program, inputs, out_idx=OUT_IDX)
    # the five fp16 operands rounded once, dS'^T rounded to fp16 as a GEMM operand every chunk:
    # measured 0.45-0.74 u
    _assert_outputs_close(actual, expected, 3 * UNIT_ROUNDOFF["float16"], chunk_size, "interpreted fp16 program")


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills(build_state_gradient_program):
    compile_for_sm90a(build(build_state_gradient_program, 1, 4096, 8, 128, 128))


@pytest.mark.gpu
def test_runs_on_gpu(build_state_gradient_program):
    B, N, H, d_k, d_v, chunk_size = 2, 1024, 4, 128, 128, 64
    inputs, expected = _program_inputs(B, N, H, d_k, d_v, chunk_size, seed=8)
    program = build(build_state_gradient_program, B, N, H, d_k, d_v, chunk_size)
    actual = run_on_gpu(program, inputs, OUT_IDX, ["float16"] * 4 + ["float32", "float16", "float32"])
    _assert_outputs_close(actual, expected, 4 * UNIT_ROUNDOFF["float16"], chunk_size, "fp16 kernel on the GPU")


def test_writes_only_its_outputs(build_state_gradient_program):
    """The gradient of the final state it starts from, and every other input, come back as they went in."""
    assert_writes_only(build(build_state_gradient_program, 1, 128, 2, 32, 32, chunk_size=32, block_dv=16),
                       outputs=OUT_IDX)


def test_fences_the_tiles_it_stores(build_state_gradient_program):
    """dS'^T and dV_new go out through shared memory by TMA: each fenced after it is written."""
    assert_stores_fenced(build(build_state_gradient_program, 1, 128, 2, 32, 32, chunk_size=32, block_dv=16))
