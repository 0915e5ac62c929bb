"""What FLA's chunk_kda and fused_recurrent_kda compute, written out in float64 torch for autograd, apart
from the course's code: FLA's gate, norm and beta formulas (fla/ops/kda/gate.py, naive.py), grouped
value heads, and the recurrence token by token in the kernel layout, one sequence at a time.

    g    = -exp(A_log) softplus(x + dt_bias)              use_gate_in_kernel
         = lower_bound sigmoid(exp(A_log) (x + dt_bias))  ... with lower_bound (no A_log: sigmoid(x + dt_bias))
    q, k = x / sqrt(||x||^2 + 1e-6)                      use_qk_l2norm_in_kernel; then q times scale
    beta = sigmoid(b), or 2 sigmoid(b)                    use_beta_sigmoid_in_kernel (allow_neg_eigval)
    S^T <- Diag(e^{g_t}) S^T;  S^T <- S^T + beta_t k_t (v_t - (S^T)^T k_t)^T;  o_t = (S^T)^T q_t
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Options:
    """FLA's options of one call, as the test makes it."""

    scale: float | None = None
    use_qk_l2norm_in_kernel: bool = False
    use_gate_in_kernel: bool = False
    use_beta_sigmoid_in_kernel: bool = False
    allow_neg_eigval: bool = False
    lower_bound: float | None = None

    def fla_kwargs(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def activated(q, k, g, beta, A_log, dt_bias, options: Options):
    """(q scaled, k, g, beta) as the recurrence takes them, float64, q and k over the value heads."""
    q, k, g, beta = (x.double() for x in (q, k, g, beta))
    HV, K = g.shape[-2:]
    if options.use_qk_l2norm_in_kernel:
        q, k = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q = q * (K ** -0.5 if options.scale is None else options.scale)
    if options.use_gate_in_kernel:
        x = g + (0 if dt_bias is None else dt_bias.double().view(HV, K))
        if options.lower_bound is None:
            g = -A_log.double().exp().view(HV, 1) * F.softplus(x)
        else:
            rate = 1.0 if A_log is None else A_log.double().exp().view(HV, 1)
            g = options.lower_bound * torch.sigmoid(rate * x)
    if options.use_beta_sigmoid_in_kernel:
        beta = (2.0 if options.allow_neg_eigval else 1.0) * torch.sigmoid(beta)
    group = HV // q.shape[-2]
    return q.repeat_interleave(group, dim=-2), k.repeat_interleave(group, dim=-2), g, beta


def recurrence(q, k, v, g, beta, state):
    """One sequence, token by token: q, k, g (T, HV, K), v (T, HV, V), beta (T, HV) float64, state S^T
    (HV, K, V). Returns (o (T, HV, V), the states after each token (T, HV, K, V), and S^T at the start)."""
    outputs, states = [], []
    for t in range(q.shape[0]):
        state = state * g[t].exp()[..., None]
        recalled = torch.einsum("hkv,hk->hv", state, k[t])
        state = state + torch.einsum("hk,hv->hkv", k[t], beta[t][:, None] * (v[t].double() - recalled))
        outputs.append(torch.einsum("hkv,hk->hv", state, q[t]))
        states.append(state)
    if not outputs:
        return state.new_zeros((0, *v.shape[1:])), state.new_zeros((0, *state.shape))
    return torch.stack(outputs), torch.stack(states)


def kda(q, k, v, g, beta, initial_state=None, A_log=None, dt_bias=None, cu_seqlens=None, options=Options()):
    """FLA's call in float64 on the inputs' device: (o (B, T, HV, V), final states (N, HV, K, V), the states
    after every token (a list over sequences of (T_n, HV, K, V))), states S^T in the kernel layout."""
    q, k, g, beta = activated(q, k, g, beta, A_log, dt_bias, options)
    B, T, HV, K = g.shape
    V = v.shape[-1]
    rows = ([(b, 0, T) for b in range(B)] if cu_seqlens is None else
            [(0, int(s), int(e)) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])])
    o = q.new_zeros(B, T, HV, V)
    finals, every = [], []
    for n, (b, start, end) in enumerate(rows):
        state = q.new_zeros(HV, K, V) if initial_state is None else initial_state[n].double()
        o_n, states = recurrence(*(x[b, start:end] for x in (q, k, v, g, beta)), state)
        if end > start:
            o = o.index_put((torch.tensor(b, device=q.device), torch.arange(start, end, device=q.device)), o_n)
            state = states[-1]
        finals.append(state)
        every.append(states)
    return o, torch.stack(finals), every


def chunk_starts(every, initial_states, chunk_size):
    """S^T at the start of every chunk of each sequence, one after the other: (NT, HV, K, V); every: kda's
    states after each token, initial_states (N, HV, K, V) (zeros for none)."""
    starts = []
    for n, states in enumerate(every):
        for c in range(math.ceil(len(states) / chunk_size)):
            starts.append(states[c * chunk_size - 1] if c else initial_states[n].double())
    return torch.stack(starts)
