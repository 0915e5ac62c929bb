"""Tests of exercise s04.kernel_program: the TileLang program of the KDA kernel.

Without a GPU: the program's TIR respects the ordering constraints that a right answer needs, and
the program lowers and compiles for sm_90a without spills. On a GPU: its output matches the
delta-rule form of KDA (stages/common/oracles.py) in float64.
"""

import pytest

from kdacourse.catalog import load_catalog
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.common.oracles import kda_delta_rule

STAGE = "s04_kda"
SHAPE = (1, 256, 2, 64, 64)  # B, N, H, d_k, d_v
TILES = dict(chunk_size=64, block_dv=32)  # four chunks, two blocks of value columns


@pytest.fixture
def build_program(target_module):
    return target_module(STAGE, "kernel_program.py").build_program


def _program(build_program):
    return build_program(*SHAPE, **TILES)


@pytest.mark.parametrize("constraint", [1, 2, 7])
def test_respects_ordering_constraint(build_program, constraint):
    from stages.s04_kda.kernel import ordering_constraints

    facts = {number: (statement, holds) for number, statement, holds in ordering_constraints(_program(build_program))}
    statement, holds = facts[constraint]
    assert holds, f"constraint {constraint} does not hold: {statement}"


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
    assert report.spill_stores == 0 and report.spill_loads == 0, report.summary()
    assert report.shared_memory <= 227 * 1024, report.summary()


@pytest.mark.gpu
def test_matches_delta_rule_form_on_gpu(build_program):
    import tilelang
    import torch

    from stages.s04_kda.kernel import PASS_CONFIGS

    kernel = tilelang.compile(_program(build_program), out_idx=[5], target="cuda", pass_configs=PASS_CONFIGS)
    x = make_inputs(*SHAPE, gate="channel", gate_range=(0.9, 0.999), beta_range=(0.1, 0.9), seed=8)
    q, k, v = (torch.tensor(a, dtype=torch.float16, device="cuda") for a in (x.q, x.k, x.v))
    g, beta = (torch.tensor(a, dtype=torch.float32, device="cuda") for a in (x.g, x.beta))
    error = error_report(kernel(q, k, v, g, beta), kda_delta_rule(x.q, x.k, x.v, x.g, x.beta))
    print(f"s04 exercise kernel fp16: {error}")
    assert error.rel_l2 <= 5e-3
