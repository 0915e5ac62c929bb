"""Stage 7 kernels: the KDA decode step in TileLang over a pool of states, and prefill of variable-length batches.

One program per (block of d_v columns, batch x head), as in stages 1-5. Program (i_v, b, h) reads
its slice of sequence b's state, S^T[:, block] (d_k x block_dv, fp32), from the pool at slots[b],
advances it by one token and writes it back in place:

    S^T <- Diag(e^g) S^T                 decay, row by row (row d is key channel d)
    u    = beta (v - (S^T)^T k)          one column sum over d_k
    S^T <- S^T + k u^T                   the rank-one delta-rule write
    o    = (S^T)^T q                     a second column sum, with the updated state

(see stages.s07_serving.reference for why this is stage 4's recurrence). No chunk, no GEMM: the state
is read once and written once, 2 * d_k * block_dv * 4 bytes per program against a few KiB of q, k,
v, g; everything else happens in registers. The kernel is bound by memory, and its measure is the
fraction of the copy bandwidth it reaches (benchmarks/decode.py).

`prefill` runs a packed batch of sequences of any lengths (FLA's `cu_seqlens`), each from its own
initial state, in two kernel launches: stage 5's prepare, unchanged, on the batch gathered into a
chunk-aligned layout (every sequence from a chunk's first row, zero rows after its end: exact),
then the varlen recurrence, stage 5's recurrence with reference C's grid, one program per (block of
d_v columns, sequence x head) walking only its sequence's chunks from its own state. Both are
compiled once for any batch (the token, chunk and sequence counts are run-time sizes).

Run `python -m stages.s07_serving.kernel` to compile the kernels for sm_90a and print their ptxas
reports (no GPU needed), or to check them against the references on a GPU.
"""

import functools
from typing import TYPE_CHECKING

import numpy as np

from stages.common.tilelang_tools import LOG2_E
from stages.common.tilelang_tools import compile_report as _compile_report
from stages.common.torch_checks import (KERNEL_DTYPES, check_cu_seqlens, check_gate, check_gate_values, check_kernel_tensor,
                                        check_on_cuda, check_qkv, check_same, check_slot_values, check_slots, dtype_name)
from stages.s05_fast_kda.kernel import DEFAULT_CHUNK_SIZE, _check_tile_sizes
from stages.s07_serving.reference import chunk_aligned_rows

if TYPE_CHECKING:
    import torch

DEFAULT_BLOCK_DV = 32
DEFAULT_THREADS = 128


