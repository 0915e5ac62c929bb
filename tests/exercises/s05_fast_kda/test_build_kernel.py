"""Tests of exercise s05.build_kernel: stage 5's recurrence kernel, written whole.

They check what any correct program does, never how the course's is written. The program is fed what
reference C's prepare computes from q, k, v, g, beta (in float64; an fp16 program's parameters round
it as an fp16 prepare kernel's stores would), and its output and final state are compared with KDA's delta-rule form
(oracle.py), through the tile interpreter; then that it writes only O and Final_state, the ordering
constraints on its TIR, and the H200's budgets (shared memory from the TIR; with nvcc, no spills).
tests/course/test_build_exercises.py runs them on a second, differently tiled program too.

The initial state is not zero (a state cleared instead of loaded shows), the gates differ per
channel, beta spans [0, 1] with exact zeros and ones, and the sequences span several chunks.
"""

import dataclasses

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.program_cost import counted_cost
from stages.s05_fast_kda.reference import prepare
from tests.exercises.build_checks import (BUDGET_HEAD_DIM, assert_cost_near_the_course_kernel,
                                          assert_fits_shared_memory,
                                          assert_respects_ordering_constraints, assert_stores_fenced,
                                          assert_writes_only)
from tests.exercises.kernel_checks import (UNIT_ROUNDOFF, assert_close_in_precision, build, compile_for_sm90a,
                                           run_on_cpu, run_on_gpu)
from tests.exercises.library_values import from_library
from tests.exercises.s05_fast_kda.oracle import kda_delta_rule

STAGE = "s05_fast_kda"
TILES = dict(chunk_size=16, block_dv=16)
COST_SHAPE = (1, 1024, 4, 128, 128)  # B, N, H, d_k, d_v: the kernel's head dims, 16 chunks at C = 64
OUTPUTS = [7, 8]  # O, Final_state
STRONG_LOG_GATE = -50.0  # e^-50 per token: the channel forgets at once
FLOAT64_BOUND = 64 * UNIT_ROUNDOFF["float64"]  # fp32 accumulators and decays: O(C + d_k) terms of 2^-24
FP16_BOUND = 4 * UNIT_ROUNDOFF["float16"]  # q, k, v and the stored operands rounded to fp16 once each


@pytest.fixture
def build_recurrence_program(target_module):
    return target_module(STAGE, "build_kernel.py").build_recurrence_program


def _inputs(B, N, H, d_k, d_v, seed, gate_range=(0.5, 0.999)):
    """Channel gates, betas over [0, 1] with exact zeros and ones, and a nonzero initial state."""
    x = make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=gate_range, beta_range=(0.0, 1.0), seed=seed)
    x.beta[:, ::7] = 0.0  # a token that writes nothing and erases nothing
    x.beta[:, 3::7] = 1.0  # a token whose key's old value is erased entirely
    initial_state = np.random.default_rng(seed).standard_normal((B, H, d_k, d_v)) / np.sqrt(d_k)
    return x, initial_state


def _run(build_recurrence_program, x, initial_state, dtype):
    """The program on prepare's tensors, exact (an fp16 program's parameters round them as an fp16 prepare
    kernel's stores do): (o cut to the sequence, final state)."""
    prepared = from_library(prepare, x.q, x.k, x.v, x.g, x.beta, TILES["chunk_size"])
    tensors = [getattr(prepared, field.name) for field in dataclasses.fields(prepared)]
    B, N_padded, H, d_k = tensors[0].shape
    program = build(build_recurrence_program, B, N_padded, H, d_k, x.v.shape[-1], dtype=dtype, **TILES)
    o, final_state = run_on_cpu(program, [*tensors, initial_state], out_idx=OUTPUTS)
    return o[:, :x.q.shape[1]], final_state


def _assert_matches_delta_rule(actual, x, initial_state, dtype, what):
    __tracebackhide__ = True
    o, final_state = actual
    expected_o, expected_state = kda_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state)
    assert np.isfinite(o).all() and np.isfinite(final_state).all(), f"{what} gives inf or NaN"
    check, bound = (assert_close, FLOAT64_BOUND) if dtype == "float64" else (assert_close_in_precision, FP16_BOUND)
    check(o, expected_o, rel_l2=bound, chunk_size=TILES["chunk_size"], name=f"o of {what}")
    assert_close(final_state, expected_state, rel_l2=bound, axes=("batch", "head", "key", "value"),
                 name=f"the final state of {what}")


