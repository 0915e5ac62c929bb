"""The fast path's public calls, on CUDA tensors, each with one return convention:

    forward(q, k, v, g, beta, ...)                 -> (o, final_state or None)     the two forward kernels
    backward(q, k, v, g, beta, do, ...)            -> (dq, dk, dv, dg, dbeta, d_initial_state)
    prefill(q, k, v, g, beta, cu_seqlens, ...)     -> (o, final_states or None)   a packed batch
    decode(q, k, v, g, beta, state_pool, slots)    -> (o, state_pool)              one token, the pool in place

Tensors are (B, N, H, D) (decode: (B, H, D)); q, k, v in fp16 or bf16, g and beta in fp32, states S^T
(d_k x d_v, the kernel layout) in fp32. H counts the value heads: q and k may have fewer, H_qk, with H
a multiple of it (FLA's grouped value heads: value head h reads q's and k's head h // (H / H_qk)).

Every call takes the tensors as a model hands them too: `form` (stages.kda.inputs.InputForm) says what
the kernels compute from q, k, g and beta as they load them (the q/k norms and q's scale, the gate from
the raw projection with A_log (H,) and dt_bias (H * d_k,) fp32, beta's sigmoid), so that no pass runs
in front of the kernels; g and beta may then come in q's dtype. The sizes each call runs with are one KernelConfig
(stages.kda.config.resolve: from the shape and the GPU where not given). Shapes, dtypes and devices
are checked on the host (stages.kda.checks); g's and beta's values by `checks`: "device" (the
default) leaves them to the kernels, which flag a bad one as they load it (stages.common.device_checks:
`raise_if_flagged(q.device)` reports it where the caller synchronizes anyway), so a call has no host
sync and can be captured in a CUDA graph; "host" reads them to the host first and raises before any
kernel runs (a pass and a device sync: the mode to debug a caller with); "off": the caller vouches
for them, and the kernels run without the flags.
"""

import functools
from typing import TYPE_CHECKING

from typing import NamedTuple

from stages.common.checks import padded_length
from stages.common.device_checks import BAD_CU_SEQLENS, flags_for
from stages.common.torch_checks import dtype_name, pad_tokens
from stages.kda.checks import (check_backward_inputs, check_decode_inputs, check_forward_inputs, check_prefill_inputs,
                               check_prepared)
from stages.kda.compiled import (compiled_activation, compiled_backward_kernels, compiled_decode,
                                 compiled_prefill_kernels, compiled_prepare, compiled_recurrence)
from stages.kda.config import KernelConfig, backward_chunk_size, decode_block_dv, most_chunks, resolve_for
from stages.kda.inputs import InputForm

PLAIN = InputForm()  # q, k, g and beta as the recurrence takes them

if TYPE_CHECKING:
    import torch


# --8<-- [start:forward]
def forward(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
            initial_state: "torch.Tensor | None" = None, output_final_state: bool = False, checks: str = "device",
            config: KernelConfig | None = None, form: InputForm = PLAIN, A_log: "torch.Tensor | None" = None,
            dt_bias: "torch.Tensor | None" = None) -> "tuple[torch.Tensor, torch.Tensor | None]":
    """Both kernels on q, k: (B, N, H_qk, d_k), v: (B, N, H, d_v) (fp16 or bf16), g: (B, N, H, d_k) fp32
    log gates (<= 0), beta: (B, N, H) fp32 in [0, 1]; initial_state: S_0^T (B, H, d_k, d_v) fp32 or
    None (zeros). Returns (o (B, N, H, d_v) in the input dtype, the final state S^T (B, H, d_k, d_v) fp32
    if output_final_state else None). N need not be a multiple of the chunk size: the sequence is
    zero-padded, which is exact (see stages.s05_fast_kda.reference.kernel_mirror). config=None resolves
    the sizes for this shape and GPU. form, A_log, dt_bias: the tensors as a model passes them (the
    module's docstring); the prepare kernel then reads the N tokens as they are, no copy padded.
    """
    o, final_state, _ = forward_and_prepared(q, k, v, g, beta, initial_state, checks, config, keep_prepared=False,
                                             form=form, A_log=A_log, dt_bias=dt_bias)
    return o, final_state if output_final_state else None


