"""The drop-in's CUDA route on the CPU: FLA's chunk_kda and fused_recurrent_kda calls as the GPU runs
them (the operands padded and cast, the form computed in the kernels, autograd through the backward
kernels, packed training through a dense batch, packed inference through stage 7's prefill, the decode
over a pool), with every TileLang program run by the tile interpreter instead of compiled
(stages.kda.on_cpu), against FLA's math in float64.

What it checks is everything between the caller and the kernels: a GPU run that fails says only that
something failed once its session ends, where this says which tensor and by how much, on any machine.
It does not check what only the GPU does (the compiled code's timing, races, its TF32 merges' exact
bits), nor the packed programs' run-time sizes (here they are built again for each batch's sizes).

Bounds: FLA's tolerances, as the GPU tests take them (tests/kernels/test_drop_in_gpu.py: A_log's,
on which FLA asserts nothing, held to dg's).
"""

import re
from dataclasses import replace

import pytest
import torch

from stages.common.errors import error_report
from stages.kda.autograd import chunk_kda
from stages.kda.fused_recurrent import fused_recurrent_kda, fused_recurrent_kda_fwd
from stages.kda.on_cpu import calls_on_cpu, interpreted
from tests.kernels.fla_recurrence import Options, kda
from tests.kernels.test_drop_in_gpu import FLA_TOLERANCES, KIMI, exact, fla_leaves, outputs_and_gradients
from tests.kernels.test_fla_chunk_kda import BOUNDED, L2, SOFTPLUS, Case


@pytest.fixture
def on_the_interpreter():
    """The fast path's calls on the CPU, every program run by the tile interpreter (stages.kda.on_cpu)."""
    with calls_on_cpu(interpreted):
        yield


def test_an_output_the_program_leaves_unwritten_reads_as_nan():
    """The interpreted stand-in's outputs start as NaN, as a GPU's fresh memory may hold anything: a
    program that writes half of Y hands back the other half as NaN, not as zeros that look computed."""
    import tilelang.language as T

    @T.prim_func
    def first_half(X: T.Tensor((8,), "float32"), Y: T.Tensor((8,), "float32")):
        with T.Kernel(1, threads=4):
            for i in T.Parallel(4):
                Y[i] = X[i]

    y = interpreted(first_half, out_idx=[1])(torch.ones(8))
    assert torch.equal(y[:4], torch.ones(4)) and torch.isnan(y[4:]).all()


CASES = {  # FLA's grid (test_drop_in_gpu.GRID) at sizes the interpreter runs in seconds
    "fp16-T100-H3-D30": (Case(2, 100, 3, 3, 30, 30, Options(scale=1.0)), torch.float16),
    "fp16-masked": (Case(2, 150, 2, 2, 32, 32, Options(scale=0.1), mask_p=0.5), torch.float16),
    "bf16-HV2-chunk32": (Case(2, 100, 2, 4, 32, 32, BOUNDED, safe_gate=True, chunk_size=32), torch.bfloat16),
    "bf16-softplus-l2": (Case(2, 90, 2, 4, 32, 32, replace(SOFTPLUS, use_qk_l2norm_in_kernel=True)), torch.bfloat16),
    "kimi-HV=H": (Case(2, 100, 2, 2, 32, 32, KIMI, safe_gate=True, state_v_first=True), torch.bfloat16),
    "kimi-HV=2H": (Case(2, 100, 2, 4, 32, 32, KIMI, safe_gate=True, state_v_first=True), torch.bfloat16),
    "allow_neg_eigval": (Case(2, 96, 2, 2, 32, 32, replace(KIMI, allow_neg_eigval=True)), torch.float16),
    # head dims above 128: the call trains at chunk 32 (backward_chunk_size), the state products by blocks
    "bf16-D256-gate": (Case(1, 70, 1, 1, 256, 256, SOFTPLUS), torch.bfloat16),
    "fp16-K100-V200": (Case(1, 50, 1, 1, 100, 200, Options(scale=1.0)), torch.float16),
}


