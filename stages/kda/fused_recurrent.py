"""FLA 0.6.0's `fused_recurrent_kda` and `fused_recurrent_kda_fwd`: KDA token by token, as a server decodes.

    S^T <- Diag(e^{g_t}) S^T,   u = beta_t (v_t - (S^T)^T k_t),   S^T <- S^T + k_t u^T,   o_t = (S^T)^T q_t

`fused_recurrent_kda(q, k, v, g, beta, ...)` is the call FLA's `KimiDeltaAttention` makes for a few
tokens at inference (64 or fewer, no autograd): chunk_kda's options (the form: L2 norm, scale, the
gate from its raw projection, beta's sigmoid; grouped value heads; state_v_first; cu_seqlens), and it
returns (o, final_state or None) with the caller's initial_state untouched.

`fused_recurrent_kda_fwd(...)` is the entry a server calls, and the one FLA's backend registry hands to
a backend: the same, and the states of a pool (`initial_state` (P, HV, K, V)) read and written in place
(`inplace_final_state`, its default):

    ssm_state_indices (N,)         sequence n, one token, reads and writes pool[ssm_state_indices[n]]
    ssm_state_indices (N, T_max)   sequence n starts from pool[ssm_state_indices[n, 0]] and writes the
                                   state after its token t to pool[ssm_state_indices[n, t]]: every
                                   drafted token's state is kept for speculative decoding's verify
    num_accepted_tokens (N,)       sequence n starts instead from pool[ssm_state_indices[n, a_n - 1]],
                                   a_n = num_accepted_tokens[n]: the state after the last draft the
                                   previous step accepted (stage 7's verify_step and accept_drafts)

A sequence with no tokens reads and writes nothing. Without ssm_state_indices, sequence n starts from
initial_state[n] and, in place, leaves its final state there.

Two devices:

- CPU: the form in float64 (chunk_kda's reference_inputs), then stage 7's decode_step token by token
  (reference A, float64), returned in the inputs' dtypes.
- CUDA: one token per sequence runs stage 7's decode kernel (stages.kda.calls.decode, the form computed
  as it loads the token); without a pool, more tokens of fp16 or bf16 run chunk_kda's kernels (the same
  recurrence, chunked). q, k, v in float32 run the decode kernel token by token at every length, built
  for float32, o in float32: FLA's fused_recurrent takes float32 and computes token by token in it; the
  decode kernel has no GEMM, its arithmetic is in fp32 already, where the chunked kernels' GEMMs take
  fp16 or bf16 only. Over a pool, each token step reads the sequences' states into a scratch pool of N
  states (in the kernel layout S^T, head dims padded to 32), advances it with the decode kernel and
  writes it to the slots FLA names: one gather and one scatter of N states per token beside the
  kernel's own read and write of them.

What FLA's kernel takes and the course refuses, each with its reason: beta per value column
(beta (B, T, HV, V)), ssm_state_indices (N,) with more than one token a sequence (FLA's kernel then
reads the next sequence's slots), ssm_state_indices with inplace_final_state=False (FLA's kernel then
writes token states to rows of an (N, ...) tensor by token position), and the softplus gate without
A_log (FLA's fused kernel takes e^1 for it; its chunk_kda refuses it).
"""

from dataclasses import dataclass

import numpy as np
import torch

from stages.kda.autograd import CHECK_MODES, KERNEL_MULTIPLE, Run, dense, kernel_operands, kernel_prefill, reference_inputs
from stages.kda.checks import DECODE_DTYPES
from stages.kda.fla_options import (check_beta_options, check_gate_options, check_gate_parameters, check_packing,
                                    check_shapes, check_tensors, input_form, state_v_first_of, to_kernel_layout)
from stages.kda.inputs import InputForm
from stages.s07_serving.reference import decode_step

DEFAULT_CHUNK_SIZE = 64  # the chunked kernels' chunk, where more than one token a sequence runs on CUDA


@dataclass(frozen=True)
class StateSlots:
    """Which pool row each sequence starts from and which it writes after each of its tokens; None: the
    sequence's own row n, read at the start and written at the end (no pool)."""

    read: "torch.Tensor | None"  # (N,) int64: sequence n's first state
    write: "torch.Tensor | None"  # (N, T_max) int64: where the state after its token t goes