@pytest.mark.parametrize(
    "B, N, H, d_k, d_v",
    [
        (1, 16, 2, 32, 16),  # one chunk, one block of value columns
        (2, 64, 2, 32, 32),  # four chunks: the state carries over, decayed; two blocks of value columns
    ],
)
def test_float64_program_matches_the_delta_rule(build_recurrence_program, B, N, H, d_k, d_v):
    x, initial_state = _inputs(B, N, H, d_k, d_v, seed=N + d_v)
    _assert_matches_delta_rule(_run(build_recurrence_program, x, initial_state, "float64"), x, initial_state,
                               "float64", "the interpreted float64 program")


def test_fp16_program_within_rounding(build_recurrence_program):
    x, initial_state = _inputs(2, 64, 2, 32, 32, seed=12, gate_range=(0.9, 0.999))
    _assert_matches_delta_rule(_run(build_recurrence_program, x, initial_state, "float16"), x, initial_state,
                               "float16", "the interpreted fp16 program")


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # reference C's prepare: products
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # that its masks then drop
@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_strong_gates(build_recurrence_program, dtype):
    x, initial_state = _inputs(1, 64, 2, 32, 32, seed=50, gate_range=(0.9, 0.999))
    x.g[..., ::5] = STRONG_LOG_GATE  # every fifth channel forgets at every token
    _assert_matches_delta_rule(_run(build_recurrence_program, x, initial_state, dtype), x, initial_state, dtype,
                               f"the interpreted {dtype} program, g = {STRONG_LOG_GATE} on every fifth channel")


def test_length_not_a_multiple_of_the_chunk(build_recurrence_program):
    x, initial_state = _inputs(1, 45, 2, 32, 32, seed=45)  # prepare pads to three chunks of 16
    _assert_matches_delta_rule(_run(build_recurrence_program, x, initial_state, "float64"), x, initial_state,
                               "float64", "the interpreted float64 program on a padded sequence")


def test_writes_only_its_outputs(build_recurrence_program):
    assert_writes_only(build(build_recurrence_program, 2, 64, 2, 32, 32, **TILES), outputs=OUTPUTS)


def test_respects_ordering_constraints(build_recurrence_program):
    assert_respects_ordering_constraints(build(build_recurrence_program, 2, 64, 2, 32, 32, **TILES),
                                         constraints=[1, 2])


def test_fences_the_tiles_it_stores(build_recurrence_program):
    assert_stores_fenced(build(build_recurrence_program, 2, 64, 2, 32, 32, **TILES))


def test_fits_the_shared_memory_of_an_h200(build_recurrence_program):
    assert_fits_shared_memory(build(build_recurrence_program, 1, 256, 2, BUDGET_HEAD_DIM, BUDGET_HEAD_DIM))


def library_cost(B, N, H, d_k, d_v):
    """The counts of the course's kernel at its default tiles."""
    from stages.s05_fast_kda.kernel import build_recurrence_program as library_program

    return counted_cost(library_program(B, N, H, d_k, d_v))


def test_cost_near_the_course_kernel(build_recurrence_program):
    assert_cost_near_the_course_kernel(build(build_recurrence_program, *COST_SHAPE), from_library(library_cost, *COST_SHAPE))


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills(build_recurrence_program):
    compile_for_sm90a(build(build_recurrence_program, 1, 4096, 8, BUDGET_HEAD_DIM, BUDGET_HEAD_DIM))


@pytest.mark.gpu
def test_runs_on_gpu_and_a_second_call_agrees(build_recurrence_program):
    B, N, H, d_k, d_v, C = 2, 1024, 4, 128, 128, 64
    x, initial_state = _inputs(B, N, H, d_k, d_v, seed=8, gate_range=(0.9, 0.999))
    prepared = from_library(prepare, x.q, x.k, x.v, x.g, x.beta, C)
    arguments = [getattr(prepared, field.name) for field in dataclasses.fields(prepared)] + [initial_state]
    dtypes = ["float16"] * 5 + ["float32"] * 2
    program = build(build_recurrence_program, B, N, H, d_k, d_v, chunk_size=C)
    actual = run_on_gpu(program, arguments, OUTPUTS, dtypes)
    expected_o, _ = kda_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state)
    assert_close_in_precision(actual[0], expected_o, rel_l2=FP16_BOUND, chunk_size=C, name="o of the fp16 kernel on the GPU")
    # on a GPU the outputs start as whatever memory held: an element the program never writes shows here
    again = run_on_gpu(program, arguments, OUTPUTS, dtypes)
    assert all(np.array_equal(a, b) for a, b in zip(again, actual)), "a second call gave another answer"
