"""fused_recurrent_kda and fused_recurrent_kda_fwd as FLA 0.6.0's: FLA's grid (test_fused_recurrent,
_use_beta_sigmoid_in_kernel, _state_v_first, _gate_in_kernel, _vllm_decode) shrunk to the CPU against
FLA's math in float64 (tests/kernels/fla_recurrence.py), a pool of states read and written in place
(decode, speculative verification), and what is refused."""

import re
from dataclasses import replace

import pytest
import torch

from stages.common.errors import error_report
from stages.kda.fused_recurrent import fused_recurrent_kda, fused_recurrent_kda_fwd
from stages.kda.calls import PLAIN
from stages.kda.inputs import activate
from tests.kernels.fla_recurrence import Options, kda
from tests.kernels.test_fla_chunk_kda import BOUNDED, EXACT, L2, SOFTPLUS, TWICE_SIGMOID_BETA, Case, make_leaves

GRID = {
    "D60-gva": Case(2, 21, 2, 4, 12, 12, Options(scale=1.0)),
    "D100-l2norm": Case(1, 30, 2, 2, 10, 10, L2),
    "gva-gate_in_kernel": Case(1, 17, 1, 4, 8, 8, SOFTPLUS),
    "bounded_gate-no_A_log": Case(1, 17, 1, 2, 8, 8, BOUNDED, with_A_log=False),
    "allow_neg_eigval": Case(2, 16, 2, 2, 8, 8, TWICE_SIGMOID_BETA),
    "state_v_first": Case(1, 19, 2, 2, 8, 6, L2, state_v_first=True),
    "no_initial_state": Case(1, 9, 1, 1, 8, 8, Options(), with_initial_state=False),
}


def _detached(leaves):
    return {name: None if x is None else x.detach() for name, x in leaves.items()}


def _ours(case, leaves, **options):
    return fused_recurrent_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], leaves["A_log"],
                               leaves["dt_bias"], initial_state=leaves["initial_state"], output_final_state=True,
                               state_v_first=case.state_v_first,
                               **{name: value for name, value in case.options.fla_kwargs().items()}, **options)


def _expected(case, leaves, cu_seqlens=None):
    initial_state = leaves["initial_state"]
    if initial_state is not None and case.state_v_first:
        initial_state = initial_state.transpose(-1, -2)
    o, final_state, every = kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state,
                                leaves["A_log"], leaves["dt_bias"], cu_seqlens, case.options)
    return o, final_state.transpose(-1, -2) if case.state_v_first else final_state, every


@pytest.mark.parametrize("name", GRID)
def test_fused_recurrent_kda_equals_fla_s_math(name):
    """o and the final states against FLA's math in float64; the initial state is read, not written, and a
    second call gives bitwise the same."""
    case = GRID[name]
    leaves = _detached(make_leaves(case, sum(map(ord, name))))
    before = {name: x.clone() for name, x in leaves.items() if x is not None}
    o, final_state = _ours(case, leaves)
    expected_o, expected_state, _ = _expected(case, leaves)
    assert error_report(o, expected_o).rel_l2 <= EXACT
    assert error_report(final_state, expected_state).rel_l2 <= EXACT
    assert all(torch.equal(leaves[name], x) for name, x in before.items())
    again = _ours(case, leaves)
    assert torch.equal(again[0], o) and torch.equal(again[1], final_state)