# --8<-- [start:fused_recurrent_kda]
def fused_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                        scale: float | None = None, initial_state: torch.Tensor | None = None,
                        output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                        use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                        allow_neg_eigval: bool = False, lower_bound: float | None = None, state_v_first: bool = False,
                        cu_seqlens: torch.Tensor | None = None, *, transpose_state_layout: bool | None = None,
                        checks: str = "device") -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's fused_recurrent_kda: (o (B, T, HV, V) in v's dtype, final states (N, HV, K, V) float32, or
    (N, HV, V, K) with state_v_first, or None); initial_state is read, never written. Shapes and options
    as chunk_kda's; checks: as chunk_kda's (CUDA)."""
    state_v_first = state_v_first_of(state_v_first, transpose_state_layout)
    check_packing(q, initial_state, cu_seqlens)
    check_beta_options(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    return fused_recurrent_kda_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
                                   inplace_final_state=False, state_v_first=state_v_first, cu_seqlens=cu_seqlens,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                   use_gate_in_kernel=use_gate_in_kernel,
                                   use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel,
                                   allow_neg_eigval=allow_neg_eigval, lower_bound=lower_bound, checks=checks)


def fused_recurrent_kda_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            A_log: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
                            initial_state: torch.Tensor | None = None, scale: float | None = None,
                            output_final_state: bool = False, inplace_final_state: bool = True,
                            state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
                            ssm_state_indices: torch.Tensor | None = None,
                            num_accepted_tokens: torch.Tensor | None = None, use_qk_l2norm_in_kernel: bool = False,
                            use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
                            allow_neg_eigval: bool = False, lower_bound: float | None = None,
                            out: torch.Tensor | None = None, *, checks: str = "device"
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """FLA's fused_recurrent_kda_fwd: (o, final_state), o written into `out` when given. final_state is
    initial_state itself with inplace_final_state (the pool, written in place: see the module's
    docstring), a new float32 tensor with output_final_state, else None."""
    plan = plan_fused_recurrent_kda_fwd(q, k, v, g, beta, A_log, dt_bias, initial_state, scale, output_final_state,
                                        inplace_final_state, state_v_first, cu_seqlens, ssm_state_indices,
                                        num_accepted_tokens, use_qk_l2norm_in_kernel, use_gate_in_kernel,
                                        use_beta_sigmoid_in_kernel, allow_neg_eigval, lower_bound, out, checks=checks)
    sequences, slots, form = plan.sequences, plan.slots, plan.form
    A_log, dt_bias = plan.A_log, plan.dt_bias
    with torch.no_grad():  # FLA's fused recurrence has no backward either
        step = kernel_steps if q.is_cuda else reference_steps
        o, final_state = step(q, k, v, g, beta, A_log, dt_bias, initial_state, state_v_first, sequences, slots, form,
                              checks, cu_seqlens)
    if inplace_final_state:
        if slots.write is None:  # no pool: each sequence's final state back into its own row
            initial_state.copy_(to_kernel_layout(final_state, state_v_first))
        final_state = initial_state
    elif output_final_state:
        final_state = to_kernel_layout(final_state, state_v_first).contiguous()
    else:
        final_state = None
    if out is not None:
        return out.copy_(o), final_state
    return o, final_state
# --8<-- [end:fused_recurrent_kda]


@dataclass(frozen=True)
class RecurrentPlan:
    """A checked fused_recurrent_kda_fwd call: its sequences (batch row, first token, end), the state
    slots, the form, and the gate's parameters (None without the gate in the kernel)."""

    sequences: list
    slots: StateSlots
    form: InputForm
    A_log: "torch.Tensor | None"
    dt_bias: "torch.Tensor | None"


def plan_fused_recurrent_kda_fwd(q, k, v, g, beta, A_log=None, dt_bias=None, initial_state=None, scale=None,
                                 output_final_state=False, inplace_final_state=True, state_v_first=False,
                                 cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                                 use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                 use_beta_sigmoid_in_kernel=False, allow_neg_eigval=False, lower_bound=None, out=None,
                                 *, checks="device") -> RecurrentPlan:
    """fused_recurrent_kda_fwd's arguments checked (FLA's rules where FLA has them, and what the course
    refuses, with why) and planned; reads cu_seqlens and the slot indices on the host. The FLA backend's
    verifier runs it too."""
    check_tensors({"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
                   "A_log": A_log if use_gate_in_kernel else None, "dt_bias": dt_bias if use_gate_in_kernel else None},
                  cuda_dtypes=DECODE_DTYPES)
    if beta.dim() == v.dim():
        raise NotImplementedError("fused_recurrent_kda does not support beta of shape (B, T, HV, V), one per value "
                                  "column: the course's beta is one scalar per token and value head")
    check_gate_options(use_gate_in_kernel, A_log, lower_bound, safe_gate=False)
    B, T, H, K, HV, V = check_shapes(q, k, v, g, beta)
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    check_gate_parameters(A_log, dt_bias, HV, K)
    if inplace_final_state and initial_state is None:
        raise ValueError("inplace_final_state writes the final states into initial_state: give it")
    if checks not in CHECK_MODES:
        raise ValueError(f"checks must be one of {', '.join(map(repr, CHECK_MODES))}, got {checks!r}")
    if out is not None and out.shape != v.shape:
        raise ValueError(f"out must have v's shape {tuple(v.shape)}, got {tuple(out.shape)}")
    sequences = token_rows(B, T, cu_seqlens)
    slots = state_slots(ssm_state_indices, num_accepted_tokens, sequences, inplace_final_state)
    check_state_rows(initial_state, slots, len(sequences), HV, K, V, state_v_first)
    form = input_form(K, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                      allow_neg_eigval, lower_bound)
    return RecurrentPlan(sequences, slots, form, A_log, dt_bias)


