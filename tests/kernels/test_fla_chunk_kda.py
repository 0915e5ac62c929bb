"""chunk_kda as FLA 0.6.0's: FLA's test grid (tests/ops/test_kda.py: its shapes, options, gates masked
down to -1000, lengths not a multiple of the chunk), shrunk to the CPU, against FLA's math written out
apart (tests/kernels/fla_recurrence.py) and differentiated by torch.autograd; FLA's argument rules and
messages; the CUDA kernels against FLA's own on the H200 (marker gpu).

On the CPU both sides compute in float64, so they agree to float64's rounding through the chunked
algebra (1e-9 here, where FLA's tests allow 5e-3 to 2e-2 for its bf16 kernels: those tolerances are
the GPU tests')."""

import contextlib
import math
import re
from dataclasses import dataclass, field, replace

import pytest
import torch
import torch.nn.functional as F

from stages.common.errors import error_report
from stages.kda.autograd import chunk_kda
from stages.kda.on_cpu import calls_on_cpu, interpreted
from tests.kernels.fla_recurrence import Options, chunk_starts, kda

EXACT = 1e-9  # float64 against float64, through the chunked algebra (stage 6's tests: 3e-12 at its worst gates)
LEAVES = ("q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias")


@dataclass(frozen=True)
class Case:
    """One call of FLA's grid, shrunk: sizes, FLA's options, how the gate is drawn."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    options: Options = field(default_factory=Options)
    gate_scale: float = 1.0  # FLA's gate_logit_normalizer: log gates logsigmoid(x) / gate_scale
    mask_p: float = 0.0  # a share of the log gates set to -1000 (FLA's masked gates)
    safe_gate: bool = False
    chunk_size: int = 64
    with_A_log: bool = True
    with_dt_bias: bool = True
    with_initial_state: bool = True
    state_v_first: bool = False
    exact_betas: bool = True  # some betas exactly 0 and 1 (the value form)
    beta_scale: float = 1.0  # 2: betas in [0, 2], as FLA's test of allow_neg_eigval hands its reference


def make_leaves(case: Case, seed: int, N: int | None = None, dtype=torch.float64) -> dict:
    """{name: leaf or None}: q, k as FLA draws them (rand, unnormalized: the norm is the option's, or the
    caller's), v, the gate (log, masked; or raw with A_log ~ log U(1, 16) and dt_bias), beta (values or
    logits), and one initial state per sequence (N of them, B without cu_seqlens)."""
    generator = torch.Generator().manual_seed(seed)

    def draw(*shape, normal=True):
        return (torch.randn if normal else torch.rand)(*shape, generator=generator, dtype=torch.float64)

    B, T, H, HV, K, V, options = case.B, case.T, case.H, case.HV, case.K, case.V, case.options
    leaves = {"q": draw(B, T, H, K, normal=False), "k": draw(B, T, H, K, normal=False), "v": draw(B, T, HV, V)}
    if options.use_gate_in_kernel:
        leaves["g"] = 3 * draw(B, T, HV, K)
        leaves["A_log"] = torch.log(1 + 15 * draw(HV, normal=False)) if case.with_A_log else None
        leaves["dt_bias"] = draw(HV * K) if case.with_dt_bias else None
    else:
        g = F.logsigmoid(draw(B, T, HV, K)) / case.gate_scale
        g = torch.where(draw(B, T, HV, K, normal=False) < case.mask_p, torch.full_like(g, -1000.0), g)
        leaves["g"] = g.clamp(-5, 0) if case.safe_gate else g
        leaves["A_log"] = leaves["dt_bias"] = None
    if options.use_beta_sigmoid_in_kernel:
        leaves["beta"] = 4 * draw(B, T, HV)  # logits: beta near 0 and near its bound too
    else:
        beta = torch.sigmoid(draw(B, T, HV))
        if case.exact_betas:
            picked = draw(B, T, HV, normal=False)
            beta = torch.where(picked < 0.1, 0.0, torch.where(picked > 0.9, 1.0, beta))
        leaves["beta"] = case.beta_scale * beta
    shape = (N or B, HV, V, K) if case.state_v_first else (N or B, HV, K, V)
    leaves["initial_state"] = draw(*shape) if case.with_initial_state else None
    for name in ("q", "k", "v"):
        leaves[name] = leaves[name].to(dtype)
    return {name: None if x is None else x.requires_grad_() for name, x in leaves.items()}


def ours(case: Case, leaves: dict, **packed) -> tuple:
    """chunk_kda on the leaves, as FLA's caller would make the call."""
    return chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                     initial_state=leaves["initial_state"], output_final_state=True, A_log=leaves["A_log"],
                     dt_bias=leaves["dt_bias"], safe_gate=case.safe_gate, chunk_size=case.chunk_size,
                     state_v_first=case.state_v_first, **case.options.fla_kwargs(), **packed)


