"""Stage 6: a KDA layer as Kimi Linear builds it, around the differentiable `chunk_kda`.

x (B, T, d_model) -> y (B, T, d_model), with H heads of head_dim channels (d_k = d_v = head_dim):

    q, k, v = Swish(ShortConv(W_q x)), Swish(ShortConv(W_k x)), Swish(ShortConv(W_v x))
    g       = -e^{A_log} * softplus(W_f_up W_f_down x + dt_bias)      (B, T, H, d_k), log gates < 0
    beta    = sigmoid(W_beta x)                                      (B, T, H), in (0, 1)
    o       = KDA(L2norm(q) / sqrt(d_k), L2norm(k), v, g, beta)      stage 4's recurrence
    y       = W_o [RMSNorm(o) * weight * sigmoid(W_gate_up W_gate_down x + bias)]

Why each part is there:

- **Short convolution and Swish.** Each of q, k, v is a causal depthwise convolution over the last
  conv_size tokens (4 by default), then SiLU (x sigmoid(x), "Swish"). The recurrence mixes tokens
  only through the state; the convolution lets a key or a value already see its neighbours, which
  recall tasks need (a value next to its key), at the cost of conv_size multiplies per channel.
- **Per-channel forget gate, in log space.** a_t = e^{g_t} in (0, 1]^{d_k}, one rate per key
  channel, from two low-rank projections (d_model -> gate_rank -> H d_k: far fewer weights than a
  full d_model x H d_k matrix, as Kimi Linear's f_a_proj and f_b_proj). softplus(.) > 0 makes
  g < 0 whatever the weights, so the state never grows; the per-head rate e^{A_log} scales it, and
  dt_bias, set at init to softplus^{-1} of dt drawn log-uniformly in [1e-3, 1e-1], gives each
  channel its own time scale: with A in [1, 16], a channel remembers for 1 / (A dt), from about one
  token to a thousand. That spread of rates across channels is the "frequency diversity" the second
  source article credits the channel-wise gate with (RoPE's job, done by a learnt decay). The kernels
  take g itself (log space): the chunk's cumulative decays are sums of g, and e^{gamma} is formed
  only where it is bounded. With `lower_bound` (FLA's safe gate), g = lower_bound sigmoid(e^{A_log}
  (f + dt_bias)) lies in (lower_bound, 0): a floor under the gates, which stage 5's anchored
  factors (at most a_min^{-8}) then can never overflow. Without it (the default, as in FLA's layer)
  training can learn gates that the CUDA kernels refuse: the tiny demo's did by step 161 (the
  stage 6 page, "Why the unbounded gate stops"); the CPU path takes any gate.
- **beta = sigmoid(W_beta x).** The delta rule's write strength, one scalar per token and head, in
  (0, 1): 0 keeps the state, 1 replaces what the state recalls for k_t by v_t.
- **q, k L2-normalized, scaled by 1 / sqrt(d_k).** ||k|| = 1 makes I - beta k k^T a contraction for
  beta in [0, 1] (stage 3), in the kernel (`use_qk_l2norm_in_kernel`), as FLA's layer asks.
- **Output gate and norm.** The recurrence's output is RMS-normalized per head (its scale drifts
  with the state's) and multiplied by a sigmoid gate from a second low-rank projection of x, then
  projected back to d_model.

`forward(x, cache=None, use_cache=False, cu_seqlens=None)` returns (y, cache). The cache (`KDACache`)
is what a server keeps between calls, per sequence: each short convolution's last conv_size - 1 inputs
of q, k and v (in x's dtype), and the recurrent state S^T (H, d_k, d_v), fp32 (float64 for a float64
layer). The state alone does not carry a sequence: the next token's q, k and v read the last
conv_size - 1 projected inputs too. Calling forward on consecutive pieces of a sequence, each with the
cache the previous call returned, gives the same y as one call on the whole: prefill in pieces, then
decode token by token. With cu_seqlens, one call takes a packed batch of sequences of any lengths
(FLA's convention, as FLA's layer passes cu_seqlens to its short convolutions and to chunk_kda), and
each convolution stops at every sequence's boundary: a convolution over the packed row would mix the
last tokens of one sequence into the first of the next.
"""

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from stages.kda.autograd import chunk_kda

A_RANGE = (1.0, 16.0)  # e^{A_log} at init: each head's rate
DT_RANGE = (1e-3, 1e-1)  # softplus(dt_bias) at init: each channel's step, drawn log-uniformly
DT_FLOOR = 1e-4


def wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32, or float64 if it is: gates and norms are computed in float32 at least, as in Kimi Linear."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class KDACache(NamedTuple):
    """What forward carries from one piece of a sequence to the next."""

    # one row per sequence: B, or N_seq for a packed batch (cu_seqlens)
    conv_q: torch.Tensor  # (B, conv_size - 1, H * d_k): the last inputs of q's short convolution
    conv_k: torch.Tensor  # (B, conv_size - 1, H * d_k)
    conv_v: torch.Tensor  # (B, conv_size - 1, H * d_v)
    state: torch.Tensor  # (B, H, d_k, d_v): S^T, the kernel layout, fp32 (float64 for a float64 layer)