def token_rows(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """Each sequence's (batch row, first token, end): the B rows, or the packed batch's sequences."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != T or any(b < a for a, b in zip(offsets[:-1], offsets[1:])):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T = {T}, the packed tokens; got "
                         f"{offsets[:8]}{' ...' if len(offsets) > 8 else ''}")
    return [(0, start, end) for start, end in zip(offsets[:-1], offsets[1:])]


def state_slots(ssm_state_indices: torch.Tensor | None, num_accepted_tokens: torch.Tensor | None,
                sequences: list[tuple[int, int, int]], inplace_final_state: bool) -> StateSlots:
    """The pool rows each sequence reads and writes (see StateSlots and the module's docstring)."""
    if ssm_state_indices is None:
        if num_accepted_tokens is not None:
            raise ValueError("num_accepted_tokens picks a sequence's first state among its ssm_state_indices: give them")
        return StateSlots(None, None)
    if not inplace_final_state:
        raise NotImplementedError("fused_recurrent_kda_fwd does not support ssm_state_indices with "
                                  "inplace_final_state=False: the indices name rows of the pool in initial_state, "
                                  "which the states after each token are written to")
    N, longest = len(sequences), max((end - start for _, start, end in sequences), default=0)
    indices = ssm_state_indices.long().cpu()
    if indices.dim() == 1:
        if longest > 1:
            raise NotImplementedError("fused_recurrent_kda_fwd does not support 1-D ssm_state_indices with more than "
                                      "one token a sequence (FLA's kernel then reads the next sequence's slots): give "
                                      "(N, T_max), one slot per token")
        indices = indices[:, None]
    if indices.shape[0] != N or indices.shape[1] < longest:
        raise ValueError(f"ssm_state_indices must be (N,) or (N, T_max) with N = {N} sequences and T_max >= {longest} "
                         f"tokens, got {tuple(ssm_state_indices.shape)}")
    first = torch.zeros(N, dtype=torch.int64)
    if num_accepted_tokens is not None:
        accepted = num_accepted_tokens.long().cpu()
        if accepted.shape != (N,) or (accepted < 1).any() or (accepted > indices.shape[1]).any():
            raise ValueError(f"num_accepted_tokens must be (N,) = ({N},) with entries in [1, {indices.shape[1]}], got "
                             f"{accepted.tolist()[:8]}")
        first = accepted - 1
    return StateSlots(indices[torch.arange(N), first], indices)


def check_state_rows(initial_state: torch.Tensor | None, slots: StateSlots, N: int, HV: int, K: int, V: int,
                     state_v_first: bool) -> None:
    """initial_state is one state per sequence (N, ...), or a pool (P, ...) that every slot lies in."""
    if initial_state is None:
        return
    layout = (HV, V, K) if state_v_first else (HV, K, V)
    if tuple(initial_state.shape[1:]) != layout or initial_state.dim() != 4:
        raise ValueError(f"initial_state must be ({'P' if slots.read is not None else 'N'}, "
                         f"{', '.join(map(str, layout))}){', V first' if state_v_first else ''}, got "
                         f"{tuple(initial_state.shape)}")
    if slots.read is None:
        if initial_state.shape[0] != N:
            raise ValueError(f"initial_state must hold N = {N} states, one per sequence, got {initial_state.shape[0]}")
        return
    P = initial_state.shape[0]
    for name, used in (("ssm_state_indices", slots.write), ("the first slots", slots.read)):
        if used.numel() and (used.min() < 0 or used.max() >= P):
            raise ValueError(f"{name} must lie in [0, P) = [0, {P}), the pool's rows; got [{used.min()}, {used.max()}]")


# --8<-- [start:reference_steps]
def reference_steps(q, k, v, g, beta, A_log, dt_bias, initial_state, state_v_first, sequences, slots, form, checks,
                    cu_seqlens):
    """The CPU: every sequence token by token through stage 7's decode_step in float64, from its start
    state, the pool rows written as slots says. Returns (o in v's dtype, final states (N, HV, K, V) in the
    kernel layout, float32 (float64 for float64 inputs or states); the pool, if any, already written)."""
    state_dtype = torch.float64 if torch.float64 in (q.dtype, getattr(initial_state, "dtype", None)) else torch.float32
    o_dtype, o = v.dtype, torch.zeros(v.shape, dtype=torch.float64)
    q, k, v, g, beta = (x.numpy() for x in reference_inputs(q, k, v, g, beta, A_log, dt_bias, form))
    pool = to_kernel_layout(initial_state, state_v_first)
    states = np.zeros((len(sequences), v.shape[2], q.shape[3], v.shape[3]))
    if pool is not None:
        states[:] = (pool if slots.read is None else pool[slots.read]).double().numpy()
    for n, (b, start, end) in enumerate(sequences):
        state, slot = states[n:n + 1], np.zeros(1, dtype=np.int64)  # a pool of one: the view is advanced in place
        for t in range(start, end):
            o[b, t] = torch.from_numpy(decode_step(*(x[b, t][None] for x in (q, k, v, g, beta)), state, slot)[0])
            if slots.write is not None:
                pool[slots.write[n, t - start]] = torch.from_numpy(state[0])
    return o.to(o_dtype), torch.from_numpy(states).to(state_dtype)
# --8<-- [end:reference_steps]


# --8<-- [start:kernel_steps]
def kernel_steps(q, k, v, g, beta, A_log, dt_bias, initial_state, state_v_first, sequences, slots, form, checks,
                 cu_seqlens):
    """CUDA: the decode kernel token by token over a pool, for one token a sequence, or for float32 q, k,
    v (see the module's docstring); more tokens of fp16 or bf16 without a pool run chunk_kda's chunked
    kernels. Returns (o in v's dtype, final states (N, HV, K, V) fp32 in the kernel layout; the pool,
    if any, already written)."""
    longest = max((end - start for _, start, end in sequences), default=0)
    start_states = to_kernel_layout(initial_state, state_v_first)
    if slots.read is None and longest > 1 and q.dtype != torch.float32:
        run = Run(form, DEFAULT_CHUNK_SIZE, checks, keep_prepared=False, intermediate=False)
        if cu_seqlens is None:
            o, final_state, _ = dense(q, k, v, g, beta, A_log, dt_bias, start_states, run)
            return o, final_state
        return kernel_prefill(q, k, v, g, beta, A_log, dt_bias, start_states, cu_seqlens, run)
    return decode_tokens(q, k, v, g, beta, A_log, dt_bias, start_states, state_v_first, sequences, slots, form, checks)


def decode_tokens(q, k, v, g, beta, A_log, dt_bias, start_states, state_v_first, sequences, slots, form, checks):
    """Token step t advances every sequence that has a token t: its state in a scratch pool (N, HV, d_k,
    d_v) fp32, S^T with K and V padded to 32, through stage 7's decode kernel built for q's dtype; with a
    pool, the state after each token is then written to its slot (V first with state_v_first)."""
    from stages.kda.calls import decode

    N, (HV, K, V) = len(sequences), (v.shape[2], q.shape[3], v.shape[3])
    d_k, d_v = (-(-x // KERNEL_MULTIPLE) * KERNEL_MULTIPLE for x in (K, V))
    scratch = torch.zeros((N, HV, d_k, d_v), dtype=torch.float32, device=q.device)
    if start_states is not None:
        scratch[:, :, :K, :V] = start_states if slots.read is None else start_states[slots.read.to(q.device)]
    o = torch.zeros_like(v)
    for t in range(max((end - start for _, start, end in sequences), default=0)):
        active = [n for n, (_, start, end) in enumerate(sequences) if start + t < end]
        rows = torch.tensor([sequences[n][0] for n in active], device=q.device)
        tokens = torch.tensor([sequences[n][1] + t for n in active], device=q.device)
        token = kernel_operands(*(x[rows, tokens][:, None] for x in (q, k, v, g, beta)), A_log, dt_bias, None, form)
        q_t, k_t, v_t, g_t, beta_t = (x[:, 0] for x in token[:5])
        o_t, _ = decode(q_t, k_t, v_t, g_t, beta_t, scratch, torch.tensor(active, dtype=torch.int32, device=q.device),
                        checks, form=form, A_log=token[5], dt_bias=token[6])
        o[rows, tokens] = o_t[..., :V]
        if slots.write is not None:
            written = slots.write[active, t].to(q.device)
            start_states[written] = scratch[active][..., :K, :V]  # the pool's own view: V first stays V first
    return o, scratch[..., :K, :V]
# --8<-- [end:kernel_steps]