def expected(case: Case, leaves: dict, cu_seqlens=None) -> tuple:
    """FLA's math on the same leaves, the states in the caller's layout: (o, final states, states after
    every token per sequence, in the kernel layout)."""
    initial_state = leaves["initial_state"]
    if initial_state is not None and case.state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    o, final_state, every = kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state,
                                leaves["A_log"], leaves["dt_bias"], cu_seqlens, case.options)
    return o, final_state.transpose(-1, -2) if case.state_v_first else final_state, every


def gradients(o, final_state, leaves: dict, seed: int) -> dict:
    """{leaf: d loss / d leaf} for loss = <o, do> + <final_state, dht>, FLA's loss, do and dht random."""
    generator = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=generator, dtype=torch.float64)
    dht = torch.randn(final_state.shape, generator=generator, dtype=torch.float64)
    loss = (o.double() * do).sum() + (final_state.double() * dht).sum()
    used = {name: x for name, x in leaves.items() if x is not None}
    return dict(zip(used, torch.autograd.grad(loss, list(used.values()))))


def assert_agree(ours_out, expected_out, our_grads, expected_grads, bound=EXACT):
    for name, mine, theirs in (("o", ours_out[0], expected_out[0]), ("final_state", ours_out[1], expected_out[1])):
        assert error_report(mine, theirs).rel_l2 <= bound, f"{name}: {error_report(mine, theirs)}"
    assert our_grads.keys() == expected_grads.keys()
    for name in our_grads:
        report = error_report(our_grads[name], expected_grads[name])
        assert report.rel_l2 <= bound, f"d{name}: {report}"


LOG, L2 = Options(scale=1.0), Options(scale=0.1, use_qk_l2norm_in_kernel=True)
SOFTPLUS = Options(scale=0.1, use_gate_in_kernel=True)
BOUNDED = Options(scale=0.1, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=-5.0)
SIGMOID_BETA = Options(use_beta_sigmoid_in_kernel=True)
TWICE_SIGMOID_BETA = Options(use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True)
GRID = {  # FLA's test_chunk, test_chunk_state_v_first and test_chunk_use_beta_sigmoid_in_kernel, shrunk
    "T63-safe_gate": Case(1, 37, 1, 1, 16, 16, replace(LOG, lower_bound=-5.0), safe_gate=True),
    "D60-strong_gates": Case(2, 41, 2, 2, 12, 12, LOG, gate_scale=0.1),
    "masked_gates-1000": Case(2, 50, 2, 2, 8, 8, replace(LOG, scale=0.1), mask_p=0.5),
    "D100-default_scale-no_initial_state": Case(1, 33, 2, 2, 10, 10, Options(), with_initial_state=False),
    "l2norm": Case(1, 40, 2, 2, 8, 8, L2),
    "gate_in_kernel": Case(1, 33, 2, 2, 8, 8, SOFTPLUS),
    "gate_in_kernel-safe_gate": Case(1, 35, 2, 2, 8, 8, BOUNDED, safe_gate=True),
    "gate_in_kernel-no_dt_bias": Case(1, 20, 1, 1, 8, 8, SOFTPLUS, with_dt_bias=False),
    "bounded_gate-no_A_log": Case(1, 34, 1, 2, 8, 8, BOUNDED, with_A_log=False, chunk_size=32),
    "gva-HV2H": Case(1, 40, 1, 2, 8, 8, LOG),
    "gva-HV4H-gate-V6": Case(1, 36, 1, 4, 8, 6, SOFTPLUS),
    "gva-l2norm-gate-chunk32": Case(2, 40, 2, 4, 8, 8, replace(SOFTPLUS, use_qk_l2norm_in_kernel=True),
                                    chunk_size=32),
    "beta_sigmoid": Case(1, 40, 2, 2, 8, 8, SIGMOID_BETA),
    "allow_neg_eigval": Case(1, 40, 2, 2, 8, 8, TWICE_SIGMOID_BETA),
    "beta_up_to_2_as_values": Case(1, 40, 2, 2, 8, 8, LOG, beta_scale=2.0),
    "state_v_first": Case(2, 37, 2, 2, 8, 6, replace(LOG, scale=0.1), state_v_first=True),
    "everything": Case(1, 45, 2, 4, 12, 10, Options(scale=0.3, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                                    use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True),
                       state_v_first=True, chunk_size=32),
}


