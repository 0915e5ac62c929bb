"""Stage 6: KDA as a differentiable torch function, FLA 0.6.0's `chunk_kda` with its whole signature.

    S_t = S_{t-1} Diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T        o_t = scale * S_t q_t
                                                             (paper layout: S is d_v x d_k)

`chunk_kda` takes what FLA's takes and returns what FLA's returns: q, k (B, T, H, K); v (B, T, HV, V);
g (B, T, HV, K); beta (B, T, HV), with HV a multiple of H (grouped value heads: value head j reads q
and k of head j // (HV // H)); states S^T (N, HV, K, V) in the kernel layout, or (N, HV, V, K) with
`state_v_first`; (o, final_state), or (o, final_state, the state at every chunk's start) with
`return_intermediate_states`. `loss.backward()` reaches q, k, v, g, beta and initial_state, through o
and through the final state, and with the gate in the kernel A_log and dt_bias too. FLA's flags for
what is computed from the caller's tensors (the L2 norm of q and k, the scale, the gate from its raw
projection, beta's sigmoid) become one `InputForm` (stages.kda.fla_options).

One `torch.autograd.Function`, `ChunkKDAFunction`, joins a forward and a backward per device:

    CUDA tensors   forward: stage 5's two TileLang kernels (stages.kda.calls.forward), which compute
                   the form as they load the tokens
                   backward: stage 6's TileLang kernels (stages.kda.calls.backward), down to the raw
                   gate, A_log, dt_bias and beta's logits
    CPU tensors    the form in torch in front (`activate`: autograd takes its gradients), q and k
                   repeated over their value heads, then in float64 whatever the dtype:
                   forward: stage 5's reference (prepare, then recurrence)
                   backward: stage 6's reference B (stages.s06_backward.reference.chunkwise_backward)

so that the same layer trains on a GPU, and on a CPU through the references, slowly but exactly.
The forward keeps only its inputs; the backward recomputes what it needs inside each chunk (both
backward paths do), the trade FLA makes by default: memory for one more forward pass. FLA's
`disable_recompute=True` makes the other trade, on CUDA: the forward keeps its prepare kernel's
outputs (W, U, Q e^gamma, K e^{gamma_C - gamma}, A_qk: four (B, T, HV, d) and one (B, T, HV, C) in
q's dtype, about 0.6 GB at T = 16384, HV = 32, d = 128 in bf16) and the backward skips that kernel.

What else a call can carry, and how each is served:

- packed sequences (`cu_seqlens`, int32 or int64, `cu_seqlens_cpu`): inference on CUDA runs stage 7's
  packed prefill; with autograd, and on the CPU, the tokens are scattered into a zero-padded dense
  batch of N_seq rows (zero tokens at a sequence's end change neither its outputs nor its final
  state), run through the dense path above and gathered back (stages.kda.packing.PackedLayout, with
  its cost: N_seq * max_len tokens against T, and one host read of the offsets). A gate computed in
  the kernel is computed in front there, since a zero raw gate is not a zero log gate;
- head dims that are not a multiple of 32 (FLA's tests use 60 and 100) are zero-padded for the kernels
  and cut back; the CPU references take any size;
- beta in (1, 2] on the CPU (`allow_neg_eigval`'s 2 sigmoid(x), or beta given so: FLA's kernels take
  it in either form): the references take beta in [0, 1], and the recurrence with (beta, k, v) is the
  one with (beta / 2, sqrt(2) k, sqrt(2) v), term for term;
- `chunk_size` 32 or 64 (FLA's rule) is the kernels' chunk, but for a call that trains with head dims
  above 128, which runs at 32 (config.backward_chunk_size: the backward's programs fit no larger
  chunk there); the CPU computes in chunks of CPU_CHUNK_SIZE, since in float64 the answer does not
  depend on the chunk and the references' cost per chunk grows as C^2, and uses chunk_size only for the
  intermediate states' layout;
- `use_graph` is taken where the call can be captured (inference: the packed prefill builds its chunk
  table on the device) and refused with autograd on packed sequences (the dense batch is sized on the
  host); `cp_context` (context parallelism) runs stage 8's split over ranks (context_parallel).
"""