@pytest.mark.parametrize("name", CASES)
def test_chunk_kda_trains_through_the_kernels_route(name, on_the_interpreter):
    case, dtype = CASES[name]
    seed = sum(map(ord, name))
    leaves = fla_leaves(case, seed, dtype, device="cpu")
    before = {name_: None if x is None else x.detach().clone() for name_, x in leaves.items()}
    ours = outputs_and_gradients(chunk_kda, case, leaves, seed)
    for tensor, value in exact(case, leaves, seed).items():
        report = error_report(ours[tensor], value)
        assert report.rel_l2 < FLA_TOLERANCES[tensor], f"{tensor}: {report}"
    assert all(x is None or torch.equal(x.detach(), before[n]) for n, x in leaves.items())


@pytest.mark.parametrize("cu_seqlens", [[0, 31, 96, 160], [0, 30, 35, 105, 106]])
def test_packed_training_through_the_kernels_route(cu_seqlens, on_the_interpreter):
    """cu_seqlens with autograd: the sequences scattered into a dense batch, each from its own state; a
    second call gives the same bits. The second batch is KimiDeltaAttention's GPU test's in miniature
    (a sequence of one token, rows mostly padding), whose gradients the GPU got as NaN
    (docs/fla_backend.md): here every kernel output starts as NaN (stages.kda.on_cpu.interpreted)."""
    case = Case(1, cu_seqlens[-1], 2, 4, 32, 32, KIMI, safe_gate=True, state_v_first=True)
    leaves = fla_leaves(case, 3, torch.bfloat16, len(cu_seqlens) - 1, device="cpu")
    packed = {"cu_seqlens": torch.tensor(cu_seqlens)}
    ours = outputs_and_gradients(chunk_kda, case, leaves, 3, **packed)
    for tensor, value in exact(case, leaves, 3, cu_seqlens).items():
        report = error_report(ours[tensor], value)
        assert report.rel_l2 < FLA_TOLERANCES[tensor], f"{tensor}: {report}"
    again = outputs_and_gradients(chunk_kda, case, leaves, 3, **packed)
    assert all(torch.equal(again[tensor], ours[tensor]) for tensor in ours)


def test_the_forward_s_prepare_kept_for_the_backward_gives_the_same_bits(on_the_interpreter):
    """disable_recompute=True: the backward reads the forward's prepare outputs instead of running the
    prepare again, the same program on the same inputs: every output and gradient bitwise equal."""
    case = Case(2, 100, 2, 4, 32, 32, KIMI, safe_gate=True, state_v_first=True)
    leaves = fla_leaves(case, 5, torch.bfloat16, device="cpu")
    recomputed = outputs_and_gradients(chunk_kda, case, leaves, 5)
    kept = outputs_and_gradients(lambda *a, **kw: chunk_kda(*a, disable_recompute=True, **kw), case, leaves, 5)
    assert all(torch.equal(kept[tensor], recomputed[tensor]) for tensor in recomputed)


@pytest.mark.parametrize("cu_seqlens", [None, [0, 31, 96, 160]])
def test_the_states_at_every_chunk_start_through_the_kernels_route(cu_seqlens):
    """return_intermediate_states (inference): the forward keeps its prepare's outputs and the backward's
    states kernel walks them; dense, or packed as FLA counts each sequence's own chunks: the states at
    every chunk's start in FLA's shape and v's dtype, against the CPU's own route (float64 references)."""
    B = 2 if cu_seqlens is None else 1
    case = Case(B, 160, 2, 4, 32, 32, KIMI, safe_gate=True, state_v_first=True)
    N = B if cu_seqlens is None else len(cu_seqlens) - 1
    leaves = {n: None if x is None else x.detach()
              for n, x in fla_leaves(case, 9, torch.bfloat16, N, device="cpu").items()}
    arguments = dict(output_final_state=True, A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], safe_gate=True,
                     state_v_first=True, return_intermediate_states=True, **KIMI.fla_kwargs(),
                     **({} if cu_seqlens is None else {"cu_seqlens": torch.tensor(cu_seqlens)}))
    tensors = [leaves[x] for x in ("q", "k", "v", "g", "beta")]
    with torch.inference_mode():
        _, _, expected = chunk_kda(*(x.double() for x in tensors), initial_state=leaves["initial_state"].double(),
                                   **arguments)
        with calls_on_cpu(interpreted):
            _, _, states = chunk_kda(*tensors, initial_state=leaves["initial_state"], **arguments)
    assert states.shape == expected.shape and states.dtype == torch.bfloat16
    assert error_report(states, expected).rel_l2 < FLA_TOLERANCES["final_state"]