@pytest.mark.parametrize("name", GRID)
def test_chunk_kda_on_fla_s_grid_equals_fla_s_math(name):
    """o, the final states and the gradients of every input (the raw gate's, A_log's, dt_bias's, beta's
    logits', the initial states') against torch.autograd of FLA's math in float64."""
    case = GRID[name]
    seed = sum(map(ord, name))
    leaves = make_leaves(case, seed)
    mine = ours(case, leaves)
    theirs = expected(case, leaves)
    assert_agree(mine, theirs, gradients(*mine, leaves, seed), gradients(*theirs[:2], leaves, seed))


@pytest.mark.parametrize("cu_seqlens, index_dtype, with_cpu_copy, case", [
    # FLA's test_chunk_varlen: lengths not a multiple of the chunk, an empty and a one-token sequence here
    ([0, 7, 7, 30, 31, 52], torch.int64, True, Case(1, 52, 2, 2, 12, 12, LOG, mask_p=0.1)),
    ([0, 15, 40], torch.int32, False, Case(1, 40, 2, 2, 10, 10, SOFTPLUS)),
    ([0, 18, 20, 50], torch.int64, False, Case(1, 50, 1, 2, 8, 6, replace(BOUNDED, use_beta_sigmoid_in_kernel=True),
                                                 chunk_size=32, state_v_first=True)),
    ([0, 9, 33], torch.int32, True, Case(1, 33, 1, 1, 8, 8, replace(L2, lower_bound=-5.0), mask_p=0.9,
                                         safe_gate=True)),
])
def test_packed_sequences_train(cu_seqlens, index_dtype, with_cpu_copy, case):
    """FLA's packed training (cu_seqlens, with cu_seqlens_cpu or without): every sequence from its own
    initial state, o, each sequence's final state and every gradient against FLA's math sequence by
    sequence; gates masked to -1000 where the case says."""
    seed = len(cu_seqlens) * 7 + case.K
    N = len(cu_seqlens) - 1
    leaves = make_leaves(case, seed, N=N)
    packed = {"cu_seqlens": torch.tensor(cu_seqlens, dtype=index_dtype)}
    if with_cpu_copy:
        packed["cu_seqlens_cpu"] = torch.tensor(cu_seqlens, dtype=index_dtype)
    mine = ours(case, leaves, **packed)
    theirs = expected(case, leaves, cu_seqlens)
    assert_agree(mine, theirs, gradients(*mine, leaves, seed), gradients(*theirs[:2], leaves, seed))


@pytest.mark.parametrize("cu_seqlens, state_v_first", [(None, False), ([0, 40, 41, 100], True)])
def test_intermediate_states_are_each_chunk_s_start_in_fla_s_layout(cu_seqlens, state_v_first):
    """return_intermediate_states under inference_mode: (o, final state, h), h (B, NT, HV, K, V) in q's dtype
    (with cu_seqlens B = 1 and NT every sequence's chunks one after the other; V first with state_v_first),
    S^T at every chunk's start as FLA's math gives it; o and the final state as without it."""
    chunk_size = 32
    B = 2 if cu_seqlens is None else 1
    case = Case(B, 100, 1, 2, 8, 6, L2, chunk_size=chunk_size, state_v_first=state_v_first)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    leaves = {name: None if x is None else x.detach() for name, x in make_leaves(case, 5, N=N).items()}
    packed = {} if cu_seqlens is None else {"cu_seqlens": torch.tensor(cu_seqlens)}
    with torch.inference_mode():
        o, final_state, h = ours(case, leaves, return_intermediate_states=True, **packed)
        plain_o, plain_final_state = ours(case, leaves, **packed)
    assert torch.equal(o, plain_o) and torch.equal(final_state, plain_final_state)
    assert h.dtype == leaves["q"].dtype
    expected_o, _, every = expected(case, leaves, cu_seqlens)
    initial_state = leaves["initial_state"].transpose(-1, -2) if state_v_first else leaves["initial_state"]
    starts = chunk_starts(every, initial_state, chunk_size)  # (NT, HV, K, V), sequences one after the other
    if cu_seqlens is None:
        assert h.shape == (B, 4, 2, *((6, 8) if state_v_first else (8, 6)))
        starts = starts.reshape(B, 4, 2, 8, 6)
    else:
        assert h.shape == (1, 2 + 1 + 2, 2, 6, 8)  # ceil(40 / 32) + ceil(1 / 32) + ceil(59 / 32) chunks
        starts = starts[None]
    assert error_report(h.transpose(-1, -2) if state_v_first else h, starts).rel_l2 <= EXACT
    assert error_report(o, expected_o).rel_l2 <= EXACT