def test_packed_sequences_and_no_final_state():
    """cu_seqlens (an empty sequence among them), each sequence from its own state; output_final_state=False
    returns None, as FLA's does."""
    case = Case(1, 25, 1, 2, 8, 8, SOFTPLUS, state_v_first=True)
    cu_seqlens = [0, 10, 10, 11, 25]
    leaves = _detached(make_leaves(case, 11, N=4))
    o, final_state = _ours(case, leaves, cu_seqlens=torch.tensor(cu_seqlens))
    expected_o, expected_state, _ = _expected(case, leaves, cu_seqlens)
    assert error_report(o, expected_o).rel_l2 <= EXACT
    assert error_report(final_state, expected_state).rel_l2 <= EXACT
    o_alone, none = fused_recurrent_kda(*(leaves[x] for x in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")),
                                        initial_state=leaves["initial_state"], state_v_first=True,
                                        cu_seqlens=torch.tensor(cu_seqlens), **case.options.fla_kwargs())
    assert none is None and torch.equal(o_alone, o)


HUGE = 1e30  # FLA's untouched slots: any read of them would show


def _pool_call(case, leaves, pool, indices, cu_seqlens, accepted=None, **options):
    return fused_recurrent_kda_fwd(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], leaves["A_log"],
                                   leaves["dt_bias"], initial_state=pool, inplace_final_state=True,
                                   cu_seqlens=torch.tensor(cu_seqlens, dtype=torch.int32), ssm_state_indices=indices,
                                   num_accepted_tokens=accepted, state_v_first=case.state_v_first,
                                   **case.options.fla_kwargs(), **options)


@pytest.mark.parametrize("case", [
    Case(1, 7, 2, 2, 8, 8, L2),  # FLA's test_fused_recurrent_vllm_decode: B = 7 sequences of one token
    Case(1, 5, 1, 2, 8, 6, BOUNDED),
    Case(1, 6, 1, 1, 8, 8, SOFTPLUS, state_v_first=True),
])
def test_decode_over_a_pool_in_place(case):
    """One token per sequence, sequence n at pool[ssm_state_indices[n]] (a random permutation into a pool
    three times the batch, its other slots at 1e30): o and the advanced slots against FLA's math, the
    pool written in place and returned as the final state, the other slots bitwise unchanged."""
    N = case.T
    leaves = _detached(make_leaves(case, N, N=3 * N))
    pool = leaves["initial_state"].float()
    indices = torch.randperm(3 * N, generator=torch.Generator().manual_seed(N))[:N].int()
    untouched = torch.ones(3 * N, dtype=torch.bool)
    untouched[indices.long()] = False
    pool[untouched] = HUGE
    starts = pool[indices.long()].clone()
    o, final_state = _pool_call(case, leaves, pool, indices, list(range(N + 1)))
    assert final_state is pool
    assert torch.equal(pool[untouched], torch.full_like(pool[untouched], HUGE))
    expected_o, expected_states, _ = _expected(case, dict(leaves, initial_state=starts), list(range(N + 1)))
    assert error_report(o, expected_o).rel_l2 <= EXACT
    assert error_report(pool[indices.long()], expected_states).rel_l2 <= 1e-6  # the pool is float32


def test_speculative_steps_keep_every_drafted_state_and_start_from_the_accepted_one():
    """ssm_state_indices (N, T_max) and num_accepted_tokens: sequence n starts from the state after the
    last draft it accepted, pool[indices[n, a_n - 1]], and the state after each of its tokens t goes to
    pool[indices[n, t]]: against FLA's math token by token; slots no sequence names stay as they were."""
    case = Case(1, 6, 1, 2, 8, 8, replace(L2, use_beta_sigmoid_in_kernel=True))
    lengths, accepted = [3, 1, 2], torch.tensor([2, 1, 3])
    cu_seqlens = [0, 3, 4, 6]
    leaves = _detached(make_leaves(case, 21, N=12))
    pool = leaves["initial_state"].float()
    indices = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8]], dtype=torch.int32)
    expected_pool = pool.clone()
    first = pool[indices[torch.arange(3), accepted - 1].long()].clone()
    o, _ = _pool_call(case, leaves, pool, indices, cu_seqlens, accepted)
    expected_o, _, every = _expected(case, dict(leaves, initial_state=first), cu_seqlens)
    for n, length in enumerate(lengths):
        expected_pool[indices[n, :length].long()] = every[n].float()
    assert error_report(o, expected_o).rel_l2 <= EXACT
    assert error_report(pool, expected_pool).rel_l2 <= 1e-6
    unnamed = [4, 5, 8, 9, 10, 11]  # past the sequences' tokens, or named by none: not written
    assert torch.equal(pool[unnamed], leaves["initial_state"].float()[unnamed])


