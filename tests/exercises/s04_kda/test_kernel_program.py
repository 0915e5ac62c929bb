"""Tests of exercise s04.kernel_program: the TileLang program of the KDA kernel.

On any machine the program runs through the tile interpreter: in float64 it must equal reference C
(only its fp32 accumulators round), in fp16 it must match the exact result within fp16's rounding;
its TIR respects the ordering constraints that a right answer needs. With nvcc it compiles for
sm_90a without spills. On a GPU its output matches the delta-rule form of KDA
(stages/common/oracles.py) in float64.
"""

import pytest

from kdacourse.catalog import load_catalog
from stages.common.compare import assert_close, assert_rule
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.common.oracles import kda_delta_rule
from stages.s04_kda.reference import kernel_mirror, recurrent
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, assert_close_in_precision, build, run_on_cpu, tir_facts
from tests.exercises.library_values import from_library

STAGE = "s04_kda"
SHAPE = (1, 256, 2, 64, 64)  # B, N, H, d_k, d_v
TILES = dict(chunk_size=64, block_dv=32)  # four chunks, two blocks of value columns


@pytest.fixture
def build_program(target_module):
    return target_module(STAGE, "kernel_program.py").build_program


def _program(build_program):
    return build(build_program, *SHAPE, **TILES)


SMALL_SHAPE = (2, 64, 2, 32, 32)  # B, N, H, d_k, d_v: four chunks of 16, two blocks of value columns
SMALL_TILES = dict(chunk_size=16, block_dv=16)


def _small_inputs(gate_range, seed):
    """Channel gates in `gate_range`, betas over [0, 1] with exact zeros and ones among them."""
    x = make_inputs(*SMALL_SHAPE, gate="channel", gate_range=gate_range, beta_range=(0.0, 1.0), seed=seed)
    x.beta[:, ::7] = 0.0  # a token that writes nothing and erases nothing
    x.beta[:, 3::7] = 1.0  # a token whose key's old value is erased entirely
    return x


def test_float64_program_equals_reference_c(build_program):
    x = _small_inputs(gate_range=(0.5, 0.999), seed=11)
    program = build(build_program, *SMALL_SHAPE, dtype="float64", **SMALL_TILES)
    actual = run_on_cpu(program, [x.q, x.k, x.v, x.g, x.beta], out_idx=[5])
    expected = from_library(kernel_mirror, x.q, x.k, x.v, x.g, x.beta, SMALL_TILES["chunk_size"], SMALL_TILES["block_dv"])
    # fp32 accumulators and fp32 exponentials: each output sums O(C + d_k) terms rounded to 2^-24
    assert_close(actual, expected, rel_l2=64 * UNIT_ROUNDOFF["float64"], chunk_size=SMALL_TILES["chunk_size"],
                 name="the interpreted float64 program")


def test_fp16_program_within_rounding(build_program):
    x = _small_inputs(gate_range=(0.9, 0.999), seed=12)
    program = build(build_program, *SMALL_SHAPE, dtype="float16", **SMALL_TILES)
    actual = run_on_cpu(program, [x.q, x.k, x.v, x.g, x.beta], out_idx=[5])
    # q, k, v and each GEMM operand are rounded to fp16 once: a few units of 2^-11
    assert_close_in_precision(actual, from_library(recurrent, x.q, x.k, x.v, x.g, x.beta),
                              rel_l2=4 * UNIT_ROUNDOFF["float16"], chunk_size=SMALL_TILES["chunk_size"],
                              name="the interpreted fp16 program")


@pytest.mark.parametrize("constraint", [1, 2, 7])
def test_respects_ordering_constraint(build_program, constraint):
    from stages.common.ordering import ordering_constraints

    facts = {number: (statement, holds) for number, statement, holds in tir_facts(ordering_constraints, _program(build_program))}
    statement, holds = facts[constraint]
    assert_rule(holds, f"ordering constraint {constraint}: {statement}")


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills(build_program, request):
    target = request.config.getoption("--target")
    bugs = load_catalog()[1]
    if target.startswith("bug:") and bugs[target.removeprefix("bug:")].file != "kernel_program.py":
        pytest.skip("this target changes another file: kernel_program.py is the solution's")
    from tilelang.transform import PassContext

    from stages.common.tilelang_tools import compile_report
    from stages.s04_kda.kernel import PASS_CONFIGS

    with PassContext(config=PASS_CONFIGS):
        report = compile_report(_program(build_program))
    assert_rule(report.spill_stores == 0 and report.spill_loads == 0, "no register spills", report.summary())
    assert_rule(report.shared_memory <= 227 * 1024, "at most 227 KiB of shared memory per block", report.summary())


@pytest.mark.gpu
def test_matches_delta_rule_form_on_gpu(build_program):
    import tilelang
    import torch

    from stages.s04_kda.kernel import PASS_CONFIGS

    kernel = tilelang.compile(_program(build_program), out_idx=[5], target="cuda", pass_configs=PASS_CONFIGS)
    x = make_inputs(*SHAPE, gate="channel", gate_range=(0.9, 0.999), beta_range=(0.1, 0.9), seed=8)
    q, k, v = (torch.tensor(a, dtype=torch.float16, device="cuda") for a in (x.q, x.k, x.v))
    g, beta = (torch.tensor(a, dtype=torch.float32, device="cuda") for a in (x.g, x.beta))
    o, expected = kernel(q, k, v, g, beta), kda_delta_rule(x.q, x.k, x.v, x.g, x.beta)
    print(f"s04 exercise kernel fp16: {error_report(o, expected)}")
    assert_close(o, expected, rel_l2=5e-3, chunk_size=TILES["chunk_size"])