def forward_and_prepared(q, k, v, g, beta, initial_state=None, checks="device", config=None, keep_prepared=True,
                         form=PLAIN, A_log=None, dt_bias=None):
    """`forward`, returning (o, final state, prepared): with keep_prepared, the prepare kernel's eight
    outputs with solve_outputs (W, U, Q e^gamma, K e^{gamma_C - gamma}, A_qk, e^{gamma_C}, A_kk, T, on the
    tokens padded to a multiple of the chunk size), which the backward would otherwise compute again
    (chunk_kda's disable_recompute); else None. The recurrence reads the first six."""
    B, N, H, d_k, d_v = check_forward_inputs(q, k, v, g, beta, initial_state, config, checks, form, A_log, dt_bias)
    # kept for the backward: its chunk, the one its kernels run at
    chunk_size = backward_chunk_size(d_k, d_v) if keep_prepared else None
    config = config or resolve_for(q.device, B, H, d_k, d_v, chunk_size=chunk_size)
    if initial_state is None:
        initial_state = zero_state(B, H, d_k, d_v, q.device)
    # solve_outputs only when asked: the other calls share the cache entry (and compile) of the benchmarks'
    prepared = prepare_chunks(q, k, v, g, beta, checks, config, keep_prepared, form, A_log, dt_bias)
    recurrence = compiled_recurrence(B, padded_length(N, config.chunk_size), H, d_k, d_v, config.chunk_size,
                                     config.block_dv, dtype_name(q), config.num_stages, config.threads,
                                     config.programs_per_sm)
    o, final_state = recurrence(*prepared[:6], initial_state)
    return o[:, :N], final_state, prepared if keep_prepared else None


def prepare_chunks(q, k, v, g, beta, checks, config, solve_outputs, form=PLAIN, A_log=None, dt_bias=None):
    """The prepare kernel on the tensors as the caller gave them (`form`), at config's chunk size, the
    tokens padded to a multiple of it: the six outputs the recurrence reads, and with solve_outputs A_kk
    and T after them (the backward's). checks="device": the kernel that flags bad values."""
    B, N, H, d_k, d_v = v.shape[0], v.shape[1], v.shape[2], q.shape[3], v.shape[3]
    C = config.chunk_size
    N_padded = padded_length(N, C)
    if form.is_plain:
        q, k, v, g, beta = pad_tokens(N_padded, q, k, v, g, beta)
    value_flags = checks == "device"
    prepare = compiled_prepare(B, N_padded, H, d_k, d_v, C, dtype_name(q), config.prepare_threads, value_flags,
                               solve_outputs, **form_options(form, q, g, beta, tokens=N),
                               channel_passes=config.channel_passes)
    flags = (flags_for(q.device),) if value_flags else ()
    return prepare(q, k, v, g, beta, *gate_parameters(form, A_log, dt_bias, H, d_k, q.device), *flags)


def form_options(form, q, g, beta, tokens=None):
    """The prepare's (and decode's) build options for the tensors as given in `form`: {} for the plain
    form (its programs stay as they were), else the form, the grouped heads, g's and beta's dtypes and
    (a dense batch, tokens) the token count the kernel reads unpadded."""
    if form.is_plain and q.shape[-2] == g.shape[-2]:
        return {}
    options = {"form": form, "group": g.shape[-2] // q.shape[-2], "gate_dtype": dtype_name(g),
               "beta_dtype": dtype_name(beta)}
    return options if tokens is None or form.is_plain else {**options, "tokens": tokens}


def gate_parameters(form, A_log, dt_bias, H, d_k, device):
    """(A_log (H,), dt_bias (H, d_k)) fp32 for a raw gate, zeros for one not given (exp(0) = 1 and
    x + 0 = x: exact), else ()."""
    if not form.raw_gate:
        return ()
    A_log = zeros((H,), device) if A_log is None else A_log
    dt_bias = zeros((H, d_k), device) if dt_bias is None else dt_bias.view(H, d_k)
    return A_log, dt_bias