@pytest.mark.parametrize("options", [L2, replace(KIMI, use_beta_sigmoid_in_kernel=False)])
def test_decode_over_a_pool_through_the_kernel_route(options, on_the_interpreter):
    """vLLM's call: 6 sequences of one token, a pool of 18 states in slots drawn at random, the other
    slots bitwise unchanged, the named ones one token on."""
    B, H, D = 6, 2, 32
    case = Case(1, B, H, H, D, D, options)
    leaves = {n: None if x is None else x.detach()
              for n, x in fla_leaves(case, 7, torch.bfloat16, 3 * B, "cpu").items()}
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
    truth = exact(case, dict(leaves, initial_state=starts), 7, list(range(B + 1)))
    assert final_state is pool and torch.equal(pool[untouched], others)
    assert error_report(o, truth["o"]).rel_l2 < FLA_TOLERANCES["o"]
    assert error_report(pool[slots.long()], truth["final_state"]).rel_l2 < FLA_TOLERANCES["final_state"]


@pytest.mark.parametrize("lengths", [(40, 0, 77, 13), (100,)])
def test_packed_inference_through_the_prefill_route(lengths, on_the_interpreter):
    """chunk_kda without autograd on cu_seqlens: stage 7's prefill, Kimi Linear's form computed as its
    packed prepare loads the tokens (an empty sequence, a short one, grouped heads, state_v_first), each
    sequence from its own state: o and the final states against FLA's math."""
    cu_seqlens = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    case = Case(1, sum(lengths), 2, 4, 32, 32, KIMI, safe_gate=True, state_v_first=True)
    leaves = {n: None if x is None else x.detach()
              for n, x in fla_leaves(case, 13, torch.bfloat16, len(lengths), "cpu").items()}
    with torch.no_grad():
        o, final_state = chunk_kda(*(leaves[x] for x in ("q", "k", "v", "g", "beta")),
                                   initial_state=leaves["initial_state"], output_final_state=True,
                                   A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], safe_gate=True,
                                   state_v_first=True, cu_seqlens=torch.tensor(cu_seqlens), **KIMI.fla_kwargs())
    truth = exact(case, leaves, 13, cu_seqlens)
    assert error_report(o, truth["o"]).rel_l2 < FLA_TOLERANCES["o"]
    assert error_report(final_state, truth["final_state"]).rel_l2 < FLA_TOLERANCES["final_state"]


def test_speculative_drafts_through_the_kernel_route(on_the_interpreter):
    """Speculative verification as vLLM calls it: ssm_state_indices (N, T_max) and num_accepted_tokens,
    sequence n starting from the state after the last draft it accepted and writing the state after
    each of its tokens to its own slot, grouped heads and state_v_first: against FLA's math token by token;
    the slots no sequence names stay bitwise as they were."""
    case = Case(1, 6, 1, 2, 32, 32, replace(L2, use_beta_sigmoid_in_kernel=True), state_v_first=True)
    lengths, accepted, cu_seqlens = [3, 1, 2], torch.tensor([2, 1, 3]), [0, 3, 4, 6]
    leaves = {n: None if x is None else x.detach()
              for n, x in fla_leaves(case, 21, torch.bfloat16, 12, "cpu").items()}
    pool = leaves["initial_state"]
    indices = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=torch.int32)
    named = {int(i) for n, length in enumerate(lengths) for i in indices[n, :length]}
    unnamed = [i for i in range(12) if i not in named]
    others = pool[unnamed].clone()
    first = pool[indices[torch.arange(3), accepted - 1].long()].clone()
    o, _ = fused_recurrent_kda_fwd(*(leaves[x] for x in ("q", "k", "v", "g", "beta")), leaves["A_log"],
                                   leaves["dt_bias"], initial_state=pool, inplace_final_state=True,
                                   cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32), ssm_state_indices=indices,
                                   num_accepted_tokens=accepted, state_v_first=True, **case.options.fla_kwargs())
    truth = exact(case, dict(leaves, initial_state=first), 21, cu_seqlens)
    assert error_report(o, truth["o"]).rel_l2 < FLA_TOLERANCES["o"]
    last = torch.stack([pool[indices[n, length - 1].long()] for n, length in enumerate(lengths)])
    assert error_report(last, truth["final_state"]).rel_l2 < FLA_TOLERANCES["final_state"]
    assert torch.equal(pool[unnamed], others)


