"""The drop-in's CUDA route on the CPU: FLA's chunk_kda and fused_recurrent_kda calls as the GPU runs
them (the operands padded and cast, the form computed in the kernels, autograd through the backward
kernels, packed training through a dense batch, the decode over a pool), with every TileLang program
run by the tile interpreter instead of compiled (stages.kda.on_cpu), against FLA's math in float64.

What it checks is everything between the caller and the kernels: a GPU run that fails says only that
something failed once its session ends, where this says which tensor and by how much, on any machine.
It does not check what only the GPU does (the compiled code's timing, races, its TF32 merges' exact
bits). The packed prefill (inference on cu_seqlens) is left to the GPU tests: its programs take their
sizes at run time, which the interpreter does not run.

Bounds: FLA's tolerances, as the GPU tests take them (tests/kernels/test_drop_in_gpu.py: A_log's,
on which FLA asserts nothing, held to dg's).
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from stages.common.errors import error_report
from stages.kda.autograd import chunk_kda
from stages.kda.fused_recurrent import fused_recurrent_kda_fwd
from stages.kda.on_cpu import calls_on_cpu, interpreted
from tests.kernels.fla_recurrence import Options, kda
from tests.kernels.test_drop_in_gpu import FLA_TOLERANCES, KIMI
from tests.kernels.test_fla_chunk_kda import BOUNDED, L2, SOFTPLUS, Case, make_leaves


@pytest.fixture
def on_the_interpreter():
    """The fast path's calls on the CPU, every program run by the tile interpreter (stages.kda.on_cpu)."""
    with calls_on_cpu(interpreted):
        yield


def leaves_for(case, seed, dtype, N=None):
    """The leaves of `case` as FLA's tests hand them to its kernels (q and k L2-normalized where the
    kernel does not normalize them), q, k, v in dtype, the rest float32."""
    leaves = make_leaves(case, seed, N=N)
    if not case.options.use_qk_l2norm_in_kernel:
        leaves.update({name: F.normalize(leaves[name].detach(), dim=-1) for name in ("q", "k")})
    return {name: None if x is None else x.detach().to(dtype if name in ("q", "k", "v") else torch.float32)
            .requires_grad_() for name, x in leaves.items()}


def outputs_and_gradients(call, case, leaves, seed, **packed):
    """o, the final states and every leaf's gradient of <o, do> + <ht, dht>, do and dht drawn from seed."""
    o, final_state = call(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                          initial_state=leaves["initial_state"], output_final_state=True, A_log=leaves["A_log"],
                          dt_bias=leaves["dt_bias"], safe_gate=case.safe_gate, chunk_size=case.chunk_size,
                          state_v_first=case.state_v_first, **case.options.fla_kwargs(), **packed)
    generator = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=generator, dtype=torch.float64)
    dht = torch.randn(final_state.shape, generator=generator, dtype=torch.float64)
    loss = (o.double() * do).sum() + (final_state.double() * dht).sum()
    used = {name: x for name, x in leaves.items() if x is not None}
    return {"o": o, "final_state": final_state, **dict(zip(used, torch.autograd.grad(loss, list(used.values()))))}


def fla_math(case, cu_seqlens=None):
    """FLA's math in float64 (tests/kernels/fla_recurrence.py) with chunk_kda's arguments, the states in
    the caller's layout."""
    def call(q, k, v, g, beta, initial_state=None, A_log=None, dt_bias=None, **_):
        if initial_state is not None and case.state_v_first:
            initial_state = initial_state.transpose(-1, -2)
        o, final_state, _ = kda(q, k, v, g, beta, initial_state, A_log, dt_bias, cu_seqlens, case.options)
        return o, final_state.transpose(-1, -2) if case.state_v_first else final_state

    return call


CASES = {  # FLA's grid (test_drop_in_gpu.GRID) at sizes the interpreter runs in seconds
    "fp16-T100-H3-D30": (Case(2, 100, 3, 3, 30, 30, Options(scale=1.0)), torch.float16),
    "fp16-masked": (Case(2, 150, 2, 2, 32, 32, Options(scale=0.1), mask_p=0.5), torch.float16),
    "bf16-HV2-chunk32": (Case(2, 100, 2, 4, 32, 32, BOUNDED, safe_gate=True, chunk_size=32), torch.bfloat16),
    "bf16-softplus-l2": (Case(2, 90, 2, 4, 32, 32, replace(SOFTPLUS, use_qk_l2norm_in_kernel=True)), torch.bfloat16),
    "kimi-HV=H": (Case(2, 100, 2, 2, 32, 32, KIMI, safe_gate=True, state_v_first=True), torch.bfloat16),
    "kimi-HV=2H": (Case(2, 100, 2, 4, 32, 32, KIMI, safe_gate=True, state_v_first=True), torch.bfloat16),
    "allow_neg_eigval": (Case(2, 96, 2, 2, 32, 32, replace(KIMI, allow_neg_eigval=True)), torch.float16),
}