def test_output_into_out():
    case = Case(1, 9, 1, 1, 8, 8, L2)
    leaves = _detached(make_leaves(case, 4))
    out, pool = torch.empty_like(leaves["v"]), leaves["initial_state"].float()
    expected_o = _expected(case, dict(leaves, initial_state=pool))[0]
    o, _ = fused_recurrent_kda_fwd(*(leaves[x] for x in ("q", "k", "v", "g", "beta")), initial_state=pool, out=out,
                                   **case.options.fla_kwargs())
    assert o is out and error_report(out, expected_o).rel_l2 <= EXACT


def _refused(**options):
    """fused_recurrent_kda_fwd on two packed sequences of two tokens and a pool of three states, options changed."""
    tensors = {"q": torch.rand(1, 4, 1, 8), "k": torch.rand(1, 4, 1, 8), "v": torch.rand(1, 4, 1, 8),
               "g": -torch.rand(1, 4, 1, 8), "beta": torch.rand(1, 4, 1)}
    tensors.update({name: options.pop(name) for name in list(options) if name in tensors})
    return fused_recurrent_kda_fwd(**tensors, **{"initial_state": torch.zeros(3, 1, 8, 8),
                                                  "cu_seqlens": torch.tensor([0, 2, 4]), **options})


@pytest.mark.parametrize("options, error, message", [
    ({"beta": torch.rand(1, 4, 1, 8)}, NotImplementedError, "does not support beta of shape (B, T, HV, V)"),
    ({"ssm_state_indices": torch.tensor([0, 1])}, NotImplementedError, "1-D ssm_state_indices with more than one token"),
    ({"ssm_state_indices": torch.tensor([[0, 1], [2, 0]]), "inplace_final_state": False}, NotImplementedError,
     "ssm_state_indices with inplace_final_state=False"),
    ({"use_gate_in_kernel": True}, ValueError, "`A_log` must be provided when `use_gate_in_kernel=True`"),
    ({"num_accepted_tokens": torch.tensor([1, 1])}, ValueError, "num_accepted_tokens picks a sequence's first state"),
    ({"ssm_state_indices": torch.tensor([[0, 1], [2, 3]])}, ValueError, "ssm_state_indices must lie in [0, P) = [0, 3)"),
    ({"ssm_state_indices": torch.tensor([[0, 1], [2, 0]]), "num_accepted_tokens": torch.tensor([1, 3])}, ValueError,
     "num_accepted_tokens must be (N,) = (2,) with entries in [1, 2]"),
    ({"initial_state": None}, ValueError, "inplace_final_state writes the final states into initial_state"),
])
def test_refusals_say_why(options, error, message):
    with pytest.raises(error, match=re.escape(message)):
        _refused(**options)


def test_fused_recurrent_kda_keeps_fla_s_rule_on_allow_neg_eigval():
    q = torch.rand(1, 4, 1, 8)
    with pytest.raises(ValueError, match=re.escape("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")):
        fused_recurrent_kda(q, q, q, -q, torch.rand(1, 4, 1), allow_neg_eigval=True)


# ------------------------------------------------------------------ the CUDA route's plumbing, on the CPU