import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from stages.common.checks import padded_length
from stages.kda.calls import backward, forward_and_prepared, prefill
from stages.kda.checks import check_backward_head_dims
from stages.kda.config import backward_chunk_size, resolve_for
from stages.kda.fla_options import (check_beta_options, check_chunk_size, check_gate_options, check_gate_parameters,
                                    check_packing, check_shapes, check_state_shape, check_tensors, input_form,
                                    state_v_first_of, to_kernel_layout)
from stages.kda.inputs import InputForm, activate, activate_gate
from stages.kda.packing import PackedLayout, expand_heads, pad_channels, pad_state
from stages.s05_fast_kda import reference as forward_reference
from stages.s06_backward import reference as backward_reference

# The CPU path runs plain-loop references whose cost per chunk grows as C^2 (reference B's scores
# and their gradients): short chunks are faster there, and in float64 the answer does not depend on C.
CPU_CHUNK_SIZE = 16
KERNEL_MULTIPLE = 32  # the kernels take K and V in multiples of 32
CHECK_MODES = ("device", "host", "off")
SQRT2 = math.sqrt(2.0)


@dataclass(frozen=True)
class Run:
    """How one chunk_kda call runs, whatever the route: the form, the kernels' chunk, their value checks,
    whether the forward keeps its prepare outputs (disable_recompute) and returns the chunk states."""

    form: InputForm
    chunk_size: int
    checks: str
    keep_prepared: bool
    intermediate: bool


@dataclass(frozen=True)
class Plan:
    """A checked chunk_kda call: its tensors (the gate's parameters None without the gate in the kernel,
    the initial state in the kernel layout), how it runs, and what it returns."""

    inputs: tuple  # (q, k, v, g, beta, A_log, dt_bias, initial_state S^T)
    run: Run
    route: str  # "dense", "prefill" (CUDA inference on packed sequences) or "packed" (through a dense batch)
    layout: PackedLayout | None
    state_v_first: bool
    output_final_state: bool


# --8<-- [start:chunk_kda]
def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None,
              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
              use_gate_in_kernel: bool = False, use_beta_sigmoid_in_kernel: bool = False,
              allow_neg_eigval: bool = False, safe_gate: bool = False, lower_bound: float | None = None,
              disable_recompute: bool = False, return_intermediate_states: bool = False,
              state_v_first: bool = False, cu_seqlens: torch.Tensor | None = None,
              cu_seqlens_cpu: torch.Tensor | None = None, cp_context: object = None, use_graph: bool = False,
              max_num_seqs: int | None = None, *, A_log: torch.Tensor | None = None,
              dt_bias: torch.Tensor | None = None, chunk_size: int = 64,
              transpose_state_layout: bool | None = None, checks: str = "device") -> tuple:
    """KDA forward with autograd, FLA 0.6.0's chunk_kda: its arguments, defaults, rules and messages
    (stages.kda.fla_options), its shapes (see the module's docstring) and its returns: (o (B, T, HV, V)
    in q's dtype, the final states (N, HV, K, V) float32, or None without output_final_state), and with
    return_intermediate_states (under torch.inference_mode) the states at every chunk's start, (B, NT,
    HV, K, V) in q's dtype (B = 1 and NT the chunks of all sequences with cu_seqlens). States are
    (.., V, K) with state_v_first.

    On CUDA q, k and v are fp16 or bf16 and states float32; on the CPU any float dtype, computed in
    float64, and float64 states too (for exact checks). checks (the course's, not FLA's): how the CUDA
    kernels check the values they compute with (finite gates <= 0, beta in its form's range): "device"
    (the default: flagged by the kernels, reported by stages.common.device_checks.raise_if_flagged
    where the caller syncs), "host" (refused before the kernels, a sync per call) or "off".
    """
    if cp_context is not None:
        return context_parallel(q, k, v, g, beta, cp_context, scale, initial_state, output_final_state,
                                use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                                allow_neg_eigval, safe_gate, lower_bound, return_intermediate_states,
                                state_v_first_of(state_v_first, transpose_state_layout), cu_seqlens, A_log, dt_bias,
                                chunk_size, checks)
    plan = plan_chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                          use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                          disable_recompute, return_intermediate_states, state_v_first, cu_seqlens, cu_seqlens_cpu,
                          cp_context, use_graph, max_num_seqs, A_log=A_log, dt_bias=dt_bias, chunk_size=chunk_size,
                          transpose_state_layout=transpose_state_layout, checks=checks)
    if plan.route == "dense":
        o, final_state, states = dense(*plan.inputs, plan.run)
    elif plan.route == "prefill":
        o, final_state, states = *kernel_prefill(*plan.inputs, cu_seqlens, plan.run), None
    else:
        o, final_state, states = packed_through_dense(*plan.inputs, plan.layout, plan.run)
    final_state = to_kernel_layout(final_state, plan.state_v_first).contiguous() if output_final_state else None
    if return_intermediate_states:
        return o, final_state, to_kernel_layout(states, plan.state_v_first).contiguous()
    return o, final_state