@pytest.mark.parametrize("chunk_size", [32, 64])
def test_the_prepare_in_four_channel_passes_gives_the_same_forward(chunk_size, on_the_interpreter):
    """KernelConfig.channel_passes = 4 (the score GEMMs' operands a quarter of d_k wide: less shared
    memory, more prepare programs an SM, archive/studies/kda_prepare_occupancy.py): Kimi Linear's call,
    o and the final state as close to FLA's math as with two passes."""
    from stages.kda.calls import forward
    from stages.kda.config import resolve
    from stages.kda.fla_options import input_form

    case = Case(2, 100, 2, 4, 64, 64, KIMI, safe_gate=True)
    leaves = {n: None if x is None else x.detach()
              for n, x in fla_leaves(case, 11, torch.bfloat16, device="cpu").items()}
    form = input_form(64, None, True, True, True, False, -5.0)
    truth = exact(case, leaves, 11)
    errors = {}
    for passes in (2, 4):
        config = resolve(2, 4, 64, 64, 132, chunk_size=chunk_size, channel_passes=passes)
        o, final_state = forward(*(leaves[x] for x in ("q", "k", "v", "g", "beta")), leaves["initial_state"], True,
                                 "device", config, form, leaves["A_log"], leaves["dt_bias"])
        errors[passes] = (error_report(o, truth["o"]).rel_l2, error_report(final_state, truth["final_state"]).rel_l2)
    assert max(errors[4]) < FLA_TOLERANCES["o"], errors
    assert errors[4][0] < 1.5 * errors[2][0] and errors[4][1] < 1.5 * errors[2][1], errors