def decode_in_torch(q, k, v, g, beta, state_pool, slots, checks="device", config=None, form=PLAIN, A_log=None,
                    dt_bias=None):
    """stages.kda.calls.decode's contract in float64 torch on the CPU (the kernel's stand-in): each named
    slot's S^T (H, d_k, d_v) advanced by its row's token, S^T <- Diag(e^g) S^T + beta k (v - k^T S^T)^T
    after the form's activation; o = q^T S^T (the state after the token), in v's dtype."""
    q, k, g, beta = activate(form, q.double(), k.double(), g.double(), beta.double(), A_log, dt_bias)
    group = v.shape[1] // q.shape[1]
    q, k = q.repeat_interleave(group, 1), k.repeat_interleave(group, 1)
    S = torch.exp(g)[..., None] * state_pool[slots.long()].double()
    S = S + beta[..., None, None] * k[..., None] * (v.double() - (k[..., None] * S).sum(-2))[:, :, None, :]
    state_pool[slots.long()] = S.to(state_pool.dtype)
    return (q[..., None] * S).sum(-2).to(v.dtype)


@pytest.mark.parametrize("case", [
    Case(1, 7, 2, 2, 8, 8, L2),
    Case(1, 5, 1, 2, 12, 6, BOUNDED),  # grouped heads, head dims padded to the kernels' 32
    Case(1, 6, 1, 1, 8, 8, SOFTPLUS, state_v_first=True),
])
def test_the_cuda_route_feeds_the_decode_kernel_what_it_takes(case, monkeypatch):
    """The CUDA route (kernel_steps: the operands padded and put in the call's form, a scratch pool,
    the slots written back) run on the CPU with the decode kernel replaced by its contract in torch:
    the same o and pool as FLA's math. The GPU tests time out or fail without saying why where the
    route, not the kernel, is wrong (a call with an argument missing failed every pooled decode)."""
    import stages.kda.calls
    import stages.kda.fused_recurrent

    monkeypatch.setattr(stages.kda.fused_recurrent, "reference_steps", stages.kda.fused_recurrent.kernel_steps)
    monkeypatch.setattr(stages.kda.calls, "decode", lambda *a, **kw: (decode_in_torch(*a, **kw), a[5]))
    N = case.T
    leaves = _detached(make_leaves(case, N, N=3 * N))
    pool = leaves["initial_state"].float()
    indices = torch.randperm(3 * N, generator=torch.Generator().manual_seed(N))[:N].int()
    starts = pool[indices.long()].clone()
    o, final_state = _pool_call(case, leaves, pool, indices, list(range(N + 1)))
    expected_o, expected_states, _ = _expected(case, dict(leaves, initial_state=starts), list(range(N + 1)))
    assert final_state is pool
    assert error_report(o, expected_o).rel_l2 <= 1e-6  # the scratch pool is float32
    assert error_report(pool[indices.long()], expected_states).rel_l2 <= 1e-6


def test_a_state_that_overflows_is_computed_not_refused():
    """Keys of squared norm 100 at beta = 1 multiply the state's part along k by 1 - 100 = -99 a token:
    here it grows about e^3.3 a token and float64 overflows within 300 (FLA's kernels overflow fp32
    sooner, and FLA computes on). So does the course:
    the overflow shows in the values (the final state is not finite), every token before it is computed
    as on its own, and nothing raises for a state the recurrence itself produced."""
    T, D = 300, 4
    generator = torch.Generator().manual_seed(7)
    q, v = (torch.randn(1, T, 1, D, generator=generator, dtype=torch.float64) for _ in range(2))
    k = torch.nn.functional.normalize(torch.randn(1, T, 1, D, generator=generator, dtype=torch.float64), dim=-1) * 10
    g, beta = torch.zeros(1, T, 1, D, dtype=torch.float64), torch.ones(1, T, 1, dtype=torch.float64)
    o, final_state = fused_recurrent_kda(q, k, v, g, beta, scale=1.0, output_final_state=True)
    assert not torch.isfinite(final_state).all()
    early = 20
    o_early, _ = fused_recurrent_kda(*(x[:, :early] for x in (q, k, v, g, beta)), scale=1.0)
    assert torch.isfinite(o_early).all()
    assert torch.equal(o[:, :early], o_early)