# --8<-- [end:chunk_kda]


# --8<-- [start:plan_chunk_kda]
def plan_chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                   use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                   allow_neg_eigval=False, safe_gate=False, lower_bound=None, disable_recompute=False,
                   return_intermediate_states=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                   cp_context=None, use_graph=False, max_num_seqs=None, *, A_log=None, dt_bias=None, chunk_size=64,
                   transpose_state_layout=None, checks="device") -> Plan:
    """chunk_kda's arguments checked, in FLA's order with FLA's messages where FLA has a rule, and the
    call planned: which route runs it and how. Reads no tensor's values (no device sync), except the
    offsets of a packed batch that trains (PackedLayout: cu_seqlens_cpu when given). The FLA backend's
    verifier (stages.kda.fla_backend) runs it too: what it refuses falls back to FLA's kernels."""
    check_chunk_size(chunk_size)  # FLA's first check: before the tensors' dtypes and devices
    state_v_first = state_v_first_of(state_v_first, transpose_state_layout)
    if cp_context is not None:
        raise ValueError("cp_context: the course's split over ranks runs through chunk_kda with stage 8's "
                         "CPContext; FLA's context parallelism (its FLACPContext) stays with FLA's kernels")
    check_tensors({"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state,
                   "A_log": A_log if use_gate_in_kernel else None, "dt_bias": dt_bias if use_gate_in_kernel else None})
    check_packing(q, initial_state, cu_seqlens)
    check_gate_options(use_gate_in_kernel, A_log, lower_bound, safe_gate)
    check_beta_options(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    B, T, H, K, HV, V = check_shapes(q, k, v, g, beta)
    check_state_shape(initial_state, B if cu_seqlens is None else len(cu_seqlens) - 1, HV, K, V, state_v_first)
    if not use_gate_in_kernel:  # FLA drops them: g is the log gate itself
        A_log = dt_bias = None
    check_gate_parameters(A_log, dt_bias, HV, K)
    if checks not in CHECK_MODES:
        raise ValueError(f"checks must be one of {', '.join(map(repr, CHECK_MODES))}, got {checks!r}")
    needs_grad = torch.is_grad_enabled() and any(
        x is not None and x.requires_grad for x in (q, k, v, g, beta, A_log, dt_bias, initial_state))
    check_call_options(return_intermediate_states, disable_recompute, use_graph, max_num_seqs, cu_seqlens, needs_grad)
    if q.is_cuda and needs_grad:  # the chunk the backward's programs fit, checked before the forward runs
        d_k, d_v = padded_length(K, KERNEL_MULTIPLE), padded_length(V, KERNEL_MULTIPLE)
        chunk_size = backward_chunk_size(d_k, d_v, chunk_size)
        check_backward_head_dims(d_k, d_v, chunk_size)
    form = input_form(K, scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                      allow_neg_eigval, lower_bound)
    run = Run(form, chunk_size, checks, disable_recompute, return_intermediate_states)
    inputs = (q, k, v, g, beta, A_log, dt_bias, to_kernel_layout(initial_state, state_v_first))
    if cu_seqlens is None:
        return Plan(inputs, run, "dense", None, state_v_first, output_final_state)
    if q.is_cuda and not needs_grad and not return_intermediate_states:
        return Plan(inputs, run, "prefill", None, state_v_first, output_final_state)
    return Plan(inputs, run, "packed", PackedLayout.of(cu_seqlens, T, cu_seqlens_cpu), state_v_first,
                output_final_state)
# --8<-- [end:plan_chunk_kda]


# --8<-- [start:context_parallel]
def context_parallel(q, k, v, g, beta, cp_context, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                     use_gate_in_kernel, use_beta_sigmoid_in_kernel, allow_neg_eigval, safe_gate, lower_bound,
                     return_intermediate_states, state_v_first, cu_seqlens, A_log, dt_bias, chunk_size, checks):
    """chunk_kda with cp_context (stage 8's, stages.s08_context_parallel.distributed.build_cp_context): this
    rank's part of a packed batch, (1, n, H, K) and so on, the states passed between the ranks by the
    context's own chunk_kda (stage 8 builds on this package, not the other way round). The form
    (FLA's flags) is activated in torch in front of the rank's calls, under autograd, and grouped value
    heads are expanded, so that stage 8's function takes q, k, g and beta as the recurrence does; the
    states (N_seq, HV, K, V) are indexed by the whole batch's sequences (zeros for those that end on
    another rank). FLA's rule: the context's offsets replace cu_seqlens."""
    if not callable(getattr(cp_context, "chunk_kda", None)):
        raise TypeError(f"cp_context must be stage 8's CPContext (stages.s08_context_parallel.distributed."
                        f"build_cp_context), got {type(cp_context).__name__}")
    if cu_seqlens is not None:
        raise ValueError("with cp_context the packed batch's offsets are the context's: pass cu_seqlens to "
                         "build_cp_context, not to chunk_kda")
    if return_intermediate_states or allow_neg_eigval:
        raise ValueError("cp_context takes neither return_intermediate_states nor allow_neg_eigval")
    check_gate_options(use_gate_in_kernel, A_log, lower_bound, safe_gate)
    check_chunk_size(chunk_size)
    check_beta_options(use_beta_sigmoid_in_kernel, allow_neg_eigval)
    form = input_form(q.shape[3], scale, use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel,
                      allow_neg_eigval, lower_bound)
    q, k, g, beta = activate(form, q, k, g, beta, A_log if use_gate_in_kernel else None,
                             dt_bias if use_gate_in_kernel else None)
    q, k = expand_heads(q, v.shape[2]), expand_heads(k, v.shape[2])
    if q.is_cuda:  # the kernels' operands: q and k in v's dtype, g and beta in float32
        q, k = q.to(v.dtype), k.to(v.dtype)
    o, final_state = cp_context.chunk_kda(q, k, v, g, beta, to_kernel_layout(initial_state, state_v_first),
                                         output_final_state, chunk_size, checks)
    return o, None if final_state is None else to_kernel_layout(final_state, state_v_first).contiguous()
# --8<-- [end:context_parallel]


def check_call_options(return_intermediate_states: bool, disable_recompute: bool, use_graph: bool,
                       max_num_seqs: int | None, cu_seqlens: torch.Tensor | None, needs_grad: bool) -> None:
    """FLA's rules on the inference and graph options (FLA asserts them; the course raises with FLA's words),
    and what the course cannot honour."""
    if return_intermediate_states:
        if not torch.is_inference_mode_enabled():
            raise ValueError("return_intermediate_states is only allowed in inference mode")
        if disable_recompute:
            raise ValueError("return_intermediate_states must be used with disable_recompute=False")
    if use_graph and cu_seqlens is not None:
        N_seq = len(cu_seqlens) - 1
        if max_num_seqs is not None and N_seq != max_num_seqs:
            raise ValueError(f"cu_seqlens must be padded with zero-length tail sequences to exactly max_num_seqs + 1 "
                             f"entries, got {N_seq} sequences with max_num_seqs={max_num_seqs}")
        if disable_recompute:
            raise ValueError("use_graph does not support disable_recompute=True")
        if needs_grad:
            raise NotImplementedError("chunk_kda does not support use_graph with autograd on packed sequences: the "
                                      "course trains on them through a dense batch sized on the host, which a graph "
                                      "replay cannot resize (inference, through the packed prefill, is capturable)")


# --8<-- [start:routes]
def dense(q, k, v, g, beta, A_log, dt_bias, initial_state, run: Run):
    """A dense batch, B rows, each a sequence, on its device's path: (o, final state S^T, the chunk states
    with run.intermediate else None), in the kernel layout."""
    return (kernel_dense if q.is_cuda else reference_dense)(q, k, v, g, beta, A_log, dt_bias, initial_state, run)


def packed_through_dense(q, k, v, g, beta, A_log, dt_bias, initial_state, layout: PackedLayout, run: Run):
    """A packed batch (1, T, ...) as a dense one (N_seq, max_len, ...), zeros past each sequence's end
    (stages.kda.packing): (o (1, T, HV, V), final states (N_seq, ...), the chunk states (1, NT, ...) or
    None). A raw gate is activated in front, so that the padding's gate is 0 (no decay)."""
    if run.form.raw_gate:
        wide = torch.float32 if q.is_cuda else torch.float64
        g = activate_gate(run.form, g.to(wide), A_log, dt_bias)
        run, A_log, dt_bias = replace(run, form=replace(run.form, gate="log", lower_bound=None)), None, None
    o, final_state, states = dense(*(layout.scatter(x) for x in (q, k, v, g, beta)), A_log, dt_bias, initial_state,
                                   run)
    if states is not None:  # each sequence's own chunks, one after the other, as FLA counts them
        counts = layout.chunk_counts(run.chunk_size)
        states = torch.cat([states[i, :n] for i, n in enumerate(counts)]).unsqueeze(0)
    return layout.gather(o), final_state, states
# --8<-- [end:routes]


# --8<-- [start:reference_dense]
def reference_dense(q, k, v, g, beta, A_log, dt_bias, initial_state, run: Run):
    """The CPU: the form in float64 torch in front (autograd through it), then ChunkKDAFunction on the
    float64 references. Returns o in q's dtype, the final state in float32 (float64 for float64 inputs
    or states), the chunk states (run.intermediate) in q's dtype."""
    state_dtype = torch.float64 if torch.float64 in (q.dtype, getattr(initial_state, "dtype", None)) else torch.float32
    q64, k64, v64, g64, beta64 = reference_inputs(q, k, v, g, beta, A_log, dt_bias, run.form)
    initial_state64 = None if initial_state is None else initial_state.double()
    o, final_state = ChunkKDAFunction.apply(q64, k64, v64, g64, beta64, None, None, initial_state64, InputForm(),
                                            CPU_CHUNK_SIZE, run.checks, False)
    states = None
    if run.intermediate:
        states = reference_chunk_states(q64, k64, v64, g64, beta64, initial_state64, run.chunk_size).to(q.dtype)
    return o.to(q.dtype), final_state.to(state_dtype), states


def reference_inputs(q, k, v, g, beta, A_log, dt_bias, form: InputForm):
    """(q, k, v, g, beta) in float64 as the references take them: the form computed (`activate`), q and
    k repeated over the value heads, and with beta in (1, 2] (2 sigmoid(x) with allow_neg_eigval, or a
    value FLA's kernels take as it is) the same recurrence with beta / 2 in [0, 1] and k, v times sqrt(2)
    (beta k k^T and beta v k^T are unchanged)."""
    q, k, g, beta = activate(form, q.double(), k.double(), g.double(), beta.double(), A_log, dt_bias)
    HV = v.shape[2]
    q, k, v = expand_heads(q, HV), expand_heads(k, HV), v.double()
    if form.beta_bound == 2.0 or (beta.numel() and beta.max() > 1):  # FLA takes beta up to 2 in either form
        if beta.numel() and not beta.max() <= 2:
            raise ValueError(f"beta must lie in [0, 2] (FLA's range with allow_neg_eigval), got up to {beta.max():.6g}")
        k, v, beta = k * SQRT2, v * SQRT2, beta / 2
    return q, k, v, g, beta


def reference_chunk_states(q, k, v, g, beta, initial_state, chunk_size: int) -> torch.Tensor:
    """S^T at the start of every chunk of chunk_size tokens (B, NT, H, K, V), float64: stage 5's prepare,
    then stage 6's chunk_states (the backward's states kernel, in NumPy)."""
    tensors = forward_reference.prepare(*(_numpy(x) for x in (q, k, v, g, beta)), chunk_size, sub_block=1)
    states = backward_reference.chunk_states(tensors, v.shape[3], _numpy_or_none(initial_state)).states
    return torch.from_numpy(states)
# --8<-- [end:reference_dense]


# --8<-- [start:kernel_dense]
def kernel_dense(q, k, v, g, beta, A_log, dt_bias, initial_state, run: Run):
    """CUDA: the kernels, on head dims padded to a multiple of 32 and cut back (see stages.kda.packing)."""
    K, V = q.shape[3], v.shape[3]
    operands = kernel_operands(q, k, v, g, beta, A_log, dt_bias, initial_state, run.form)
    if run.intermediate:  # inference only: the forward's prepare outputs feed the backward's states kernel
        o, final_state, states = kernel_forward_with_states(*operands, run)
        return o[..., :V], final_state[..., :K, :V], states[..., :K, :V]
    o, final_state = ChunkKDAFunction.apply(*operands, run.form, run.chunk_size, run.checks, run.keep_prepared)
    return o[..., :V], final_state[..., :K, :V], None


def kernel_prefill(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, run: Run):
    """CUDA inference on a packed batch: stage 7's prefill, the form computed as it loads the tokens.
    Returns (o (1, T, HV, V), final states (N_seq, HV, K, V))."""
    K, V, HV, N_seq = q.shape[3], v.shape[3], v.shape[2], len(cu_seqlens) - 1
    q, k, v, g, beta, A_log, dt_bias, initial_state = kernel_operands(q, k, v, g, beta, A_log, dt_bias, initial_state,
                                                                      run.form)
    config = resolve_for(q.device, N_seq, HV, q.shape[3], v.shape[3], chunk_size=run.chunk_size)
    o, final_state = prefill(q, k, v, g, beta, cu_seqlens, initial_state, True, run.checks, config, form=run.form,
                             A_log=A_log, dt_bias=dt_bias)
    return o[..., :V], final_state[..., :K, :V]


def kernel_operands(q, k, v, g, beta, A_log, dt_bias, initial_state, form: InputForm):
    """The kernels' operands: K and V zero-padded to multiples of 32 (q, k, g, dt_bias, v, the state),
    A_log and dt_bias in float32, every tensor contiguous; g and beta in float32, unless the form
    activates them in the kernels, which read them in q's dtype as the model passes them (no cast in
    front)."""
    K, V, HV = q.shape[3], v.shape[3], v.shape[2]
    d_k, d_v = padded_length(K, KERNEL_MULTIPLE), padded_length(V, KERNEL_MULTIPLE)
    q, k, g = (pad_channels(x, d_k) for x in (q, k, g))
    v = pad_channels(v, d_v)
    if dt_bias is not None:
        dt_bias = pad_channels(dt_bias.reshape(HV, K), d_k).reshape(HV * d_k).float()
    if initial_state is not None:
        initial_state = pad_state(initial_state, d_k, d_v)
    A_log = None if A_log is None else A_log.reshape(HV).float()
    g = g if form.raw_gate and g.dtype in (q.dtype, torch.float32) else g.float()
    beta = beta if form.beta != "value" and beta.dtype in (q.dtype, torch.float32) else beta.float()
    operands = (q, k, v, g, beta, A_log, dt_bias, initial_state)
    return tuple(None if x is None else x.contiguous() for x in operands)


def kernel_forward_with_states(q, k, v, g, beta, A_log, dt_bias, initial_state, run: Run):
    """The forward's kernels keeping the prepare's outputs, then the backward's states kernel on them:
    (o, final state, S^T at every chunk's start (B, NT, HV, d_k, d_v) in q's dtype)."""
    from stages.common.torch_checks import dtype_name
    from stages.kda.backward import kernel_arguments
    from stages.kda.calls import zero_state
    from stages.kda.compiled import compiled_backward_kernel

    B, _, _, d_k = q.shape
    HV, d_v = v.shape[2:]
    config = resolve_for(q.device, B, HV, d_k, d_v, chunk_size=run.chunk_size)
    o, final_state, prepared = forward_and_prepared(q, k, v, g, beta, initial_state, run.checks, config, True,
                                                    form=run.form, A_log=A_log, dt_bias=dt_bias)
    w, u, _, k_to_chunk_end, _, chunk_decay = prepared[:6]
    arguments = kernel_arguments(B, w.shape[1], HV, d_k, d_v, config.chunk_size, config.block_dv, dtype_name(q))
    states_kernel = compiled_backward_kernel("states", *arguments["states"])
    start = zero_state(B, HV, d_k, d_v, q.device) if initial_state is None else initial_state
    states, _ = states_kernel(w, u, k_to_chunk_end, chunk_decay, start)  # one per chunk of the padded tokens
    return o, final_state, states
# --8<-- [end:kernel_dense]


# --8<-- [start:function]
class ChunkKDAFunction(torch.autograd.Function):
    """(q, k, v, g, beta, A_log, dt_bias, initial_state, form, chunk_size, checks, keep_prepared) ->
    (o, final_state), and the way back.

    CUDA: the kernels compute `form` from the tensors as they load them, and the backward returns the
    gradients of those tensors (the raw gate's, A_log's, dt_bias's, beta's logits'). CPU: float64
    tensors in the plain form (reference_dense computes the form in front), A_log and dt_bias None.
    The final state is always an output, so that a loss on it sends its gradient dS_T^T into the
    backward; when nobody uses it, that gradient is None and the backward starts from zero.
    keep_prepared (CUDA): the forward's prepare outputs are saved beside the inputs, for the backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, A_log, dt_bias, initial_state, form, chunk_size, checks, keep_prepared):
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not as zeros
        ctx.form, ctx.chunk_size = form, chunk_size
        ctx.input_dtypes = [None if x is None else x.dtype for x in (q, k, v, g, beta, A_log, dt_bias, initial_state)]
        prepared = None
        if q.is_cuda:
            o, final_state, prepared = _cuda_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, form,
                                                     chunk_size, checks, keep_prepared)
        else:
            o, final_state = _cpu_forward(q, k, v, g, beta, initial_state, chunk_size)
        ctx.save_for_backward(q, k, v, g, beta, A_log, dt_bias, initial_state, *(prepared or ()))
        return o, final_state

    @staticmethod
    def backward(ctx, do, d_final_state):
        q, k, v, g, beta, A_log, dt_bias, initial_state, *prepared = ctx.saved_tensors
        if do is None:  # only the final state reached the loss
            do = torch.zeros(*q.shape[:2], *v.shape[2:], dtype=v.dtype, device=v.device)
        if q.is_cuda:
            gradients = _cuda_backward(q, k, v, g, beta, A_log, dt_bias, do, initial_state, d_final_state, ctx.form,
                                       ctx.chunk_size, prepared or None)
        else:
            gradients = _cpu_backward(q, k, v, g, beta, do, initial_state, d_final_state, ctx.chunk_size)
        gradients = [None if dtype is None or grad is None else grad.to(dtype)
                     for grad, dtype in zip(gradients, ctx.input_dtypes)]
        return *gradients, None, None, None, None
# --8<-- [end:function]


# --8<-- [start:cpu_path]
def _cpu_forward(q, k, v, g, beta, initial_state, chunk_size):
    """Stage 5's forward in NumPy float64 (prepare, then recurrence: the kernels' control flow).

    sub_block=1: each key is a slab of its own, anchored at the row below it, so every factor of
    the scores is at most 1 and any gate <= 0 runs. A sub-block of the whole chunk, anchored at its
    middle row, overflowed float64 (NaN) where half a chunk's gates summed below -709: Kimi Linear's
    unbounded gate does that (-100 a token at C = 16)."""
    tensors = forward_reference.prepare(*(_numpy(x) for x in (q, k, v, g, beta)), chunk_size, sub_block=1)
    o, final_state = forward_reference.recurrence(tensors, block_dv=v.shape[3],
                                                  initial_state=_numpy_or_none(initial_state))
    return torch.from_numpy(o[:, :q.shape[1]].copy()), torch.from_numpy(final_state)  # prepare pads T to chunks


def _cpu_backward(q, k, v, g, beta, do, initial_state, d_final_state, chunk_size):
    """Stage 6's reference B in NumPy float64: the chunks in reverse, each recomputed from its start state.
    (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dS_0^T) in float64, dS_0^T None without an initial state
    and the gate's parameters None (their gradients are taken in front, by autograd)."""
    result = backward_reference.chunkwise_backward(
        *(_numpy(x) for x in (q, k, v, g, beta, do)), chunk_size,
        initial_state=_numpy_or_none(initial_state), d_final_state=_numpy_or_none(d_final_state))
    gradients = (result.dq, result.dk, result.dv, result.dg, result.dbeta)
    d_initial_state = None if initial_state is None else torch.from_numpy(result.d_initial_state.copy())
    return *(torch.from_numpy(np.ascontiguousarray(grad)) for grad in gradients), None, None, d_initial_state
