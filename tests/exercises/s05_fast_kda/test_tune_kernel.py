"""Tests of exercise s05.tune_kernel: stage 5's recurrence kernel brought under a cost target.

The values: through the tile interpreter, on the prepare kernel's outputs as reference C computes them
(stages.s05_fast_kda.reference.prepare) and a random initial state, the program's output and final
state equal reference C's recurrence in float64 (only its fp32 accumulators round) and match it in
fp16 within fp16's rounding. Several chunks and a nonzero S_0: a state that is not carried, or not
started from S_0, shows. The cost: each count of stages.common.program_cost within 5% of the library
kernel's at COST_SHAPE, the target computed here from the library (tests/exercises/tune_checks.py).
On a GPU, its time against the library kernel's.
"""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.program_cost import counted_cost
from stages.s05_fast_kda.reference import prepare, recurrence
from tests.exercises.build_checks import assert_stores_fenced, assert_writes_only
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, build, run_on_cpu
from tests.exercises.library_values import from_library
from tests.exercises.tune_checks import COUNTS, assert_cost_within_target, assert_time_within_target

STAGE = "s05_fast_kda"
SHAPE = (1, 128, 2, 32, 32)  # B, N, H, d_k, d_v
TILES = dict(chunk_size=32, block_dv=16)  # four chunks, two blocks of value columns
PREPARED = ("w", "u", "q_decayed", "k_to_chunk_end", "a_qk", "chunk_decay")  # the program's inputs, in order
OUT_IDX = [7, 8]  # o, the final state
COST_SHAPE = (1, 1024, 4, 128, 128)  # B, N, H, d_k, d_v: the kernel's head dims, 16 chunks


@pytest.fixture
def build_program(target_module):
    return target_module(STAGE, "tune_kernel.py").build_program


def _prepared_and_state(seed):
    """The prepare kernel's outputs (reference C, float64) for random inputs, and a random S_0^T."""
    B, N, H, d_k, d_v = SHAPE
    x = make_inputs(*SHAPE, gate="channel", gate_range=(0.5, 0.999), beta_range=(0.1, 0.9), seed=seed)
    prepared = from_library(prepare, x.q, x.k, x.v, x.g, x.beta, TILES["chunk_size"])
    initial_state = np.random.default_rng(seed).standard_normal((B, H, d_k, d_v)) / np.sqrt(d_k)
    return prepared, initial_state


def _check_values(build_program, dtype, rel_l2, seed):
    prepared, initial_state = _prepared_and_state(seed)
    program = build(build_program, *SHAPE, dtype=dtype, **TILES)
    o, final_state = run_on_cpu(program, [*(getattr(prepared, name) for name in PREPARED), initial_state], OUT_IDX)
    expected_o, expected_state = from_library(recurrence, prepared, TILES["block_dv"], initial_state)
    assert_close(o, expected_o, rel_l2=rel_l2, chunk_size=TILES["chunk_size"], name=f"o of the interpreted {dtype} program")
    assert_close(final_state, expected_state, rel_l2=rel_l2, axes=("batch", "head", "key channel", "value channel"),
                 name=f"the final state of the interpreted {dtype} program")


def test_float64_program_equals_reference_c(build_program):
    # fp32 accumulators: each entry sums O(C + d_k) products, each rounded to 2^-24, over four chunks
    _check_values(build_program, "float64", 64 * UNIT_ROUNDOFF["float64"], seed=21)


def test_writes_only_its_outputs(build_program):
    """The initial state comes back as it went in (a caller reuses it), as every input does."""
    assert_writes_only(build(build_program, *SHAPE, **TILES), outputs=OUT_IDX)


def test_fences_the_tiles_it_stores(build_program):
    assert_stores_fenced(build(build_program, *SHAPE, **TILES))


def test_fp16_program_within_rounding(build_program):
    # the five operands, the state's fp16 copy for the GEMMs, V_new and o each rounded to fp16 once
    _check_values(build_program, "float16", 4 * UNIT_ROUNDOFF["float16"], seed=22)


def library_cost(B, N, H, d_k, d_v):
    """The counts of the library's recurrence kernel at its default tiles: the target."""
    from stages.s05_fast_kda.kernel import build_recurrence_program

    return counted_cost(build_recurrence_program(B, N, H, d_k, d_v))


@pytest.mark.parametrize("count", list(COUNTS))
def test_cost_within_target(build_program, count):
    target = from_library(library_cost, *COST_SHAPE)
    assert_cost_within_target(build(build_program, *COST_SHAPE), target, count)


@pytest.mark.gpu
def test_time_within_target(build_program):
    """Timed on random operands of the prepare kernel's shapes and ranges: the time does not depend on
    the values (no branch reads them), and a handout has no prepare to call."""
    from stages.s05_fast_kda.kernel import DEFAULT_CHUNK_SIZE, build_recurrence_program

    B, N, H, d_k, d_v, C = 1, 8192, 16, 128, 128, DEFAULT_CHUNK_SIZE
    rng = np.random.default_rng(5)
    shapes = [(B, N, H, d_k), (B, N, H, d_v), (B, N, H, d_k), (B, N, H, d_k), (B, N, H, C)]
    operands = [rng.standard_normal(shape) / np.sqrt(shape[-1]) for shape in shapes]
    chunk_decay = rng.uniform(0.5, 1.0, (B, N // C, H, d_k))
    inputs = [*operands, chunk_decay, np.zeros((B, H, d_k, d_v))]
    assert_time_within_target(build(build_program, B, N, H, d_k, d_v),
                              lambda: build_recurrence_program(B, N, H, d_k, d_v),
                              inputs, ["float16"] * 5 + ["float32"] * 2, out_idx=OUT_IDX)