# --8<-- [start:program]
def build_decode_program(B, P, H, d_k, d_v, block_dv=DEFAULT_BLOCK_DV, dtype="float16", state_dtype="float32",
                         threads=DEFAULT_THREADS):
    """The decode program: q, k (B, H, d_k), v (B, H, d_v) in `dtype`; g (B, H, d_k), beta (B, H) and
    the pool (P, H, d_k, d_v) in `state_dtype` (fp32 on the GPU; the interpreter also runs float64);
    slots (B,) int32 -> o (B, H, d_v) in `dtype`, the pool updated in place at slots.

    block_dv must divide d_v. Parameters in order: Q, K, V, G, Beta, Slots, State_pool, O (out_idx=[7]).
    """
    import tilelang.language as T

    accum_dtype = state_dtype

    @T.prim_func
    def kda_decode(
        Q: T.Tensor((B, H, d_k), dtype),
        K: T.Tensor((B, H, d_k), dtype),
        V: T.Tensor((B, H, d_v), dtype),
        G: T.Tensor((B, H, d_k), accum_dtype),
        Beta: T.Tensor((B, H), accum_dtype),
        Slots: T.Tensor((B,), "int32"),
        State_pool: T.Tensor((P, H, d_k, d_v), accum_dtype),
        O: T.Tensor((B, H, d_v), dtype),
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv
            slot = Slots[b]  # where sequence b's state lives in the pool

            q_s = T.alloc_shared((d_k,), accum_dtype)
            k_s = T.alloc_shared((d_k,), accum_dtype)
            decay_s = T.alloc_shared((d_k,), accum_dtype)  # e^g, one rate per key channel
            v_s = T.alloc_shared((block_dv,), accum_dtype)

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state's slice, read once
            product_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # k ⊙ S^T, then q ⊙ S^T
            recalled_f = T.alloc_fragment((block_dv,), accum_dtype)  # (S^T)^T k: what the state holds for k
            u_f = T.alloc_fragment((block_dv,), accum_dtype)  # beta (v - recalled)
            o_f = T.alloc_fragment((block_dv,), accum_dtype)

            T.copy(State_pool[slot, h, :, v0:v0 + block_dv], S_f)
            T.copy(Q[b, h, :], q_s)
            T.copy(K[b, h, :], k_s)
            T.copy(V[b, h, v0:v0 + block_dv], v_s)
            for d in T.Parallel(d_k):
                decay_s[d] = T.exp2(G[b, h, d] * LOG2_E)

            # the decay first, then what the decayed state recalls for k
            for d, j in T.Parallel(d_k, block_dv):
                S_f[d, j] *= decay_s[d]
                product_f[d, j] = k_s[d] * S_f[d, j]
            T.reduce_sum(product_f, recalled_f, dim=0)
            for j in T.Parallel(block_dv):
                u_f[j] = Beta[b, h] * (v_s[j] - recalled_f[j])

            # the write, then the output read from the updated state
            for d, j in T.Parallel(d_k, block_dv):
                S_f[d, j] += k_s[d] * u_f[j]
                product_f[d, j] = q_s[d] * S_f[d, j]
            T.reduce_sum(product_f, o_f, dim=0)
            T.copy(o_f, O[b, h, v0:v0 + block_dv])
            T.copy(S_f, State_pool[slot, h, :, v0:v0 + block_dv])  # back where it came from

    return kda_decode
# --8<-- [end:program]


@functools.cache
def _compiled(B, P, H, d_k, d_v, block_dv, dtype, threads):
    import tilelang

    program = build_decode_program(B, P, H, d_k, d_v, block_dv, dtype, "float32", threads)
    return tilelang.compile(program, out_idx=[7], target="cuda")


# --8<-- [start:decode]
def decode(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
           state_pool: "torch.Tensor", slots: "torch.Tensor", block_dv: int = DEFAULT_BLOCK_DV,
           threads: int = DEFAULT_THREADS, check_values: bool = True) -> "torch.Tensor":
    """One decode step on CUDA tensors: q, k (B, H, d_k), v (B, H, d_v) in fp16 or bf16; g (B, H, d_k)
    fp32 log gates (<= 0); beta (B, H) fp32 in [0, 1]; state_pool (P, H, d_k, d_v) fp32, S^T in the
    kernel layout; slots (B,) int32, distinct, in [0, P).

    Returns o (B, H, d_v) in the input dtype; state_pool[slots] is advanced by one token in place
    and every other slot is left as it was. check_values=False skips the checks of g's, beta's and
    the slots' values (two passes and two device syncs): the caller vouches for them, and the call
    has no host sync left, as a server's decode loop (or a CUDA graph of it) needs.
    """
    check_kernel_tensor("q", q, rank=3)
    check_kernel_tensor("k", k, rank=3)
    check_kernel_tensor("v", v, rank=3)
    check_same("k", k, "q", q, "shape")
    B, H, d_k = q.shape
    if tuple(v.shape[:2]) != (B, H):
        raise ValueError(f"v must be (B, H, d_v) = ({B}, {H}, d_v), got {tuple(v.shape)}")
    d_v = v.shape[2]
    check_same("k", k, "q", q, "dtype")
    check_same("v", v, "q", q, "dtype")
    check_gate("g", g, (B, H, d_k), "(B, H, d_k)")
    check_gate("beta", beta, (B, H), "(B, H)")
    check_kernel_tensor("state_pool", state_pool, rank=4, dtypes=("float32",))
    if tuple(state_pool.shape[1:]) != (H, d_k, d_v):
        raise ValueError(f"state_pool must be (P, H, d_k, d_v) = (P, {H}, {d_k}, {d_v}), S^T in the kernel layout, "
                         f"got {tuple(state_pool.shape)}")
    check_slots(slots, B)
    _check_block(d_v, block_dv)
    if check_values:
        check_gate_values(g, beta)
        check_slot_values(slots, state_pool.shape[0])
    check_on_cuda({"q": q, "k": k, "v": v, "g": g, "beta": beta, "state_pool": state_pool, "slots": slots})
    kernel = _compiled(B, state_pool.shape[0], H, d_k, d_v, block_dv, dtype_name(q), threads)
    return kernel(q, k, v, g, beta, slots, state_pool)
# --8<-- [end:decode]


# --8<-- [start:varlen_recurrence_program]
def build_varlen_recurrence_program(T_padded, n_chunks, N_seq, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE,
                                    block_dv=DEFAULT_BLOCK_DV, dtype="float16", num_stages=2, threads=128):
    """Stage 5's recurrence over a packed batch laid out chunk-aligned (stages.s07_serving.reference.
    chunk_aligned_rows): the prepare kernel's outputs for T_padded rows (n_chunks = T_padded / C
    chunks), chunk_offsets (N_seq + 1,) int32 and S_0^T (N_seq, H, d_k, d_v) fp32 -> o (1, T_padded,
    H, d_v) in `dtype` and the final states S^T (N_seq, H, d_k, d_v) fp32.

    One program per (block of d_v columns, sequence x head): it walks chunks chunk_offsets[i] to
    chunk_offsets[i + 1] - 1 of its sequence i, a loop whose trip count is read at run time (none
    for an empty sequence: its final state is its initial state). T_padded, n_chunks and N_seq may
    be TileLang symbols (T.dynamic), so that one compiled kernel serves every batch. Parameters in
    order: W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay, Initial_state, Chunk_offsets, O,
    Final_state.
    """
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"

    @T.prim_func
    def kda_recurrence_varlen(
        W: T.Tensor((1, T_padded, H, d_k), dtype),
        U: T.Tensor((1, T_padded, H, d_v), dtype),
        Q_decayed: T.Tensor((1, T_padded, H, d_k), dtype),
        K_to_chunk_end: T.Tensor((1, T_padded, H, d_k), dtype),
        A_qk: T.Tensor((1, T_padded, H, C), dtype),
        Chunk_decay: T.Tensor((1, n_chunks, H, d_k), accum_dtype),
        Initial_state: T.Tensor((N_seq, H, d_k, d_v), accum_dtype),
        Chunk_offsets: T.Tensor((N_seq + 1,), "int32"),
        O: T.Tensor((1, T_padded, H, d_v), dtype),
        Final_state: T.Tensor((N_seq, H, d_k, d_v), accum_dtype),
    ):
        with T.Kernel(d_v // block_dv, N_seq * H, threads=threads) as (i_v, i_nh):
            sequence, h = i_nh // H, i_nh % H
            v0 = i_v * block_dv
            first_chunk = Chunk_offsets[sequence]  # the sequence's chunks: no chunk holds two sequences

            W_s = T.alloc_shared((C, d_k), dtype)
            U_s = T.alloc_shared((C, block_dv), dtype)
            Q_decayed_s = T.alloc_shared((C, d_k), dtype)
            K_to_chunk_end_s = T.alloc_shared((C, d_k), dtype)
            A_qk_s = T.alloc_shared((C, C), dtype)
            chunk_decay_s = T.alloc_shared((d_k,), accum_dtype)
            S_s = T.alloc_shared((d_k, block_dv), dtype)  # the state as a GEMM operand
            V_new_s = T.alloc_shared((C, block_dv), dtype)
            O_s = T.alloc_shared((C, block_dv), dtype)  # o staged for a store of whole rows

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state: lives across chunks
            V_new_f = T.alloc_fragment((C, block_dv), accum_dtype)
            acc_o = T.alloc_fragment((C, block_dv), accum_dtype)

            T.copy(Initial_state[sequence, h, :, v0:v0 + block_dv], S_f)  # its own state, once
            for i in T.Pipelined(Chunk_offsets[sequence + 1] - first_chunk, num_stages=num_stages):
                i_c = first_chunk + i  # the chunk's index in the whole batch
                t0 = i_c * C
                T.copy(W[0, t0:t0 + C, h, :], W_s)
                T.copy(U[0, t0:t0 + C, h, v0:v0 + block_dv], U_s)
                T.copy(Q_decayed[0, t0:t0 + C, h, :], Q_decayed_s)
                T.copy(K_to_chunk_end[0, t0:t0 + C, h, :], K_to_chunk_end_s)
                T.copy(A_qk[0, t0:t0 + C, h, :], A_qk_s)
                T.copy(Chunk_decay[0, i_c, h, :], chunk_decay_s)

                # from here on, stage 5's chunk step as it is
                T.copy(S_f, S_s)
                T.gemm(W_s, S_s, V_new_f, clear_accum=True)
                for r, j in T.Parallel(C, block_dv):
                    V_new_f[r, j] = U_s[r, j] - V_new_f[r, j]
                T.copy(V_new_f, V_new_s)

                T.gemm(Q_decayed_s, S_s, acc_o, clear_accum=True)
                T.gemm(A_qk_s, V_new_s, acc_o)
                T.copy(acc_o, O_s)
                T.copy(O_s, O[0, t0:t0 + C, h, v0:v0 + block_dv])

                for d, j in T.Parallel(d_k, block_dv):
                    S_f[d, j] *= chunk_decay_s[d]
                T.gemm(K_to_chunk_end_s, V_new_s, S_f, transpose_A=True)
            T.copy(S_f, Final_state[sequence, h, :, v0:v0 + block_dv])

    return kda_recurrence_varlen
# --8<-- [end:varlen_recurrence_program]


def _run_time_sizes():
    """The token count, the chunk count and the sequence count of a batch, as TileLang symbols: the
    kernels compiled with them serve every batch."""
    import tilelang.language as T

    return T.dynamic("T_padded"), T.dynamic("n_chunks"), T.dynamic("N_seq")


@functools.cache
def _compiled_prepare(H, d_k, d_v, chunk_size, dtype):
    """Stage 5's prepare for a chunk-aligned batch of any length. The outputs are the caller's (no
    out_idx): TileLang allocates an output only when each of its sizes is a symbol of its own, and
    the chunk decays have T_padded / C rows."""
    import tilelang

    from stages.s05_fast_kda.kernel import build_prepare_program

    T_padded, _, _ = _run_time_sizes()
    return tilelang.compile(build_prepare_program(1, T_padded, H, d_k, d_v, chunk_size, dtype), target="cuda")


@functools.cache
def _compiled_varlen_recurrence(H, d_k, d_v, chunk_size, block_dv, dtype):
    import tilelang

    program = build_varlen_recurrence_program(*_run_time_sizes(), H, d_k, d_v, chunk_size, block_dv, dtype)
    return tilelang.compile(program, target="cuda")


def compiled_prefill_kernels(H, d_k, d_v, chunk_size, block_dv, dtype):
    """(prepare, varlen recurrence) compiled once per head shape, block and dtype, both at once (each
    compile in its own thread: the first call waits for the slower one, not for their sum)."""
    from stages.common.tilelang_tools import compile_in_threads

    kernels = compile_in_threads({"prepare": lambda: _compiled_prepare(H, d_k, d_v, chunk_size, dtype),
                                  "recurrence": lambda: _compiled_varlen_recurrence(H, d_k, d_v, chunk_size,
                                                                                    block_dv, dtype)})
    for kernel in kernels.values():
        if isinstance(kernel, Exception):
            raise kernel
    return kernels["prepare"], kernels["recurrence"]


# --8<-- [start:prefill]
def prefill(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
            cu_seqlens: "torch.Tensor | None" = None, initial_state: "torch.Tensor | None" = None,
            output_final_state: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE, block_dv: int | None = None,
            check_values: bool = True) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
    """The forward pass of a batch of sequences, each from its own state, in FLA's conventions.

    q, k: (B, T, H, d_k), v: (B, T, H, d_v) in fp16 or bf16; g: (B, T, H, d_k) fp32 log gates (<= 0);
    beta: (B, T, H) fp32 in [0, 1]. With cu_seqlens (int32 or int64, (N_seq + 1,)) the batch is
    packed, B = 1, and sequence i is tokens cu_seqlens[i] to cu_seqlens[i + 1] - 1; without it each
    of the B rows is a sequence. initial_state: S_0^T (N_seq, H, d_k, d_v) fp32 or None (zeros).
    Returns o (B, T, H, d_v) in the input dtype, and with output_final_state also the final states
    S^T (N_seq, H, d_k, d_v) fp32. check_values=False skips the check of g's and beta's values;
    block_dv=None takes stage 5's default_block_dv for N_seq sequences.

    With cu_seqlens: one gather lays the tokens out chunk-aligned (each sequence from a chunk's
    first row, zero rows after its last token), stage 5's prepare runs on that layout as on one
    long sequence, the varlen recurrence walks each sequence's chunks from its own state, and one
    gather brings o back to the packed rows. Two kernel launches per call, whatever the lengths, and
    one compiled pair of kernels for every batch; cu_seqlens is read to the host once (one sync).
    """
    from stages.s05_fast_kda.kernel import default_block_dv, forward, streaming_multiprocessors, zero_state

    B, T, H, d_k, d_v = check_qkv(q, k, v)
    check_gate("g", g, (B, T, H, d_k), "(B, T, H, d_k)")
    check_gate("beta", beta, (B, T, H), "(B, T, H)")
    if cu_seqlens is None:
        return forward(q, k, v, g, beta, chunk_size=chunk_size, block_dv=block_dv, initial_state=initial_state,
                       output_final_state=output_final_state, check_values=check_values)
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    N_seq = len(offsets) - 1
    if initial_state is not None:
        check_gate("initial_state", initial_state, (N_seq, H, d_k, d_v), "(N_seq, H, d_k, d_v)")
    _check_tile_sizes(d_k, d_v, chunk_size, block_dv or DEFAULT_BLOCK_DV)
    token_rows, chunk_offsets, padding_rows = chunk_aligned_rows(np.asarray(offsets), chunk_size)
    T_padded = int(chunk_offsets[-1]) * chunk_size
    _check_int32_indexing(T_padded, H, max(d_k, d_v, chunk_size))
    if check_values:
        check_gate_values(g, beta)
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "cu_seqlens": cu_seqlens}
    check_on_cuda(tensors if initial_state is None else dict(tensors, initial_state=initial_state))
    if initial_state is None:
        initial_state = zero_state(N_seq, H, d_k, d_v, q.device)
    if block_dv is None:
        block_dv = default_block_dv(N_seq, H, d_v, streaming_multiprocessors(q.device))

    o, final_state = prefill_chunk_aligned(q, k, v, g, beta, token_rows, padding_rows, chunk_offsets, initial_state,
                                           chunk_size,
                                           compiled_prefill_kernels(H, d_k, d_v, chunk_size, block_dv, dtype_name(q)))
    return (o, final_state) if output_final_state else o
# --8<-- [end:prefill]


# --8<-- [start:prefill_chunk_aligned]
def prefill_chunk_aligned(q, k, v, g, beta, token_rows, padding_rows, chunk_offsets, initial_state, chunk_size,
                          kernels):
    """The packed batch (1, T, ...) through the chunk-aligned layout: q, k, v, g, beta gathered to
    their rows `token_rows` (T,) (reference.chunk_aligned_rows) of T_padded = chunk_offsets[-1] * C
    rows, zeros at `padding_rows` (a zero token changes no state: exact), `chunk_aligned_forward`
    there, o gathered back; no gathers when every length is a multiple of C (as a server's prefill pieces
    often are). Returns (o (1, T, H, d_v), final states (N_seq, H, d_k, d_v) fp32).
    """
    import torch

    T_padded = int(chunk_offsets[-1]) * chunk_size
    if T_padded == 0:  # every sequence empty: nothing to launch, the states stay
        return torch.empty_like(v), initial_state.clone()
    offsets = torch.from_numpy(chunk_offsets.astype(np.int32)).to(q.device, non_blocking=True)
    if T_padded == q.shape[1]:  # every length a multiple of C: the packed batch is already chunk-aligned
        return chunk_aligned_forward(q, k, v, g, beta, offsets, initial_state, chunk_size, kernels)
    rows, padding = (torch.from_numpy(index).to(q.device, non_blocking=True) for index in (token_rows, padding_rows))

    def chunk_aligned(x):  # x (1, T, ...) -> (1, T_padded, ...): one index copy of whole token rows
        out = x.new_empty((T_padded, *x.shape[2:]))
        out.index_fill_(0, padding, 0)
        return out.index_copy_(0, rows, x[0]).unsqueeze(0)

    o, final_state = chunk_aligned_forward(*(chunk_aligned(x) for x in (q, k, v, g, beta)), offsets, initial_state,
                                           chunk_size, kernels)
    return o[0].index_select(0, rows).unsqueeze(0), final_state
# --8<-- [end:prefill_chunk_aligned]


def chunk_aligned_forward(q, k, v, g, beta, chunk_offsets, initial_state, chunk_size, kernels):
    """kernels = (prepare, varlen recurrence) on a batch laid out chunk-aligned, (1, T_padded, ...),
    chunk_offsets (N_seq + 1,) int32 on the device: their outputs allocated, their two launches.
    Returns (o (1, T_padded, H, d_v), final states (N_seq, H, d_k, d_v) fp32)."""
    import torch

    prepare, recurrence = kernels
    (_, T_padded, H, d_k), d_v = q.shape, v.shape[3]

    def empty(*shape, dtype=q.dtype):
        return torch.empty(shape, dtype=dtype, device=q.device)

    # W, U, Q e^gamma, K e^{gamma_C - gamma}, A_qk, e^{gamma_C}: the prepare kernel's outputs in order
    prepared = (empty(1, T_padded, H, d_k), empty(1, T_padded, H, d_v), empty(1, T_padded, H, d_k),
                empty(1, T_padded, H, d_k), empty(1, T_padded, H, chunk_size),
                empty(1, T_padded // chunk_size, H, d_k, dtype=torch.float32))
    prepare(q, k, v, g, beta, *prepared)
    o, final_state = empty(1, T_padded, H, d_v), torch.empty_like(initial_state)
    recurrence(*prepared, initial_state, chunk_offsets, o, final_state)
    return o, final_state


def _check_int32_indexing(T_padded, H, width):
    """The kernels compiled for run-time sizes index in 32 bits: a buffer of T_padded x H x width
    entries must stay below 2^31 (about 524,000 tokens at H = 32 and d = 128)."""
    if T_padded * H * width >= 2**31:
        raise ValueError(f"the chunk-aligned batch has {T_padded} rows of {H} x {width} entries, 2^31 or more: "
                         f"prefill it in smaller batches")


def _check_block(d_v, block_dv):
    """block_dv: a positive divisor of d_v (the programs split the value columns evenly)."""
    if not isinstance(block_dv, int) or block_dv < 1 or d_v % block_dv:
        raise ValueError(f"block_dv must be a positive divisor of d_v = {d_v}, got {block_dv!r}")


@functools.cache  # the page's report and the compile test share one nvcc run
def compile_report(B=64, P=256, H=32, d_k=128, d_v=128, block_dv=DEFAULT_BLOCK_DV, dtype="bfloat16",
                   threads=DEFAULT_THREADS):
    """Lower and compile the decode kernel for sm_90a without a GPU; see stages.common.tilelang_tools."""
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"dtype must be one of {KERNEL_DTYPES}, got {dtype!r}")
    _check_block(d_v, block_dv)
    return _compile_report(build_decode_program(B, P, H, d_k, d_v, block_dv, dtype, "float32", threads))


@functools.cache
def varlen_compile_report(kernel="recurrence", H=32, d_k=128, d_v=128, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=64,
                          dtype="bfloat16"):
    """Lower and compile one of prefill's kernels ("prepare", stage 5's, or "recurrence", the varlen
    one) for sm_90a as prefill compiles them: the token, chunk and sequence counts run-time sizes."""
    from stages.s05_fast_kda.kernel import build_prepare_program

    _check_tile_sizes(d_k, d_v, chunk_size, block_dv)
    T_padded, n_chunks, N_seq = _run_time_sizes()
    if kernel == "prepare":
        return _compile_report(build_prepare_program(1, T_padded, H, d_k, d_v, chunk_size, dtype))
    if kernel == "recurrence":
        return _compile_report(build_varlen_recurrence_program(T_padded, n_chunks, N_seq, H, d_k, d_v, chunk_size,
                                                               block_dv, dtype))
    raise ValueError(f"kernel must be 'prepare' or 'recurrence', got {kernel!r}")


def main():
    import torch

    from stages.common.errors import error_report
    from stages.common.inputs import l2_normalize
    from stages.s07_serving.reference import decode_step

    print("decode sm_90a:", compile_report().summary())
    for kernel in ("prepare", "recurrence"):
        print(f"prefill's {kernel} sm_90a:", varlen_compile_report(kernel).summary())
    if not torch.cuda.is_available():
        print("no CUDA device: compile-only")
        return
    rng = np.random.default_rng(0)
    B, P, H, D = 8, 32, 4, 128
    q, k = (l2_normalize(rng.standard_normal((B, H, D))) for _ in range(2))
    v = rng.standard_normal((B, H, D))
    g, beta = np.log(rng.uniform(0.9, 0.999, (B, H, D))), rng.uniform(0.1, 0.9, (B, H))
    pool = rng.standard_normal((P, H, D, D)).astype(np.float32).astype(np.float64) * 0.1
    slots = rng.permutation(P)[:B].astype(np.int32)
    expected_pool = pool.copy()
    expected = decode_step(q, k, v, g, beta, expected_pool, slots)
    for dtype in (torch.float16, torch.bfloat16):
        pool_gpu = torch.tensor(pool, dtype=torch.float32, device="cuda")
        o = decode(*(torch.tensor(a, dtype=dtype, device="cuda") for a in (q, k, v)),
                   *(torch.tensor(a, dtype=torch.float32, device="cuda") for a in (g, beta)), pool_gpu,
                   torch.tensor(slots, device="cuda"))
        print(f"{dtype} o vs reference:", error_report(o, expected))
        print(f"{dtype} pool vs reference:", error_report(pool_gpu, expected_pool))


if __name__ == "__main__":
    main()