# --8<-- [end:cpu_path]


# --8<-- [start:cuda_path]
def _cuda_forward(q, k, v, g, beta, A_log, dt_bias, initial_state, form, chunk_size, checks, keep_prepared=False):
    """The forward's two kernels: (o, final state fp32, the prepare's outputs with keep_prepared, else None)."""
    config = resolve_for(q.device, q.shape[0], v.shape[2], q.shape[3], v.shape[3], chunk_size=chunk_size)
    return forward_and_prepared(q, k, v, g, beta, initial_state, checks, config, keep_prepared, form=form,
                                A_log=A_log, dt_bias=dt_bias)


def _cuda_backward(q, k, v, g, beta, A_log, dt_bias, do, initial_state, d_final_state, form, chunk_size,
                   prepared=None):
    """Stage 6's backward kernels: (dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dS_0^T), dS_0^T None without
    an initial state; prepared: the forward's prepare outputs, kept (disable_recompute), or None. The
    values were checked by the forward (checks), so the backward skips that pass and its device sync."""
    config = resolve_for(q.device, q.shape[0], v.shape[2], q.shape[3], v.shape[3], chunk_size=chunk_size)
    if d_final_state is not None:
        d_final_state = d_final_state.float().contiguous()
    gradients = backward(q, k, v, g, beta, do.contiguous(), initial_state=initial_state, d_final_state=d_final_state,
                         checks="off", config=config, prepared=prepared, form=form, A_log=A_log, dt_bias=dt_bias)
    return (gradients.dq, gradients.dk, gradients.dv, gradients.dg, gradients.dbeta, gradients.dA_log,
            gradients.ddt_bias, None if initial_state is None else gradients.d_initial_state)
# --8<-- [end:cuda_path]


def _numpy(x):
    return x.detach().to("cpu", torch.float64).contiguous().numpy()


def _numpy_or_none(x):
    return None if x is None else _numpy(x)