def test_intermediate_states_are_refused_outside_inference_mode_and_with_disable_recompute():
    case = Case(1, 10, 1, 1, 4, 4)
    leaves = {name: None if x is None else x.detach() for name, x in make_leaves(case, 1).items()}
    with pytest.raises(ValueError, match="return_intermediate_states is only allowed in inference mode"):
        ours(case, leaves, return_intermediate_states=True)
    with torch.inference_mode(), pytest.raises(ValueError, match="must be used with disable_recompute=False"):
        ours(case, leaves, return_intermediate_states=True, disable_recompute=True)


def test_inputs_are_unchanged_and_a_second_call_is_equal():
    """Every input (the gate's parameters and the initial states too) as it was after the call and its
    backward, packed and with the gate in the kernel; a second call gives bitwise the same o, final
    states and gradients."""
    case = Case(1, 30, 1, 2, 8, 8, replace(SOFTPLUS, use_beta_sigmoid_in_kernel=True), state_v_first=True)
    cu_seqlens = torch.tensor([0, 12, 30])
    leaves = make_leaves(case, 9, N=2)
    before = {name: x.detach().clone() for name, x in leaves.items() if x is not None}
    runs = []
    for _ in range(2):
        o, final_state = ours(case, leaves, cu_seqlens=cu_seqlens)
        runs.append((o, final_state, gradients(o, final_state, leaves, 9)))
    for name, x in before.items():
        assert torch.equal(leaves[name].detach(), x), f"{name} was modified"
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    for name in runs[0][2]:
        assert torch.equal(runs[0][2][name], runs[1][2][name]), f"d{name} differs between two calls"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_dtypes_as_fla_returns_them(dtype):
    """q, k, v in fp16, bf16 or fp32: o in their dtype, the final state float32, the chunk states in q's
    dtype, every gradient in its input's dtype; the CPU computes in float64, so o is FLA's math rounded
    once."""
    case = Case(1, 20, 1, 2, 8, 8, replace(BOUNDED, use_beta_sigmoid_in_kernel=True))
    leaves = make_leaves(case, 3, dtype=dtype)
    leaves["initial_state"] = leaves["initial_state"].detach().float().requires_grad_()  # FLA's states: float32
    o, final_state = ours(case, leaves)
    assert o.dtype == dtype and final_state.dtype == torch.float32
    grads = gradients(o, final_state, leaves, 3)
    assert all(grads[name].dtype == leaves[name].dtype for name in grads)
    expected_o = expected(case, leaves)[0]
    unit = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}[dtype]
    rounding = unit * (expected_o.abs() + torch.finfo(dtype).tiny)  # half a unit in the last place, subnormals too
    assert ((o.double() - expected_o).abs() <= rounding + 1e-12 * expected_o.abs().max()).all()
    with torch.inference_mode():
        *_, h = ours(case, {name: None if x is None else x.detach() for name, x in leaves.items()},
                     return_intermediate_states=True)
    assert h.dtype == dtype


def _call(B=1, T=8, H=1, HV=1, K=4, V=4, **options):
    q, k = torch.rand(B, T, H, K), torch.rand(B, T, H, K)
    v, g, beta = torch.rand(B, T, HV, V), -torch.rand(B, T, HV, K), torch.rand(B, T, HV)
    return chunk_kda(q, k, v, g, beta, **options)