@pytest.mark.parametrize("name", CASES)
def test_chunk_kda_trains_through_the_kernels_route(name, on_the_interpreter):
    case, dtype = CASES[name]
    seed = sum(map(ord, name))
    leaves = leaves_for(case, seed, dtype)
    before = {name_: None if x is None else x.detach().clone() for name_, x in leaves.items()}
    ours = outputs_and_gradients(chunk_kda, case, leaves, seed)
    exact = outputs_and_gradients(fla_math(case), case, {n: None if x is None else x.detach().double()
                                                         .requires_grad_() for n, x in leaves.items()}, seed)
    for tensor, value in exact.items():
        report = error_report(ours[tensor], value)
        assert report.rel_l2 < FLA_TOLERANCES[tensor], f"{tensor}: {report}"
    assert all(x is None or torch.equal(x.detach(), before[n]) for n, x in leaves.items())


def test_packed_training_through_the_kernels_route(on_the_interpreter):
    """cu_seqlens with autograd: the sequences scattered into a dense batch, each from its own state; a
    second call gives the same bits."""
    cu_seqlens = [0, 31, 96, 160]
    case = Case(1, 160, 2, 4, 32, 32, KIMI, safe_gate=True, state_v_first=True)
    leaves = leaves_for(case, 3, torch.bfloat16, N=len(cu_seqlens) - 1)
    packed = {"cu_seqlens": torch.tensor(cu_seqlens)}
    ours = outputs_and_gradients(chunk_kda, case, leaves, 3, **packed)
    exact = outputs_and_gradients(fla_math(case, cu_seqlens), case, {n: None if x is None else x.detach().double()
                                                                     .requires_grad_() for n, x in leaves.items()}, 3)
    for tensor, value in exact.items():
        report = error_report(ours[tensor], value)
        assert report.rel_l2 < FLA_TOLERANCES[tensor], f"{tensor}: {report}"
    again = outputs_and_gradients(chunk_kda, case, leaves, 3, **packed)
    assert all(torch.equal(again[tensor], ours[tensor]) for tensor in ours)


@pytest.mark.parametrize("options", [L2, replace(KIMI, use_beta_sigmoid_in_kernel=False)])
def test_decode_over_a_pool_through_the_kernel_route(options, on_the_interpreter):
    """vLLM's call: 6 sequences of one token, a pool of 18 states in slots drawn at random, the other
    slots bitwise unchanged, the named ones one token on."""
    B, H, D = 6, 2, 32
    case = Case(1, B, H, H, D, D, options)
    leaves = {n: None if x is None else x.detach() for n, x in leaves_for(case, 7, torch.bfloat16, N=3 * B).items()}
    pool = leaves["initial_state"]
    slots = torch.randperm(3 * B, generator=torch.Generator().manual_seed(7))[:B].int()
    untouched = torch.ones(3 * B, dtype=torch.bool)
    untouched[slots.long()] = False
    others = pool[untouched].clone()
    starts = pool[slots.long()].clone()
    o, final_state = fused_recurrent_kda_fwd(*(leaves[x] for x in ("q", "k", "v", "g", "beta")), leaves["A_log"],
                                             leaves["dt_bias"], initial_state=pool, inplace_final_state=True,
                                             cu_seqlens=torch.arange(B + 1, dtype=torch.int32),
                                             ssm_state_indices=slots, **options.fla_kwargs())
    expected_o, expected_states = fla_math(case, list(range(B + 1)))(
        *(leaves[x].double() for x in ("q", "k", "v", "g", "beta")), initial_state=starts.double(),
        A_log=leaves["A_log"], dt_bias=leaves["dt_bias"])
    assert final_state is pool and torch.equal(pool[untouched], others)
    assert error_report(o, expected_o).rel_l2 < FLA_TOLERANCES["o"]
    assert error_report(pool[slots.long()], expected_states).rel_l2 < FLA_TOLERANCES["final_state"]


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_the_prepare_in_four_channel_passes_gives_the_same_forward(chunk_size, on_the_interpreter):
    """KernelConfig.channel_passes = 4 (the score GEMMs' operands a quarter of d_k wide: less shared
    memory, more prepare programs an SM, archive/studies/kda_prepare_occupancy.py): Kimi Linear's call,
    o and the final state as close to FLA's math as with two passes."""
    from stages.kda.calls import forward
    from stages.kda.config import resolve
    from stages.kda.fla_options import input_form

    case = Case(2, 100, 2, 4, 64, 64, KIMI, safe_gate=True)
    leaves = {n: None if x is None else x.detach() for n, x in leaves_for(case, 11, torch.bfloat16).items()}
    form = input_form(64, None, True, True, True, False, -5.0)
    exact_o, exact_state = fla_math(case)(*(leaves[x].double() for x in ("q", "k", "v", "g", "beta")),
                                          initial_state=leaves["initial_state"].double(), A_log=leaves["A_log"],
                                          dt_bias=leaves["dt_bias"])
    errors = {}
    for passes in (2, 4):
        config = resolve(2, 4, 64, 64, 132, chunk_size=chunk_size, channel_passes=passes)
        o, final_state = forward(*(leaves[x] for x in ("q", "k", "v", "g", "beta")), leaves["initial_state"], True,
                                 "device", config, form, leaves["A_log"], leaves["dt_bias"])
        errors[passes] = (error_report(o, exact_o).rel_l2, error_report(final_state, exact_state).rel_l2)
    assert max(errors[4]) < FLA_TOLERANCES["o"], errors
    assert errors[4][0] < 1.5 * errors[2][0] and errors[4][1] < 1.5 * errors[2][1], errors