def test_the_setup_page_s_example_runs():
    """docs/setup.md's example of the calls without a GPU, run as written: o, the final state and the
    gradients it asks for, in the shapes and dtypes the page's call gives."""
    from kdacourse import REPO_ROOT

    page = (REPO_ROOT / "docs" / "setup.md").read_text()
    section = page.split("## The fast path's calls without a GPU", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    names = {}
    exec(compile(example, "docs/setup.md", "exec"), names)  # noqa: S102 - the course's own page
    assert names["o"].shape == (1, 100, 2, 32) and names["o"].dtype == torch.bfloat16
    assert names["final_state"].shape == (1, 2, 32, 32)
    assert all(names[x].grad is not None and names[x].grad.abs().sum() > 0 for x in ("q", "k", "v", "g", "beta"))


# ------------------------------------------------------------------ fused_recurrent_kda in float32

# fp32 q, k, v run the decode kernel token by token in fp32, as FLA's fused_recurrent computes (its
# fp32 tests hold o and the final state to 1e-4 and 0.005): the bound is ten times tighter than FLA's
# tightest. fp32's unit roundoff is 6e-8; an o in fp16 (bf16) carries its own rounding, 2^-11 (2^-8)
# relative, on top of any route's error, so an fp16 o cannot meet it: a route that computed in fp16
# shows here (test_an_fp16_call_misses_the_fp32_bound checks that the bound tells them apart)
FP32_BOUND = 1e-5
FP32_CASES = {  # T > 1 without a pool: the chunked kernels for fp16 and bf16, the decode kernel for fp32
    "T13-HV2H": Case(2, 13, 2, 4, 32, 32, Options(scale=1.0)),
    "T11-state_v_first-K20-V24": Case(1, 11, 2, 2, 20, 24, L2, state_v_first=True),
}


def _leaves(case, seed, dtype, N=None):
    return {name: None if x is None else x.detach() for name, x in fla_leaves(case, seed, dtype, N, "cpu").items()}


def _recurrent(case, leaves):
    return fused_recurrent_kda(*(leaves[x] for x in ("q", "k", "v", "g", "beta")), leaves["A_log"],
                               leaves["dt_bias"], initial_state=leaves["initial_state"], output_final_state=True,
                               state_v_first=case.state_v_first, **case.options.fla_kwargs())


@pytest.mark.parametrize("name", FP32_CASES)
def test_fused_recurrent_kda_in_float32_through_the_decode_kernel(name, on_the_interpreter):
    """FLA's fp32 call without a pool: o in fp32 and the final state against FLA's math in float64 at
    FP32_BOUND; the inputs, the initial state too, unchanged; a second call bitwise equal."""
    case = FP32_CASES[name]
    leaves = _leaves(case, sum(map(ord, name)), torch.float32)
    before = {name_: x.clone() for name_, x in leaves.items() if x is not None}
    o, final_state = _recurrent(case, leaves)
    truth = exact(case, leaves, 0)
    assert o.dtype == torch.float32
    assert error_report(o, truth["o"]).rel_l2 < FP32_BOUND, error_report(o, truth["o"])
    assert error_report(final_state, truth["final_state"]).rel_l2 < FP32_BOUND
    assert all(torch.equal(leaves[name_], x) for name_, x in before.items())
    again = _recurrent(case, leaves)
    assert torch.equal(again[0], o) and torch.equal(again[1], final_state)


POOL_CASE = Case(1, 12, 1, 2, 32, 32, KIMI, state_v_first=True)  # Kimi Linear's form, grouped heads
POOL_LENGTHS = [5, 0, 7]  # an empty sequence among them


def _pool_call(leaves, pool, indices):
    cu_seqlens = torch.tensor([0, *torch.tensor(POOL_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    return fused_recurrent_kda_fwd(*(leaves[x] for x in ("q", "k", "v", "g", "beta")), leaves["A_log"],
                                   leaves["dt_bias"], initial_state=pool, inplace_final_state=True,
                                   cu_seqlens=cu_seqlens, ssm_state_indices=indices, state_v_first=True,
                                   **POOL_CASE.options.fla_kwargs())


def _pool_truth(leaves, pool, indices):
    """FLA's math from each sequence's first slot: (o, {slot: the state after its token, V first})."""
    cu_seqlens = [0, *torch.tensor(POOL_LENGTHS).cumsum(0).tolist()]
    o, _, every = kda(*(leaves[x] for x in ("q", "k", "v", "g", "beta")),
                      pool[indices[:, 0].long()].transpose(-1, -2), leaves["A_log"], leaves["dt_bias"], cu_seqlens,
                      POOL_CASE.options)
    return o, {int(indices[n, t]): state.transpose(-1, -2) for n, states in enumerate(every)
               for t, state in enumerate(states)}


def _pool(dtype):
    """POOL_CASE's leaves in dtype, a pool of 24 states V first and (N, T_max) slots drawn at random."""
    leaves = _leaves(POOL_CASE, 17, dtype, N=24)
    indices = torch.randperm(24, generator=torch.Generator().manual_seed(17))[:21].view(3, 7).int()
    return leaves, leaves.pop("initial_state"), indices


def test_fused_recurrent_kda_fwd_in_float32_over_a_pool(on_the_interpreter):
    """vLLM's speculative call in fp32: each sequence's state after each of its tokens in its slot, at
    FP32_BOUND from FLA's math; the slots no token names bitwise unchanged; the inputs unchanged; the same
    call on the same pool again gives the same bits."""
    leaves, pool, indices = _pool(torch.float32)
    start, before = pool.clone(), {name: x.clone() for name, x in leaves.items() if x is not None}
    o, final_state = _pool_call(leaves, pool, indices)
    expected_o, expected_states = _pool_truth(leaves, start, indices)
    written = sorted(expected_states)
    unnamed = [slot for slot in range(24) if slot not in expected_states]
    assert final_state is pool and o.dtype == torch.float32
    assert error_report(o, expected_o).rel_l2 < FP32_BOUND, error_report(o, expected_o)
    assert error_report(pool[written], torch.stack([expected_states[s] for s in written])).rel_l2 < FP32_BOUND
    assert torch.equal(pool[unnamed], start[unnamed])
    assert all(torch.equal(leaves[name], x) for name, x in before.items())
    again_pool = start.clone()
    again, _ = _pool_call(leaves, again_pool, indices)
    assert torch.equal(again, o) and torch.equal(again_pool, pool)


def test_an_fp16_call_misses_the_fp32_bound(on_the_interpreter):
    """The same pool call in fp16 (the decode kernel with fp16 q, k, v and o): within FLA's fp16
    tolerance, and above FP32_BOUND, which therefore tells a route that computed in fp16 from fp32."""
    leaves, pool, indices = _pool(torch.float16)
    expected_o, _ = _pool_truth(leaves, pool.clone(), indices)
    o, _ = _pool_call(leaves, pool, indices)
    assert FP32_BOUND < error_report(o, expected_o).rel_l2 < FLA_TOLERANCES["o"], error_report(o, expected_o)


@pytest.mark.parametrize("call, dtype, message", [
    (chunk_kda, torch.float32, "q must have dtype float16 or bfloat16 (the kernels' inputs on CUDA), got float32"),
    (fused_recurrent_kda, torch.float64,
     "q must have dtype float16 or bfloat16 or float32 (the kernels' inputs on CUDA), got float64"),
])
def test_the_cuda_route_refuses_what_its_kernels_do_not_take(call, dtype, message, on_the_interpreter):
    """chunk_kda's kernels take fp16 and bf16 (their GEMMs), fused_recurrent_kda's decode kernel fp32
    too: each says so before a kernel is built."""
    q = torch.rand(1, 8, 1, 32, dtype=dtype)
    with pytest.raises(TypeError, match=re.escape(message)):
        call(q, q, q, -torch.rand(1, 8, 1, 32), torch.rand(1, 8, 1))


@pytest.mark.parametrize("K, V", [(64, 257), (32, 320)])
def test_training_past_the_backward_s_head_dims_is_refused_before_the_forward(K, V, on_the_interpreter):
    """The backward's programs hold C x d_v tiles in shared memory: past 256 (as the kernels read the dims,
    padded to 32: 257 -> 288) no chunk fits them, so chunk_kda refuses a call that will need its backward
    before the forward runs, and says why; the same shapes in inference are taken. (d_k past 256 is
    FLA's own refusal, in FLA's words: check_shapes.)"""
    q = torch.randn(1, 40, 1, K, dtype=torch.bfloat16)
    k = torch.nn.functional.normalize(q.float(), dim=-1).to(torch.bfloat16)
    v = torch.randn(1, 40, 1, V, dtype=torch.bfloat16, requires_grad=True)
    g, beta = -torch.rand(1, 40, 1, K), torch.rand(1, 40, 1)
    with pytest.raises(ValueError, match=re.escape(f"the backward's kernels take head dims up to 256 (d_k = "
                                                   f"{-(-K // 32) * 32}, d_v = {-(-V // 32) * 32}")) as refusal:
        chunk_kda(q, k, v, g, beta)
    assert any(entry.name == "plan_chunk_kda" for entry in refusal.traceback)  # refused by the plan, no kernel run
    with torch.inference_mode():
        o, _ = chunk_kda(q, k, v.detach(), g, beta)
    assert o.shape == (1, 40, 1, V) and torch.isfinite(o).all()


def test_the_backward_above_head_dims_of_128_asks_for_chunk_32(on_the_interpreter):
    """Stage 6's backward given a config at chunk 64 with d_k = 256: its intra program would need about
    396 KB of shared memory, so the call is refused with the chunk it takes, before any kernel runs."""
    from stages.kda.calls import backward
    from stages.kda.config import KernelConfig

    q = torch.nn.functional.normalize(torch.randn(1, 64, 1, 256), dim=-1).to(torch.bfloat16)
    g, beta = -torch.rand(1, 64, 1, 256), torch.rand(1, 64, 1)
    with pytest.raises(ValueError, match=re.escape("at head dims above 128 (d_k = 256, d_v = 256) the backward runs "
                                                   "at chunk_size 32, got 64")):
        backward(q, q, q, g, beta, q, config=KernelConfig(chunk_size=64, block_dv=64), checks="off")