# --8<-- [end:forward]


class Gradients(NamedTuple):
    """`backward`'s gradients: of q, k, v, g, beta and the initial state, and of A_log and dt_bias (None
    unless the form takes a raw gate and the caller gave them). dg and dbeta are of g and beta as the
    caller gave them: the raw gate and the logits where the form activates them."""

    dq: "torch.Tensor"
    dk: "torch.Tensor"
    dv: "torch.Tensor"
    dg: "torch.Tensor"
    dbeta: "torch.Tensor"
    d_initial_state: "torch.Tensor"
    dA_log: "torch.Tensor | None" = None
    ddt_bias: "torch.Tensor | None" = None


# --8<-- [start:backward]
def backward(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
             do: "torch.Tensor", initial_state: "torch.Tensor | None" = None,
             d_final_state: "torch.Tensor | None" = None, checks: str = "device", config: KernelConfig | None = None,
             prepared: "tuple[torch.Tensor, ...] | None" = None, form: InputForm = PLAIN,
             A_log: "torch.Tensor | None" = None, dt_bias: "torch.Tensor | None" = None) -> Gradients:
    """The gradients of KDA's output (and final state), on `forward`'s inputs: do = dLoss/do (B, N, H, d_v)
    in q's dtype; initial_state S_0^T and d_final_state = dLoss/dS_N^T: (B, H, d_k, d_v) fp32 or None
    (zeros).

    Returns Gradients(dq, dk, dv, dg, dbeta, d_initial_state, dA_log, ddt_bias): dv (B, N, H, d_v) in q's
    dtype; dq, dk (B, N, H_qk, d_k), dg (B, N, H, d_k), dbeta (B, N, H) and dS_0^T (B, H, d_k, d_v) in
    fp32 (dS_0^T computed even when initial_state is None: it is then the gradient of a zero initial
    state). dq and dk stay in fp32, as FLA's chunk_kda_bwd hands them back, so that the caller rounds
    them once, after its own backward in front of the kernels; with a form other than the plain one the
    activation's gradients are that backward, and dq, dk (unless a group sums them), dg and dbeta come
    rounded once, to their inputs' dtypes. config: as the forward's (the two chunk loops, states and
    state_gradient, take its block_dv). checks: "device" recomputes the forward's prepare with the
    kernel that flags a bad g or beta, "host" reads them first, "off" checks nothing (`chunk_kda`'s
    backward: its forward checked the same g and beta). prepared: the forward's prepare
    outputs for these inputs (`forward_and_prepared`), kept by the caller so that the backward skips
    computing them again: the same numbers, one launch fewer, and the memory of eight tensors held from
    the forward to the backward (chunk_kda's disable_recompute).

    form, A_log, dt_bias: the tensors as a model passes them. Two elementwise kernels stand around the
    backward's (stages.kda.activation): `activate` makes q, k, g and beta the recurrence's own (the
    norms, the gate, the sigmoid, as the forward's prepare computes them on chip; q and k per value
    head), the backward kernels run on those, and `activation_gradients` takes their gradients back to
    the raw tensors by each transform's chain rule; torch sums what the kernel leaves per row (dA_log's
    terms) and per block of rows (ddt_bias's), and over a q/k head's group. The prepare's outputs are
    the forward's own, from the form's program on the raw tensors (kept, or made again by the same
    program): the backward differentiates the numbers the forward computed, and a kept prepare gives
    the same bits as a recomputed one.
    """
    B, N, H, d_k, d_v = check_backward_inputs(q, k, v, g, beta, do, initial_state, d_final_state, config, checks,
                                              form, A_log, dt_bias)
    if form.is_plain and q.shape[2] == H:
        return Gradients(*activated_backward(q, k, v, g, beta, do, initial_state, d_final_state, checks, config,
                                             prepared))
    group = H // q.shape[2]
    options = form_options(form, q, g, beta)
    activate, activation_gradients = compiled_activation(B, N, H, d_k, dtype_name(q), form, group,
                                                         options["gate_dtype"], options["beta_dtype"])
    parameters = gate_parameters(form, A_log, dt_bias, H, d_k, q.device)
    q_a, k_a, g_a, beta_a = activate(q, k, g, beta, *parameters)  # the recurrence's own, per value head
    config = config or resolve_for(q.device, B, H, d_k, d_v, chunk_size=backward_chunk_size(d_k, d_v))
    if prepared is None:  # the forward's own prepare (the form computed as it loads, bad raw values flagged):
        # the backward differentiates the numbers the forward computed, as when the caller kept them
        prepared = prepare_chunks(q, k, v, g, beta, checks, config, True, form, A_log, dt_bias)
    dq_a, dk_a, dv, dg_a, dbeta_a, d_initial_state = activated_backward(q_a, k_a, v, g_a, beta_a, do, initial_state,
                                                                        d_final_state, "off", config, prepared)
    dq, dk, dg, dbeta, dA, *dt_bias_blocks = activation_gradients(q, k, g, beta, *parameters, dq_a.contiguous(),
                                                                  dk_a.contiguous(), dg_a.contiguous(),
                                                                  dbeta_a.contiguous())
    if group > 1:  # a q/k head serves its group of value heads: its gradient is theirs summed (in fp32)
        dq, dk = (x.view(B, N, H // group, group, d_k).sum(3) for x in (dq, dk))
    dA_log = None if A_log is None else dA.sum((0, 1)).view(A_log.shape)
    # d(x + dt_bias) = dx: the kernel's sums of dx over each block of tokens, in fp32, summed
    ddt_bias = None if dt_bias is None else dt_bias_blocks[0].sum((0, 1)).view(dt_bias.shape)
    return Gradients(dq, dk, dv, dg, dbeta, d_initial_state, dA_log, ddt_bias)


def activated_backward(q, k, v, g, beta, do, initial_state, d_final_state, checks, config, prepared):
    """The backward kernels on q, k, g and beta as the recurrence takes them (`backward`'s plain form);
    returns (dq, dk, dv, dg, dbeta, d_initial_state)."""
    B, N, H, d_k, d_v = v.shape[0], v.shape[1], v.shape[2], q.shape[3], v.shape[3]
    config = config or resolve_for(q.device, B, H, d_k, d_v, chunk_size=backward_chunk_size(d_k, d_v))
    C = config.chunk_size
    N_padded = padded_length(N, C)
    check_prepared(prepared, (B, N_padded, H, d_k))
    q, k, v, g, beta, do = pad_tokens(N_padded, q, k, v, g, beta, do)
    initial_state = zero_state(B, H, d_k, d_v, q.device) if initial_state is None else initial_state
    d_final_state = zero_state(B, H, d_k, d_v, q.device) if d_final_state is None else d_final_state
    value_flags = checks == "device"  # the forward's prepare again: the one that flags bad values
    kernels = compiled_backward_kernels(B, N_padded, H, d_k, d_v, C, config.block_dv, dtype_name(q),
                                        value_flags=value_flags)
    flags = (flags_for(q.device),) if value_flags else ()
    dq, dk, dv, dg, dbeta, d_initial_state = run_kernels(kernels, q, k, v, g, beta, do, initial_state, d_final_state,
                                                         flags, prepared)
    return dq[:, :N], dk[:, :N], dv[:, :N], dg[:, :N], dbeta[:, :N], d_initial_state
# --8<-- [end:backward]


# --8<-- [start:run_kernels]
def run_kernels(kernels, q, k, v, g, beta, do, initial_state, d_final_state, flags=(), prepared=None):
    """The five launches of the backward, in order, on inputs already padded to a multiple of chunk_size;
    flags: (Flags,) for a prepare that flags bad values, else (); prepared: the forward's prepare
    outputs for these inputs (stage 5's forward, return_prepared=True: the eight of solve_outputs),
    which skip the first launch.

    kernels: {name: callable} for the names of BUILDERS, made for these inputs' shape (kernel_arguments):
    compiled for the GPU (`backward`), or run by the tile interpreter on a CPU (the tests), so the
    wiring below is the same in both. Returns (dq, dk, dv, dg, dbeta, dS_0^T).
    """
    if prepared is None:
        prepared = kernels["prepare"](q, k, v, g, beta, *flags)
    w, u, q_decayed, k_to_chunk_end, a_qk, chunk_decay, a_kk, inverse = prepared
    states, v_new = kernels["states"](w, u, k_to_chunk_end, chunk_decay, initial_state)
    d_states, dv_new, d_initial_state = kernels["state_gradient"](
        q_decayed, k_to_chunk_end, w, a_qk, chunk_decay, do, d_final_state)
    dq_decayed, dk_to_chunk_end, dw, d_gamma_last = kernels["state_products"](
        states, d_states, v_new, dv_new, do, chunk_decay)
    dq, dk, dv, dg, dbeta = kernels["intra"](
        q, k, v, g, beta, a_kk, inverse, do, v_new, dv_new, dq_decayed, dk_to_chunk_end, dw, d_gamma_last)
    return dq, dk, dv, dg, dbeta, d_initial_state
# --8<-- [end:run_kernels]


# --8<-- [start:prefill]
def prefill(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
            cu_seqlens: "torch.Tensor | None" = None, initial_state: "torch.Tensor | None" = None,
            output_final_state: bool = False, checks: str = "device", config: KernelConfig | None = None,
            form: InputForm = PLAIN, A_log: "torch.Tensor | None" = None,
            dt_bias: "torch.Tensor | None" = None) -> "tuple[torch.Tensor, torch.Tensor | None]":
    """The forward pass of a batch of sequences, each from its own state, in FLA's conventions (form,
    A_log, dt_bias and grouped value heads as in `forward`).

    q, k: (B, T, H, d_k), v: (B, T, H, d_v) in fp16 or bf16; g: (B, T, H, d_k) fp32 log gates (<= 0);
    beta: (B, T, H) fp32 in [0, 1]. With cu_seqlens (int32 or int64, (N_seq + 1,)) the batch is
    packed, B = 1, and sequence i is tokens cu_seqlens[i] to cu_seqlens[i + 1] - 1; without it each
    of the B rows is a sequence (`forward`). initial_state: S_0^T (N_seq, H, d_k, d_v) fp32 or None
    (zeros). Returns (o (B, T, H, d_v) in the input dtype, the final states S^T (N_seq, H, d_k, d_v) fp32
    if output_final_state else None). config=None resolves the sizes for N_seq sequences. checks: as
    `forward`'s; with "device" the index's ops also flag cu_seqlens out of order.

    With cu_seqlens: the packed prepare reads each chunk of each sequence straight from the packed
    tensors (zeros past the sequence's end) and writes the chunk-aligned layout, the packed recurrence
    walks each sequence's chunks from its own state and writes o to the packed rows. Two kernel
    launches per call, whatever the lengths, one compiled pair of kernels for every batch, no copy of
    the tokens, and no host sync: the chunk table is built on the device (`varlen_index`), sized by
    the most chunks T tokens in N_seq sequences can need, so that the call can be captured in a CUDA
    graph like `forward`.
    """
    if cu_seqlens is None:
        return forward(q, k, v, g, beta, initial_state, output_final_state, checks, config, form, A_log, dt_bias)
    check_prefill_inputs(q, k, v, g, beta, cu_seqlens, initial_state, config, checks, form, A_log, dt_bias)
    T, H, d_k, d_v, N_seq = q.shape[1], v.shape[2], q.shape[3], v.shape[3], cu_seqlens.numel() - 1
    config = config or resolve_for(q.device, N_seq, H, d_k, d_v)
    if initial_state is None:
        initial_state = zero_state(N_seq, H, d_k, d_v, q.device)

    flags = flags_for(q.device) if checks == "device" else None
    index = varlen_index(cu_seqlens, T, config.chunk_size, flags)
    kernels = compiled_prefill_kernels(H, d_k, d_v, config.chunk_size, config.block_dv, dtype_name(q),
                                       config.num_stages, flags is not None, config.programs_per_sm,
                                       **form_options(form, q, g, beta), channel_passes=config.channel_passes)
    o, final_state = varlen_forward(q, k, v, g, beta, index, initial_state, config.chunk_size, kernels, flags,
                                    gate_parameters(form, A_log, dt_bias, H, d_k, q.device))
    return o, final_state if output_final_state else None
# --8<-- [end:prefill]


# --8<-- [start:varlen_forward]
def varlen_index(cu_seqlens: "torch.Tensor", T: int, chunk_size: int,
                 flags: "torch.Tensor | None" = None) -> "torch.Tensor":
    """The kernels' whole index of a packed batch of T tokens, one int32 tensor built by device ops
    on cu_seqlens's device, with no host sync: cu_seqlens (N_seq + 1), chunk_offsets (N_seq + 1),
    then the chunk table's rows (sequence, chunk in the sequence), 2 * most_chunks(T, N_seq, C)
    entries, as reference.chunk_table's for the batch's own chunks; the rows past them carry the
    last sequence and chunks past its end (the prepare runs them on zeros: at most N_seq programs more
    than the batch's chunks need).

    Offsets out of order are read as the nearest ordered ones inside [0, T] (clamped, then a running
    maximum), so that no kernel reads outside the batch whatever cu_seqlens holds; with `flags`
    (the device's value flags) such offsets, and a first offset above 0 or a last below T, set
    Flags[BAD_CU_SEQLENS]."""
    import torch

    C, N_seq = chunk_size, cu_seqlens.numel() - 1
    offsets = torch.cummax(cu_seqlens.long().clamp(0, T), dim=0).values
    if flags is not None:
        out_of_order = (offsets != cu_seqlens).any() | (offsets[0] != 0) | (offsets[-1] != T)
        flag = flags[BAD_CU_SEQLENS:BAD_CU_SEQLENS + 1]
        flag.copy_(torch.maximum(flag, out_of_order.to(torch.int32)))
    chunk_counts = (offsets[1:] - offsets[:-1] + C - 1) // C  # ceil(n / C) chunks of a sequence of n tokens
    chunk_offsets = torch.nn.functional.pad(torch.cumsum(chunk_counts, dim=0), (1, 0))
    row = torch.arange(most_chunks(T, N_seq, C), device=cu_seqlens.device)
    # row p's sequence: the last whose chunks start at or before p (past the batch's chunks: the last)
    sequence = torch.searchsorted(chunk_offsets[1:], row, right=True).clamp(max=N_seq - 1)
    chunks = torch.stack([sequence, row - chunk_offsets[sequence]], dim=1)
    return torch.cat([offsets, chunk_offsets, chunks.ravel()]).to(torch.int32)


def varlen_forward(q, k, v, g, beta, index, initial_state, chunk_size, kernels, flags=None, gate_parameters=()):
    """kernels = (packed prepare, packed recurrence: compiled.compiled_prefill_kernels) on the packed
    batch (1, T, ...) as the caller gave it; index: `varlen_index` on the inputs' device; flags: the Flags tensor a prepare built with
    value_flags takes, None for one built without; gate_parameters: (A_log, dt_bias) for a prepare
    that takes a raw gate, else (): the kernels' outputs allocated (the chunk-aligned ones for
    most_chunks), their two launches (no host sync). Returns (o (1, T, H, d_v), final states
    (N_seq, H, d_k, d_v) fp32)."""
    import torch

    prepare, recurrence = kernels
    (_, T, H, d_v), d_k, N_seq = v.shape, q.shape[3], initial_state.shape[0]
    if T == 0:  # every sequence empty: nothing to launch, the states stay
        return torch.empty_like(v), initial_state.clone()
    n_chunks = most_chunks(T, N_seq, chunk_size)  # the table's rows: the batch's chunks, then zero chunks
    cu_seqlens, chunk_offsets, chunks = index[:N_seq + 1], index[N_seq + 1:2 * N_seq + 2], index[2 * N_seq + 2:]
    T_padded = n_chunks * chunk_size

    def empty(*shape, dtype=q.dtype):
        return torch.empty(shape, dtype=dtype, device=q.device)

    # W, U, Q e^gamma, K e^{gamma_C - gamma}, A_qk, e^{gamma_C}: the prepare kernel's outputs in order
    prepared = (empty(1, T_padded, H, d_k), empty(1, T_padded, H, d_v), empty(1, T_padded, H, d_k),
                empty(1, T_padded, H, d_k), empty(1, T_padded, H, chunk_size),
                empty(1, n_chunks, H, d_k, dtype=torch.float32))
    value_flags = () if flags is None else (flags,)
    prepare(q, k, v, g, beta, *gate_parameters, chunks.view(n_chunks, 2), cu_seqlens, *value_flags, *prepared)
    o, final_state = empty(1, T, H, d_v), torch.empty_like(initial_state)
    recurrence(*prepared, initial_state, chunk_offsets, cu_seqlens, o, final_state)
    return o, final_state
# --8<-- [end:varlen_forward]


# --8<-- [start:decode]
def decode(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
           state_pool: "torch.Tensor", slots: "torch.Tensor", checks: str = "device",
           config: KernelConfig | None = None, form: InputForm = PLAIN, A_log: "torch.Tensor | None" = None,
           dt_bias: "torch.Tensor | None" = None) -> "tuple[torch.Tensor, torch.Tensor]":
    """One decode step: q, k (B, H_qk, d_k), v (B, H, d_v) in fp16, bf16 or fp32 (checks.DECODE_DTYPES);
    g (B, H, d_k) fp32 log gates (<= 0); beta (B, H) fp32 in [0, 1] (or as a model passes them: form,
    A_log, dt_bias, as `forward`'s); state_pool (P, H, d_k, d_v) fp32, S^T in the kernel layout; slots
    (B,) int32, distinct, in [0, P).

    Returns (o (B, H, d_v) in the input dtype, state_pool): state_pool[slots] is advanced by one token
    in place and every other slot is left as it was. config: its block_dv and threads (None:
    decode_block_dv(d_v), 128 threads). checks="device" (the default): the kernel flags a bad g, beta
    or slot as it reads them and never writes through a slot outside the pool; "host" also reads them
    to the host first and raises before the kernel runs (two device syncs; it also catches two equal
    slots, which make two programs write one state); "off": the kernel runs without the flags (a slot
    outside the pool still writes nothing).
    """
    B, H, d_k, d_v = check_decode_inputs(q, k, v, g, beta, state_pool, slots, config, checks, form, A_log, dt_bias)
    config = config or KernelConfig(block_dv=decode_block_dv(d_v))
    value_flags = checks == "device"
    kernel = compiled_decode(B, state_pool.shape[0], H, d_k, d_v, config.block_dv, dtype_name(q), config.threads,
                             value_flags, **form_options(form, q, g, beta))
    flags = (flags_for(q.device),) if value_flags else ()
    parameters = gate_parameters(form, A_log, dt_bias, H, d_k, q.device)
    return kernel(q, k, v, g, beta, *parameters, slots, state_pool, *flags), state_pool
# --8<-- [end:decode]


def zero_state(B: int, H: int, d_k: int, d_v: int, device: "torch.device") -> "torch.Tensor":
    """S_0^T = 0 (B, H, d_k, d_v) fp32 on `device` (zeros)."""
    return zeros((B, H, d_k, d_v), device)


def zeros(shape: tuple[int, ...], device: "torch.device") -> "torch.Tensor":
    """An fp32 tensor of zeros on `device` (a zero initial state, a gate parameter not given): one tensor
    per shape and device, made once.

    Shared safely because nothing writes it: the kernels only read their initial states and gate
    parameters. While a CUDA graph is being captured a fresh tensor is made instead (one made then
    would live in the graph's private memory pool, not beside the others).
    """
    import torch

    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(shape, dtype=torch.float32, device=device)
    return _cached_zeros(tuple(shape), device)


@functools.lru_cache(maxsize=8)  # a few shapes: a long-lived caller with many batch sizes holds at most 8
def _cached_zeros(shape, device):
    import torch

    with torch.inference_mode(False):  # a normal tensor even when first made under inference_mode
        return torch.zeros(shape, dtype=torch.float32, device=device)