# --8<-- [start:short_convolution]
class ShortConvolution(nn.Module):
    """y_t = Swish(sum_j w[:, j] ⊙ x_{t - size + 1 + j}), causal and depthwise: each channel convolved
    with its own `size` weights over the last `size` tokens. x: (B, T, channels)."""

    def __init__(self, channels: int, size: int):
        super().__init__()
        if size < 1:
            raise ValueError(f"conv_size must be at least 1, got {size}")
        self.size = size
        self.weight = nn.Parameter(torch.empty(channels, 1, size))
        bound = 1.0 / math.sqrt(size)  # nn.Conv1d's default init for one input channel per group
        nn.init.uniform_(self.weight, -bound, bound)

    def forward(self, x: torch.Tensor, past: torch.Tensor | None = None,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (B, T, channels); past: the size - 1 inputs before x (B, size - 1, channels), None for
        zeros (a sequence's start). Returns (y (B, T, channels), the size - 1 inputs that end x).

        With cu_seqlens (N_seq + 1,) x is FLA's packed batch (B = 1): sequence i is tokens
        cu_seqlens[i] to cu_seqlens[i + 1] - 1, past and the returned inputs are (N_seq, size - 1,
        channels), one row per sequence, and each sequence is convolved alone: its first tokens read its
        own past, never the end of the sequence packed before it."""
        if cu_seqlens is not None:
            return self._packed(x, past, cu_seqlens)
        B, T, channels = x.shape
        if past is None:
            past = x.new_zeros(B, self.size - 1, channels)
        if T == 0:  # an empty piece (a packed batch may hold one): nothing to convolve, the past carries on
            return x, past.to(x.dtype)
        extended = torch.cat([past.to(x.dtype), x], dim=1)  # (B, size - 1 + T, channels)
        # conv1d correlates: output t reads extended[t : t + size], whose last row is x_t
        y = F.conv1d(extended.transpose(1, 2), self.weight, groups=channels).transpose(1, 2)
        return F.silu(y).contiguous(), extended[:, T:]  # contiguous: (B, T, H, D) views for the kernels

    def _packed(self, x, past, cu_seqlens):
        """forward on a packed batch: each sequence alone, from its own row of past."""
        bounds = [int(offset) for offset in cu_seqlens]
        if x.shape[0] != 1 or bounds[0] != 0 or bounds[-1] != x.shape[1] or any(
                start > end for start, end in zip(bounds[:-1], bounds[1:])):
            raise ValueError(f"cu_seqlens must run from 0 to T = {x.shape[1]} without decreasing, over a packed "
                             f"batch of one row, got {bounds} for x of shape {tuple(x.shape)}")
        pieces = [self(x[:, start:end], None if past is None else past[i:i + 1])
                  for i, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]))]
        return torch.cat([y for y, _ in pieces], dim=1), torch.cat([ends for _, ends in pieces], dim=0)
# --8<-- [end:short_convolution]


# --8<-- [start:forget_gate]
class ForgetGate(nn.Module):
    """g = -e^{A_log} softplus(W_up W_down x + dt_bias): (B, T, H, d_k) log gates, g < 0, float32 at least.

    With lower_bound (< 0), g = lower_bound sigmoid(e^{A_log} (W_up W_down x + dt_bias)) instead,
    in (lower_bound, 0). A_log: (H,), one rate per head; dt_bias: (H * d_k,), one per channel.
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, rank: int, lower_bound: float | None = None):
        super().__init__()
        if lower_bound is not None and not lower_bound < 0:
            raise ValueError(f"lower_bound must be a negative log gate, got {lower_bound}")
        self.n_heads, self.head_dim, self.lower_bound = n_heads, head_dim, lower_bound
        self.down = nn.Linear(d_model, rank, bias=False)  # low rank: d_model -> rank -> H d_k
        self.up = nn.Linear(rank, n_heads * head_dim, bias=False)
        if lower_bound is None:
            A = torch.empty(n_heads).uniform_(*A_RANGE)
        else:
            A = torch.ones(n_heads)  # the bound, not A, sets the scale: e^{A_log} sharpens the sigmoid
        self.A_log = nn.Parameter(torch.log(A))
        log_dt = torch.empty(n_heads * head_dim).uniform_(math.log(DT_RANGE[0]), math.log(DT_RANGE[1]))
        dt = torch.exp(log_dt).clamp(min=DT_FLOOR)
        self.dt_bias = nn.Parameter(dt + torch.log(-torch.expm1(-dt)))  # softplus^{-1}(dt) = log(e^dt - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = (wide(self.up(self.down(x))) + self.dt_bias).unflatten(-1, (self.n_heads, self.head_dim))
        rate = torch.exp(wide(self.A_log))[:, None]  # (H, 1): one per head
        if self.lower_bound is None:
            return -rate * F.softplus(f)
        return self.lower_bound * torch.sigmoid(rate * f)
# --8<-- [end:forget_gate]


# --8<-- [start:gated_norm]
class GatedRMSNorm(nn.Module):
    """RMSNorm(o) * weight * sigmoid(gate) over the last axis (d_v), in float32 at least."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        o = wide(o)
        normalized = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        return normalized * self.weight * torch.sigmoid(wide(gate))
# --8<-- [end:gated_norm]


# --8<-- [start:layer]
class KDALayer(nn.Module):
    """Kimi Delta Attention as a layer: x (B, T, d_model) -> y (B, T, d_model), H = n_heads heads of
    d_k = d_v = head_dim. gate_rank: the inner size of the forget gate's and the output gate's
    low-rank projections (head_dim by default, as in FLA's layer). kernel: a function with
    chunk_kda's calling convention (ours by default; FLA's `fla.ops.chunk_kda` to compare). checks:
    handed to the kernel as chunk_kda's value-check mode ("device", "host" or "off"; see chunk_kda),
    or None (the default) to call it without one: our chunk_kda then checks on the device, and FLA's,
    which takes no such option, can be the kernel. disable_recompute: handed to the kernel (ours and
    FLA's take it) when True: the forward keeps what the backward would recompute, which costs memory
    (about 0.6 GB a layer at T = 16384, H = 32, d = 128 in bf16) and saves a kernel in the backward.
    """

    def __init__(self, d_model: int, n_heads: int, head_dim: int, conv_size: int = 4, gate_rank: int | None = None,
                 lower_bound: float | None = None, norm_eps: float = 1e-5, kernel: Callable = chunk_kda,
                 checks: str | None = None, disable_recompute: bool = False):
        super().__init__()
        self.n_heads, self.head_dim, self.kernel = n_heads, head_dim, kernel
        self.kernel_options = {} if checks is None else {"checks": checks}
        if disable_recompute:
            self.kernel_options["disable_recompute"] = True
        width, rank = n_heads * head_dim, gate_rank or head_dim
        self.q_proj = nn.Linear(d_model, width, bias=False)
        self.k_proj = nn.Linear(d_model, width, bias=False)
        self.v_proj = nn.Linear(d_model, width, bias=False)
        self.q_conv = ShortConvolution(width, conv_size)
        self.k_conv = ShortConvolution(width, conv_size)
        self.v_conv = ShortConvolution(width, conv_size)
        self.forget_gate = ForgetGate(d_model, n_heads, head_dim, rank, lower_bound)
        self.b_proj = nn.Linear(d_model, n_heads, bias=False)
        self.g_proj = nn.Sequential(nn.Linear(d_model, rank, bias=False), nn.Linear(rank, width, bias=True))
        self.o_norm = GatedRMSNorm(head_dim, norm_eps)
        self.o_proj = nn.Linear(width, d_model, bias=False)

    def forward(self, x: torch.Tensor, cache: KDACache | None = None, use_cache: bool = False,
                cu_seqlens: torch.Tensor | None = None) -> tuple[torch.Tensor, KDACache | None]:
        """x: (B, T, d_model); cache: what the previous piece of these sequences returned, None at their
        start. Returns (y (B, T, d_model), the cache after x if use_cache, else None).

        cu_seqlens (N_seq + 1,): x is FLA's packed batch (B = 1) of N_seq sequences of any lengths, the
        cache one row per sequence; the short convolutions stop at each sequence's boundary and the
        kernel is called with cu_seqlens (FLA's chunk_kda and the course's take them, with autograd)."""
        past = KDACache(None, None, None, None) if cache is None else cache
        q, conv_q = self.q_conv(self.q_proj(x), past.conv_q, cu_seqlens)
        k, conv_k = self.k_conv(self.k_proj(x), past.conv_k, cu_seqlens)
        v, conv_v = self.v_conv(self.v_proj(x), past.conv_v, cu_seqlens)
        q, k, v = (t.unflatten(-1, (self.n_heads, self.head_dim)) for t in (q, k, v))  # (B, T, H, head_dim)
        g = self.forget_gate(x)  # (B, T, H, d_k), float32
        beta = torch.sigmoid(wide(self.b_proj(x)))  # (B, T, H)
        packed = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens}
        o, state = self.kernel(q, k, v, g, beta, initial_state=past.state, output_final_state=use_cache,
                               use_qk_l2norm_in_kernel=True, **packed, **self.kernel_options)
        gate = self.g_proj(x).unflatten(-1, (self.n_heads, self.head_dim))
        y = self.o_proj(self.o_norm(o, gate).flatten(-2).to(x.dtype))
        return y, (KDACache(conv_q, conv_k, conv_v, state) if use_cache else None)
# --8<-- [end:layer]