@pytest.mark.parametrize("options, error, message", [
    ({"chunk_size": 16}, ValueError, "`chunk_size` must be either 32 or 64 for KDA, got 16."),
    ({"use_gate_in_kernel": True}, ValueError,
     "`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set."),
    ({"use_gate_in_kernel": True, "safe_gate": True, "A_log": torch.zeros(1)}, ValueError,
     "`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`."),
    ({"use_gate_in_kernel": True, "safe_gate": True, "lower_bound": -6.0}, ValueError,
     "`lower_bound` must be in the safe range [-5, 0), got -6.0."),
    ({"allow_neg_eigval": True}, ValueError, "`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`."),
    ({"B": 2, "cu_seqlens": torch.tensor([0, 8])}, ValueError,
     "The batch size is expected to be 1 rather than 2 when using `cu_seqlens`."),
    ({"cu_seqlens": torch.tensor([0, 3, 8]), "initial_state": torch.zeros(1, 1, 4, 4)}, ValueError,
     "The number of initial states is expected to be equal to the number of input sequences, i.e., 2 rather than 1."),
    ({"state_v_first": True, "transpose_state_layout": True}, ValueError,
     "Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`."),
    ({"H": 2, "HV": 3}, ValueError, "For GVA, num_v_heads (HV=3) must be evenly divisible by num_qk_heads (H=2)"),
    ({"K": 257}, ValueError, "Currently we only support key headdim <=256 for KDA, got 257."),
    ({"use_graph": True, "cu_seqlens": torch.tensor([0, 3, 8]), "max_num_seqs": 4}, ValueError,
     "cu_seqlens must be padded with zero-length tail sequences to exactly max_num_seqs + 1 entries"),
    ({"cp_context": object()}, TypeError, "cp_context must be stage 8's CPContext"),
    ({"use_gate_in_kernel": True, "A_log": torch.zeros(2)}, ValueError, "A_log must have HV = 1 entries"),
])
def test_fla_s_rules_with_fla_s_messages(options, error, message):
    """Each call FLA's chunk_kda refuses is refused with FLA's words, before any value is read (the
    gates here are fine, but the rule is checked first); chunk_size first of all, as FLA checks it."""
    with pytest.raises(error, match=re.escape(message)):
        _call(**options)


@pytest.mark.parametrize("on_cuda", [False, True], ids=["cpu", "cuda"])
def test_chunk_size_is_checked_before_the_values(on_cuda):
    """FLA's test_chunk_invalid_chunk_size: g and beta drawn from randn (not a gate, not a beta), float32
    tensors (which the CUDA kernels refuse), and the refusal is the chunk size's, on either device."""
    q = torch.randn(1, 64, 1, 64)
    with contextlib.ExitStack() as stack:
        if on_cuda:  # the tensors say they are on CUDA: the kernels' dtype rule applies to them
            stack.enter_context(calls_on_cpu(interpreted))
        with pytest.raises(ValueError, match=r"`chunk_size` must be either 32 or 64"):
            chunk_kda(q, q, q, torch.randn(1, 64, 1, 64), torch.randn(1, 64, 1), chunk_size=16)


def test_the_deprecated_state_layout_name_warns_and_works():
    case = Case(1, 10, 1, 1, 4, 4, state_v_first=True)
    leaves = {name: None if x is None else x.detach() for name, x in make_leaves(case, 2).items()}
    expected_o, expected_state = ours(case, leaves)
    with pytest.warns(DeprecationWarning, match="`transpose_state_layout` is deprecated"):
        o, final_state = chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                   initial_state=leaves["initial_state"], output_final_state=True,
                                   transpose_state_layout=True)
    assert torch.equal(o, expected_o) and torch.equal(final_state, expected_state)


def test_use_graph_is_refused_for_packed_training_and_taken_otherwise():
    case = Case(1, 10, 1, 1, 4, 4)
    leaves = make_leaves(case, 4, N=2)
    cu_seqlens = torch.tensor([0, 4, 10])
    with pytest.raises(NotImplementedError, match="use_graph with autograd on packed sequences"):
        ours(case, leaves, cu_seqlens=cu_seqlens, use_graph=True)
    with torch.no_grad():
        graphed = ours(case, leaves, cu_seqlens=cu_seqlens, use_graph=True, max_num_seqs=2)
        plain = ours(case, leaves, cu_seqlens=cu_seqlens)
    assert torch.equal(graphed[0], plain[0]) and torch.equal(graphed[1], plain[1])


def test_gate_parameters_are_dropped_without_the_gate_in_kernel():
    """FLA ignores A_log and dt_bias unless use_gate_in_kernel: g is the log gate; no gradient reaches them."""
    case = Case(1, 12, 1, 1, 4, 4)
    leaves = make_leaves(case, 6)
    A_log, dt_bias = torch.zeros(1, requires_grad=True), torch.zeros(4, requires_grad=True)
    o, _ = chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], A_log=A_log, dt_bias=dt_bias)
    expected_o, _ = chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"])
    assert torch.equal(o, expected_o)
    assert torch.autograd.grad(o.sum(), [A_log, dt_bias], allow_unused=True) == (None, None)


def test_scale_defaults_to_fla_s_one_over_sqrt_k():
    case = Case(1, 12, 1, 1, 9, 4, Options())
    leaves = make_leaves(case, 8)
    o, _ = ours(case, leaves)
    expected_o = expected(case, leaves)[0]
    scaled = expected(replace(case, options=Options(scale=1 / math.sqrt(9))), leaves)[0]
    assert error_report(o, expected_o).rel_l2 <= EXACT and torch.equal(expected_o, scaled)
