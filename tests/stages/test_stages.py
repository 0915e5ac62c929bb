"""The library tests every stage with references A, B, C and a one-program kernel shares (stages 1 to 4),
written once and run for each: B and C against A, the argument checks, the identities, the kernel's
compile report and its wrapper's checks. What only one stage has stays in tests/test_sNN_<name>.py.

The stages come from the catalog (kdacourse.catalog.stages()): those whose reference.py defines
recurrent, chunkwise and kernel_mirror and whose kernel.py defines build_program. What tells them
apart here is the gate their references and kernel take (GATES)."""

import ast
import importlib
import re

import numpy as np
import pytest

from kdacourse import REPO_ROOT
from kdacourse.catalog import stages
from stages.common.errors import error_report
from stages.common.inputs import GATE_SHAPES, GATES_WITH_BETA, make_inputs

REFERENCES = ("recurrent", "chunkwise", "kernel_mirror")  # A, B, C


def _defines(stage, module, names):
    """Whether stages/<stage>/<module>.py defines every function of `names` (read, not imported)."""
    path = REPO_ROOT / "stages" / stage / f"{module}.py"
    if not path.is_file():
        return False
    defined = {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
    return set(names) <= defined


STAGES = [stage for stage in stages() if _defines(stage, "reference", REFERENCES)
          and _defines(stage, "kernel", ["build_program"])]
# the key of stages.common.inputs.GATE_SHAPES each stage's g has: its references and kernel check g's shape by it
GATES = {"s01_linear_attention": "none", "s02_scalar_decay": "head", "s03_gated_deltanet": "token",
         "s04_kda": "channel"}
STRONG_DECAY = (0.5, 0.99)  # a^C far from 1 at the chunk sizes below, so every decay counts
SHAPES = [
    # B, N, H, d_k, d_v, chunk_size, block_dv
    (2, 12, 2, 4, 4, 4, 2),  # stage 4's seed's consistency shape
    (1, 8, 1, 4, 4, 8, 4),  # one chunk
    (2, 64, 3, 8, 6, 8, 2),  # many chunks, three blocks of value columns
    (2, 45, 2, 16, 8, 16, 4),  # N not a multiple of chunk_size: B ragged, C padded
    (1, 7, 2, 4, 4, 16, 1),  # a chunk longer than the sequence
]


def test_every_such_stage_has_a_gate():
    assert STAGES and set(GATES) == set(STAGES), "give each stage of STAGES its gate in GATES, and only those"


def _reference(stage):
    return importlib.import_module(f"stages.{stage}.reference")


def _inputs(stage, B, N, H, d_k, d_v, seed):
    """The stage's inputs, with strong gates where it has a gate and beta in [0.1, 0.9] where it has beta."""
    return make_inputs(B, N, H, d_k, d_v, gate=GATES[stage], gate_range=STRONG_DECAY, seed=seed)


def _arguments(x):
    """q, k, v and, where the stage takes them, g and beta: the references' and the kernel's arguments."""
    return [a for a in (x.q, x.k, x.v, x.g, x.beta) if a is not None]


# ----------------------------------------------------------------------------- the references


@pytest.mark.parametrize("B, N, H, d_k, d_v, chunk_size, block_dv", SHAPES)
@pytest.mark.parametrize("stage", STAGES)
def test_chunkwise_and_kernel_mirror_equal_recurrent(stage, B, N, H, d_k, d_v, chunk_size, block_dv):
    reference, x = _reference(stage), _inputs(stage, B, N, H, d_k, d_v, seed=N)
    expected = reference.recurrent(*_arguments(x))
    assert error_report(reference.chunkwise(*_arguments(x), chunk_size).o, expected).rel_l2 <= 1e-12
    assert error_report(reference.kernel_mirror(*_arguments(x), chunk_size, block_dv), expected).rel_l2 <= 1e-12


@pytest.mark.parametrize("stage", STAGES)
def test_kernel_mirror_independent_of_block_dv(stage):
    reference, x = _reference(stage), _inputs(stage, 2, 40, 2, 8, 8, seed=1)
    results = [reference.kernel_mirror(*_arguments(x), 8, block_dv) for block_dv in (1, 2, 4, 8)]
    for result in results[1:]:
        assert error_report(result, results[0]).rel_l2 <= 1e-14


@pytest.mark.parametrize("function", REFERENCES)
@pytest.mark.parametrize("stage", STAGES)
def test_references_reject_mismatched_shapes(stage, function):
    x = _inputs(stage, 1, 8, 2, 4, 4, seed=2)
    call = getattr(_reference(stage), function)
    extra = {"chunkwise": (4,), "kernel_mirror": (4, 2)}.get(function, ())

    def rejects(message, **wrong):
        """The call with the arguments named in `wrong` replaced raises a ValueError matching `message`."""
        arguments = {**dict(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta), **wrong}
        with pytest.raises(ValueError, match=message):
            call(*[a for a in arguments.values() if a is not None], *extra)

    rejects("k must have q's shape", k=x.k[:, :, :1])
    rejects("v must be", v=x.v[:, :4])
    rejects("rank 4", q=x.q[0])
    if x.g is not None:
        gate = GATES[stage]
        rejects(rf"g must have shape {re.escape(str(x.g.shape))} \(the {gate} gate\)", g=x.g[..., None])
    if x.beta is not None:
        rejects(r"beta must have shape \(B, N, H\)", beta=x.beta[:, :4])


@pytest.mark.parametrize("stage", STAGES)
def test_kernel_mirror_rejects_bad_block_dv(stage):
    x = _inputs(stage, 1, 8, 1, 4, 6, seed=3)
    with pytest.raises(ValueError, match="block_dv must be a positive divisor of d_v = 6, got 4"):
        _reference(stage).kernel_mirror(*_arguments(x), 4, 4)


# ----------------------------------------------------------------------------- identities


IDENTITIES = [(stage, build) for stage in STAGES
              for build in importlib.import_module(f"stages.{stage}.identities").IDENTITIES]


@pytest.mark.parametrize("stage, build", IDENTITIES, ids=[f"{stage}-{build.__name__}" for stage, build in IDENTITIES])
def test_identity_holds(stage, build):
    assert build().holds()


# ----------------------------------------------------------------------------- the kernel

COMPILE_SHAPE = dict(B=2, N=1024, H=4, d_k=128, d_v=128)


@pytest.mark.compile
@pytest.mark.parametrize("stage", STAGES)
def test_kernel_compiles_for_sm90a_without_spills(stage):
    kernel = importlib.import_module(f"stages.{stage}.kernel")
    # the default tiles named, as stage 2's page calls its (cached) report, so that one nvcc run serves both
    report = kernel.compile_report(**COMPILE_SHAPE, chunk_size=kernel.DEFAULT_CHUNK_SIZE,
                                   block_dv=kernel.DEFAULT_BLOCK_DV, threads=128)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.summary()
    assert not report.divergent_barriers, report.divergent_barriers  # a barrier some warps skip hangs the GPU
    assert not report.misplaced_warp_group_operands, report.misplaced_warp_group_operands  # wrong columns read
    assert 0 < report.registers <= 255
    assert report.shared_memory <= 227 * 1024
    # a stage that turns warp specialization off (its PASS_CONFIGS) runs the 128 threads it asks for;
    # the others get TileLang's producer warp group on top
    specialized = not getattr(kernel, "PASS_CONFIGS", {}).get("tl.disable_warp_specialized")
    assert report.threads == (256 if specialized else 128), report.summary()
    assert kernel.build_program(**COMPILE_SHAPE).attrs["global_symbol"] in report.cuda_source


@pytest.mark.parametrize("stage", STAGES)
def test_kernel_wrapper_rejects_bad_input(stage):
    """What every stage's wrapper checks of q, k and v, with good g and beta where the stage takes them;
    each stage's own checks of g, beta and its options are in its test file."""
    torch = pytest.importorskip("torch")
    forward = importlib.import_module(f"stages.{stage}.kernel").forward

    q = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    gate = GATES[stage]
    rest = ()
    if gate != "none":
        rest = (torch.full(GATE_SHAPES[gate](1, 64, 2, 64), -0.01),)
    if gate in GATES_WITH_BETA:
        rest += (torch.full((1, 64, 2), 0.5),)
    cases = [
        ((q, q, q), ValueError, "q must be on a CUDA device"),
        ((q.float(), q, q), TypeError, "q must have dtype float16 or bfloat16, got float32"),
        ((q[0], q, q), ValueError, "q must have rank 4"),
        ((q, np.zeros(3), q), TypeError, "k must be a torch.Tensor"),
        ((q, q[:, :32], q), ValueError, r"k must have the shape of q, \(1, 64, 2, 64\)"),
        ((q, q, q[:, :32]), ValueError, r"v must be \(B, N, H, d_v\) = \(1, 64, 2, d_v\)"),
        ((q, q, q.bfloat16()), ValueError, "v must have the dtype of q"),
        ((q.transpose(1, 2).contiguous().transpose(1, 2), q, q), ValueError, "q must be contiguous"),
    ]
    for qkv, error, message in cases:
        with pytest.raises(error, match=message):
            forward(*qkv, *rest)


# The most lines a diff of one stage's kernel.py against the stage before it may change (removed plus added,
# as difflib counts them): the first two at what the files reach now plus 5, the third at issue 26's target. What
# a stage chooses beside its idea (a layout option, pass configs) lives in a module of its own, and what two
# kernels share (docstrings, comments, names, the wrapper) reads the same in both.
KERNEL_DIFF_BOUNDS = {("s01_linear_attention", "s02_scalar_decay"): 98,
                      ("s02_scalar_decay", "s03_gated_deltanet"): 161,
                      ("s03_gated_deltanet", "s04_kda"): 125}


def changed_lines(before, after):
    """Lines removed plus lines added by a diff of two texts (difflib, no junk heuristic)."""
    import difflib

    matcher = difflib.SequenceMatcher(None, before.splitlines(), after.splitlines(), autojunk=False)
    return sum(i2 - i1 + j2 - j1 for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal")


@pytest.mark.parametrize("before, after", list(zip(STAGES, STAGES[1:])))
def test_kernel_diff_from_the_stage_before_shows_one_idea(before, after):
    changed = changed_lines(*((REPO_ROOT / "stages" / stage / "kernel.py").read_text() for stage in (before, after)))
    bound = KERNEL_DIFF_BOUNDS[(before, after)]
    print(f"{before} -> {after}: {changed} lines changed (bound {bound})")
    assert changed <= bound, (
        f"diff stages/{before}/kernel.py stages/{after}/kernel.py changes {changed} lines, over {bound}: move what "
        f"is not {after}'s idea out of its kernel.py, or word what the two share alike")
