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
initial state, in two kernel launches and no copy of the tokens: the varlen prepare, stage 5's
prepare with reference C's grid, one program per (row of the chunk table, head) that reads its
chunk straight from the packed rows (zeros past the sequence's end: exact) and writes a
chunk-aligned layout (every sequence from a chunk's first row); then the varlen recurrence, stage 5's
recurrence with reference C's grid, one program per (block of d_v columns, sequence x head) walking
only its sequence's chunks from its own state and storing o at the packed rows (masked at the
sequence's end). Both are compiled once for any batch (the token, row, chunk and sequence counts
are run-time sizes).

Run `python -m stages.s07_serving.kernel` to compile the kernels for sm_90a and print their ptxas
reports (no GPU needed), or to check them against the references on a GPU.
"""

import functools
from typing import TYPE_CHECKING

import numpy as np

from stages.common.device_checks import (BAD_BETA, BAD_CU_SEQLENS, BAD_GATE, BAD_SLOT, FLAG_COUNT, bad_beta,
                                         bad_gate, check_mode, flags_for)
from stages.common.tilelang_tools import LOG2_E, build_in_turn
from stages.common.tilelang_tools import compile_report as _compile_report
from stages.common.torch_checks import (KERNEL_DTYPES, check_cu_seqlens, check_cu_seqlens_values, check_gate,
                                        check_gate_values, check_kernel_tensor, check_on_cuda, check_same,
                                        check_slot_values, check_slots, dtype_name)
from stages.s05_fast_kda.kernel import (CHANNEL_PASSES, DEFAULT_CHUNK_SIZE, SUB_BLOCK, advance_state_macro,
                                        anchored_scores_macro, block_inverse_macro, check_kernel_sizes, check_state,
                                        check_token_inputs, chunk_output_macro, cumulative_gates_macro,
                                        default_prepare_threads, flag_bad_values_macro, wy_outputs_macro)
from stages.s05_fast_kda.numerics import score_operand_dtypes

if TYPE_CHECKING:
    import torch

DEFAULT_BLOCK_DV = 32
# decode's value columns per program where d_v allows: at B >= 8 on the H200, 64 moved the states 3-7%
# faster than 32, and 128 was slower still (benchmarks/results/decode_b64_blocks.csv; decode*.csv)
DECODE_BLOCK_DV = 64
DEFAULT_THREADS = 128


# --8<-- [start:program]
def build_decode_program(B, P, H, d_k, d_v, block_dv=DEFAULT_BLOCK_DV, dtype="float16", state_dtype="float32",
                         threads=DEFAULT_THREADS, value_flags=True):
    """The decode program: q, k (B, H, d_k), v (B, H, d_v) in `dtype`; g (B, H, d_k), beta (B, H) and
    the pool (P, H, d_k, d_v) in `state_dtype` (fp32 on the GPU; the interpreter also runs float64);
    slots (B,) int32 -> o (B, H, d_v) in `dtype`, the pool updated in place at slots.

    The values only the data can tell are checked here, on the device, as they are read: a log gate
    that is not finite and <= 0 sets Flags[BAD_GATE], a beta outside [0, 1] (or NaN) Flags[BAD_BETA],
    a slot outside [0, P) Flags[BAD_SLOT] (stages.common.device_checks reads them, with no host sync
    per call). A program whose slot is out of range reads slot 0 and writes nothing: it never
    touches memory past the pool.

    block_dv must divide d_v. Parameters in order: Q, K, V, G, Beta, Slots, State_pool, Flags, O
    (out_idx=[8]); Flags (FLAG_COUNT,) int32 is only ever set to 1. value_flags=False leaves Flags
    out (O is then parameter 7) and flags nothing, for decode's checks="off"; a slot outside the
    pool still writes nothing.
    """
    import tilelang.language as T

    accum_dtype = state_dtype

    # one body, two signatures (a TileLang program's parameters are fixed where it is written)
    @T.macro
    def decode_step(Q, K, V, G, Beta, Slots, State_pool, Flags, O):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv
            slot_in_pool = T.And(Slots[b] >= 0, Slots[b] < P)
            slot = T.if_then_else(slot_in_pool, Slots[b], 0)  # where sequence b's state lives in the pool

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
                if Flags is not None:  # value_flags
                    if bad_gate(G[b, h, d], accum_dtype):
                        Flags[BAD_GATE] = 1
            if Flags is not None:
                if bad_beta(Beta[b, h]):
                    Flags[BAD_BETA] = 1
                if T.Not(slot_in_pool):
                    Flags[BAD_SLOT] = 1

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
            for d, j in T.Parallel(d_k, block_dv):
                if slot_in_pool:  # back where it came from; a slot out of range writes nothing
                    State_pool[slot, h, d, v0 + j] = S_f[d, j]


    if value_flags:
        @T.prim_func
        def kda_decode(
            Q: T.Tensor((B, H, d_k), dtype),
            K: T.Tensor((B, H, d_k), dtype),
            V: T.Tensor((B, H, d_v), dtype),
            G: T.Tensor((B, H, d_k), accum_dtype),
            Beta: T.Tensor((B, H), accum_dtype),
            Slots: T.Tensor((B,), "int32"),
            State_pool: T.Tensor((P, H, d_k, d_v), accum_dtype),
            Flags: T.Tensor((FLAG_COUNT,), "int32"),
            O: T.Tensor((B, H, d_v), dtype),
        ):
            decode_step(Q, K, V, G, Beta, Slots, State_pool, Flags, O)
    else:
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
            decode_step(Q, K, V, G, Beta, Slots, State_pool, None, O)

    return kda_decode
# --8<-- [end:program]


@functools.cache
def compiled_decode(B, P, H, d_k, d_v, block_dv, dtype, threads, value_flags):
    """The decode kernel compiled for the GPU with an fp32 pool: made once per shape, block, dtype,
    threads and value_flags (False: the one without Flags, checks="off")."""
    import tilelang

    program = build_decode_program(B, P, H, d_k, d_v, block_dv, dtype, "float32", threads, value_flags)
    return tilelang.compile(program, out_idx=[8 if value_flags else 7], target="cuda")


# --8<-- [start:decode]
def decode(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
           state_pool: "torch.Tensor", slots: "torch.Tensor", block_dv: int | None = None,
           threads: int = DEFAULT_THREADS, checks: str = "device") -> "torch.Tensor":
    """One decode step on CUDA tensors: q, k (B, H, d_k), v (B, H, d_v) in fp16 or bf16; g (B, H, d_k)
    fp32 log gates (<= 0); beta (B, H) fp32 in [0, 1]; state_pool (P, H, d_k, d_v) fp32, S^T in the
    kernel layout; slots (B,) int32, distinct, in [0, P).

    Returns o (B, H, d_v) in the input dtype; state_pool[slots] is advanced by one token in place
    and every other slot is left as it was. block_dv=None takes decode_block_dv(d_v). Shapes, dtypes
    and devices are checked here. The values:
    checks="device" (the default) leaves them to the kernel, which flags a bad g, beta or slot as it
    reads them (stages.common.device_checks: `raise_if_flagged(q.device)` reports them) and never
    writes through a slot outside the pool; the call has no host sync, so a server can capture it in
    a CUDA graph. checks="host" also reads them to the host first and raises before the kernel runs
    (two device syncs; it also catches two equal slots, which make two programs write one state):
    the mode to debug a caller with. checks="off": the caller vouches for them, and the kernel runs
    without the flags (a slot outside the pool still writes nothing).
    """
    B, H, d_k, d_v = check_decode_inputs(q, k, v, g, beta, state_pool, slots, block_dv, checks)
    block_dv = decode_block_dv(d_v) if block_dv is None else block_dv
    value_flags = checks == "device"
    kernel = compiled_decode(B, state_pool.shape[0], H, d_k, d_v, block_dv, dtype_name(q), threads, value_flags)
    flags = (flags_for(q.device),) if value_flags else ()
    return kernel(q, k, v, g, beta, slots, state_pool, *flags)


def decode_block_dv(d_v: int) -> int:
    """decode's default block_dv: DECODE_BLOCK_DV where it divides d_v, else DEFAULT_BLOCK_DV."""
    return DECODE_BLOCK_DV if d_v % DECODE_BLOCK_DV == 0 else DEFAULT_BLOCK_DV


def check_decode_inputs(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor",
                        beta: "torch.Tensor", state_pool: "torch.Tensor", slots: "torch.Tensor",
                        block_dv: int | None = None, checks: str = "device") -> tuple[int, int, int, int]:
    """Every check of `decode`'s arguments (see its docstring); returns (B, H, d_k, d_v).

    In stage 5's order (check_forward_inputs): the checks mode, what the tensors' types, shapes and
    dtypes tell, and block_dv; then, with checks="host", what only their values tell
    (check_decode_values); the device last, so that every other mistake shows, and is tested, on a
    machine without a GPU.
    """
    check_mode(checks)
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
    check_block(d_v, decode_block_dv(d_v) if block_dv is None else block_dv)
    if checks == "host":
        check_decode_values(g, beta, slots, state_pool.shape[0])
    check_on_cuda({"q": q, "k": k, "v": v, "g": g, "beta": beta, "state_pool": state_pool, "slots": slots})
    return B, H, d_k, d_v


def check_decode_values(g: "torch.Tensor", beta: "torch.Tensor", slots: "torch.Tensor", P: int) -> None:
    """What only the values tell: g finite and <= 0, beta in [0, 1] (check_gate_values), and the slots
    distinct and in [0, P) (check_slot_values). Two passes, two device syncs: decode's checks="host";
    by default the kernel checks them itself (build_decode_program)."""
    check_gate_values(g, beta)
    check_slot_values(slots, P)
# --8<-- [end:decode]


# --8<-- [start:varlen_prepare_program]
def build_varlen_prepare_program(T_tokens, T_padded, n_chunks, N_seq, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE,
                                 dtype="float16", threads=None, channel_passes=CHANNEL_PASSES, value_flags=False):
    """Stage 5's prepare on a packed batch: q, k, g (1, T_tokens, H, d_k), v (1, T_tokens, H, d_v), beta
    (1, T_tokens, H), packed by Cu_seqlens (N_seq + 1,) int32, and the chunk table Chunks (n_chunks, 2)
    int32 (stages.s07_serving.reference.chunk_table) -> W, U, Q e^gamma, K e^{gamma_C - gamma}, A_qk
    chunk-aligned (1, T_padded = n_chunks * C, H, ...) in `dtype`, e^{gamma_C} (1, n_chunks, H, d_k) fp32.

    One program per (row p of the chunk table, head): it reads chunk `chunk` of sequence `sequence`
    straight from the packed rows, zeros past the sequence's end (masked loads, as reference C's
    prepare_varlen), and writes rows p * C to p * C + C - 1 of the chunk-aligned layout the varlen
    recurrence reads. A row of the table whose chunk starts at or past its sequence's end (the rows
    `varlen_index` adds past the batch's chunks) loads nothing but zeros, and writes a zero chunk's
    outputs to rows no sequence owns. (Skipping it with `if rows > 0:` around the body cost more: the
    body one statement, TileLang's shared-memory planner gave every buffer its own bytes, 248,080 B,
    past an SM's 227 KiB; its aggressive mode fitted them in 114,960 B but raced on the H200,
    compute-sanitizer's racecheck reporting writes over a GEMM operand still being read.) Between its
    loads and its stores it runs stage 5's prepare: the same buffers and
    the same macros (cumulative_gates, anchored_scores, block_inverse, wy_outputs). T_tokens, T_padded,
    n_chunks and N_seq may be TileLang symbols (T.dynamic). Parameters in order: Q, K, V, G, Beta,
    Chunks, Cu_seqlens, W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay; value_flags=True adds
    Flags (FLAG_COUNT,) int32 before W and checks each sequence's g and beta as they are loaded (stage
    5's flag_bad_values_macro; the zeros loaded past a sequence's end never set a flag): prefill's
    default kernel.
    """
    import tilelang.language as T

    threads = threads or default_prepare_threads(chunk_size)
    C, sub = chunk_size, SUB_BLOCK
    accum_dtype = "float32"
    channels_per_pass = d_k // channel_passes
    diagonal_dtype, slab_dtype = score_operand_dtypes(dtype)
    flag_bad_values = flag_bad_values_macro(C, d_k)
    cumulative_gates = cumulative_gates_macro(C, d_k)
    anchored_scores = anchored_scores_macro(C, channel_passes, channels_per_pass, diagonal_dtype)
    block_inverse = block_inverse_macro(C)
    wy_outputs = wy_outputs_macro(C)

    # one body, two signatures (a TileLang program's parameters are fixed where it is written)
    @T.macro
    def prepare_varlen(Q, K, V, G, Beta, Chunks, Cu_seqlens, Flags, W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay):
        with T.Kernel(n_chunks, H, threads=threads) as (i_c, h):
            sequence = Chunks[i_c, 0]
            start = Cu_seqlens[sequence] + Chunks[i_c, 1] * C  # the chunk's first token in the packed batch
            rows = T.min(C, Cu_seqlens[sequence + 1] - start)  # a sequence's last chunk may be short
            t0 = i_c * C  # the chunk's first row in the chunk-aligned outputs

            Q_s = T.alloc_shared((C, d_k), dtype)
            K_s = T.alloc_shared((C, d_k), dtype)
            gamma_s = T.alloc_shared((C, d_k), accum_dtype)
            beta_s = T.alloc_shared((C,), accum_dtype)
            # the score GEMMs' operands (stage 5's anchored_scores_macro), in score_operand_dtypes' types
            Q_row_s = T.alloc_shared((C, channels_per_pass), diagonal_dtype)
            K_row_s = T.alloc_shared((C, channels_per_pass), diagonal_dtype)
            K_col_s = T.alloc_shared((C, channels_per_pass), diagonal_dtype)
            Q_slab_s = T.alloc_shared((C, channels_per_pass), slab_dtype)
            K_slab_row_s = T.alloc_shared((C, channels_per_pass), slab_dtype)
            K_slab_col_s = T.alloc_shared((sub, channels_per_pass), slab_dtype)
            L_s = T.alloc_shared((C, C), accum_dtype)  # L = beta_i A_kk, strictly lower
            T_s = T.alloc_shared((C, C), accum_dtype)  # (I + L)^{-1}
            T_diag_s = T.alloc_shared((C, sub), accum_dtype)  # the diagonal blocks T[P, P], stacked
            merge_s = T.alloc_shared((sub, C), accum_dtype)  # L[P, :] T of one block row
            A_hat_s = T.alloc_shared((C, C), dtype)  # diag(beta) T
            # A_qk is staged in A_hat's bytes and copied out before A_hat is formed
            A_qk_s = A_hat_s
            V_s = T.alloc_shared((C, d_v), dtype)
            Kg_s = T.alloc_shared((C, d_k), dtype)  # K e^gamma (TileLang gives it the dead operands' bytes)
            W_s = T.alloc_shared((C, d_k), dtype)  # W and U staged for whole-row stores to HBM
            U_s = T.alloc_shared((C, d_v), dtype)

            kk_f = T.alloc_fragment((C, C), accum_dtype)
            qk_f = T.alloc_fragment((C, C), accum_dtype)
            kk_slab_f = T.alloc_fragment((C, sub), accum_dtype)
            qk_slab_f = T.alloc_fragment((C, sub), accum_dtype)
            w_f = T.alloc_fragment((C, d_k), accum_dtype)
            u_f = T.alloc_fragment((C, d_v), accum_dtype)
            block_row_f = T.alloc_fragment((sub, C), accum_dtype)

            # masked loads: a row past the sequence's end is a zero token (g = 0, beta = 0), which
            # changes nothing of the rows before it; the next sequence's tokens are never read. The
            # 2-byte and the 4-byte loads in loops of their own: each vectorizes to 16 bytes a lane
            for r, d in T.Parallel(C, d_k):
                Q_s[r, d] = T.if_then_else(r < rows, Q[0, start + r, h, d], 0)
                K_s[r, d] = T.if_then_else(r < rows, K[0, start + r, h, d], 0)
            for r, d in T.Parallel(C, d_k):
                gamma_s[r, d] = T.if_then_else(r < rows, G[0, start + r, h, d], 0)
            for r in T.Parallel(C):
                beta_s[r] = T.if_then_else(r < rows, Beta[0, start + r, h], 0)
            if Flags is not None:  # value_flags: the sequence's gates and betas checked as they arrive
                flag_bad_values(gamma_s, beta_s, Flags)
            cumulative_gates(gamma_s)

            # stage 5's prepare, storing at the chunk-aligned rows; V masked as the others
            anchored_scores(Q_s, K_s, gamma_s, beta_s, Q_row_s, K_row_s, K_col_s, Q_slab_s, K_slab_row_s,
                            K_slab_col_s, kk_f, qk_f, kk_slab_f, qk_slab_f, L_s, A_qk_s)
            T.copy(A_qk_s, A_qk[0, t0:t0 + C, h, :])
            for r, d in T.Parallel(C, d_k):
                decay_from_start = T.exp2(gamma_s[r, d] * LOG2_E)
                Q_decayed[0, t0 + r, h, d] = Q_s[r, d] * decay_from_start
                K_to_chunk_end[0, t0 + r, h, d] = K_s[r, d] * T.exp2((gamma_s[C - 1, d] - gamma_s[r, d]) * LOG2_E)
                Kg_s[r, d] = K_s[r, d] * decay_from_start
            for d in T.Parallel(d_k):
                Chunk_decay[0, i_c, h, d] = T.exp2(gamma_s[C - 1, d] * LOG2_E)
            for r, d in T.Parallel(C, d_v):
                V_s[r, d] = T.if_then_else(r < rows, V[0, start + r, h, d], 0)

            block_inverse(L_s, T_s, T_diag_s, merge_s, block_row_f)
            wy_outputs(T_s, beta_s, A_hat_s, Kg_s, V_s, w_f, u_f, W_s, U_s)
            T.copy(W_s, W[0, t0:t0 + C, h, :])
            T.copy(U_s, U[0, t0:t0 + C, h, :])


    if value_flags:
        @T.prim_func
        def kda_prepare_varlen(
            Q: T.Tensor((1, T_tokens, H, d_k), dtype),
            K: T.Tensor((1, T_tokens, H, d_k), dtype),
            V: T.Tensor((1, T_tokens, H, d_v), dtype),
            G: T.Tensor((1, T_tokens, H, d_k), accum_dtype),
            Beta: T.Tensor((1, T_tokens, H), accum_dtype),
            Chunks: T.Tensor((n_chunks, 2), "int32"),
            Cu_seqlens: T.Tensor((N_seq + 1,), "int32"),
            Flags: T.Tensor((FLAG_COUNT,), "int32"),
            W: T.Tensor((1, T_padded, H, d_k), dtype),
            U: T.Tensor((1, T_padded, H, d_v), dtype),
            Q_decayed: T.Tensor((1, T_padded, H, d_k), dtype),
            K_to_chunk_end: T.Tensor((1, T_padded, H, d_k), dtype),
            A_qk: T.Tensor((1, T_padded, H, C), dtype),
            Chunk_decay: T.Tensor((1, n_chunks, H, d_k), accum_dtype),
        ):
            prepare_varlen(Q, K, V, G, Beta, Chunks, Cu_seqlens, Flags, W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay)
    else:
        @T.prim_func
        def kda_prepare_varlen(
            Q: T.Tensor((1, T_tokens, H, d_k), dtype),
            K: T.Tensor((1, T_tokens, H, d_k), dtype),
            V: T.Tensor((1, T_tokens, H, d_v), dtype),
            G: T.Tensor((1, T_tokens, H, d_k), accum_dtype),
            Beta: T.Tensor((1, T_tokens, H), accum_dtype),
            Chunks: T.Tensor((n_chunks, 2), "int32"),
            Cu_seqlens: T.Tensor((N_seq + 1,), "int32"),
            W: T.Tensor((1, T_padded, H, d_k), dtype),
            U: T.Tensor((1, T_padded, H, d_v), dtype),
            Q_decayed: T.Tensor((1, T_padded, H, d_k), dtype),
            K_to_chunk_end: T.Tensor((1, T_padded, H, d_k), dtype),
            A_qk: T.Tensor((1, T_padded, H, C), dtype),
            Chunk_decay: T.Tensor((1, n_chunks, H, d_k), accum_dtype),
        ):
            prepare_varlen(Q, K, V, G, Beta, Chunks, Cu_seqlens, None, W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay)

    return kda_prepare_varlen
# --8<-- [end:varlen_prepare_program]


# --8<-- [start:varlen_recurrence_program]
def build_varlen_recurrence_program(T_tokens, T_padded, n_chunks, N_seq, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE,
                                    block_dv=DEFAULT_BLOCK_DV, dtype="float16", num_stages=2, threads=128):
    """Stage 5's recurrence over the varlen prepare's chunk-aligned outputs (T_padded rows, n_chunks =
    T_padded / C chunks, each sequence from a chunk's first row), chunk_offsets (N_seq + 1,) int32
    (stages.s07_serving.reference.chunk_table), cu_seqlens (N_seq + 1,) int32 and S_0^T (N_seq, H,
    d_k, d_v) fp32 -> o (1, T_tokens, H, d_v) in `dtype`, packed as the inputs, and the final states
    S^T (N_seq, H, d_k, d_v) fp32.

    One program per (block of d_v columns, sequence x head): it walks chunks chunk_offsets[i] to
    chunk_offsets[i + 1] - 1 of its sequence i, a loop whose trip count is read at run time (none
    for an empty sequence: its final state is its initial state), and stores each chunk's o at the
    sequence's packed rows, masked at its end. T_tokens, T_padded, n_chunks and N_seq may be
    TileLang symbols (T.dynamic), so that one compiled kernel serves every batch. Parameters in
    order: W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay, Initial_state, Chunk_offsets,
    Cu_seqlens, O, Final_state.
    """
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    chunk_output = chunk_output_macro(C, block_dv)
    advance_state = advance_state_macro(d_k, block_dv)

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
        Cu_seqlens: T.Tensor((N_seq + 1,), "int32"),
        O: T.Tensor((1, T_tokens, H, d_v), dtype),
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
            O_s = T.alloc_shared((C, block_dv), dtype)  # o staged for stores of whole rows

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state: lives across chunks
            V_new_f = T.alloc_fragment((C, block_dv), accum_dtype)
            acc_o = T.alloc_fragment((C, block_dv), accum_dtype)

            T.copy(Initial_state[sequence, h, :, v0:v0 + block_dv], S_f)  # its own state, once
            for i in T.Pipelined(Chunk_offsets[sequence + 1] - first_chunk, num_stages=num_stages):
                i_c = first_chunk + i  # the chunk's index in the whole batch
                t0 = i_c * C  # its first row in the chunk-aligned layout
                start = Cu_seqlens[sequence] + i * C  # ... and its first token in the packed batch
                rows = T.min(C, Cu_seqlens[sequence + 1] - start)  # a sequence's last chunk may be short
                T.copy(W[0, t0:t0 + C, h, :], W_s)
                T.copy(U[0, t0:t0 + C, h, v0:v0 + block_dv], U_s)
                T.copy(Q_decayed[0, t0:t0 + C, h, :], Q_decayed_s)
                T.copy(K_to_chunk_end[0, t0:t0 + C, h, :], K_to_chunk_end_s)
                T.copy(A_qk[0, t0:t0 + C, h, :], A_qk_s)
                T.copy(Chunk_decay[0, i_c, h, :], chunk_decay_s)

                chunk_output(S_f, S_s, W_s, U_s, Q_decayed_s, A_qk_s, V_new_f, V_new_s, acc_o, O_s)
                for r, j in T.Parallel(C, block_dv):  # masked store: the rows past the end are the next sequence's
                    if r < rows:
                        O[0, start + r, h, v0 + j] = O_s[r, j]
                advance_state(S_f, chunk_decay_s, K_to_chunk_end_s, V_new_s)
            T.copy(S_f, Final_state[sequence, h, :, v0:v0 + block_dv])

    return kda_recurrence_varlen
# --8<-- [end:varlen_recurrence_program]


def run_time_sizes():
    """The token count, the chunk-aligned row count, the chunk count and the sequence count of a batch,
    as TileLang symbols: the kernels compiled with them serve every batch."""
    import tilelang.language as T

    return T.dynamic("T_tokens"), T.dynamic("T_padded"), T.dynamic("n_chunks"), T.dynamic("N_seq")


@functools.cache
def _compiled_varlen_prepare(H, d_k, d_v, chunk_size, dtype, value_flags):
    """The varlen prepare for a packed batch of any length. The outputs are the caller's (no out_idx):
    TileLang allocates an output only when each of its sizes is a symbol of its own."""
    import tilelang

    program = build_in_turn(build_varlen_prepare_program, *run_time_sizes(), H, d_k, d_v, chunk_size, dtype,
                            value_flags=value_flags)
    return tilelang.compile(program, target="cuda")


@functools.cache
def _compiled_varlen_recurrence(H, d_k, d_v, chunk_size, block_dv, dtype):
    import tilelang

    program = build_in_turn(build_varlen_recurrence_program, *run_time_sizes(), H, d_k, d_v, chunk_size, block_dv,
                            dtype)
    return tilelang.compile(program, target="cuda")


@functools.cache
def compiled_prefill_kernels(H, d_k, d_v, chunk_size, block_dv, dtype, value_flags=False):
    """(varlen prepare, varlen recurrence) compiled once per head shape, block and dtype, both at once
    (each compile in its own thread: the first call waits for the slower one, not for their sum);
    value_flags: the prepare that takes Flags and flags bad values (prefill's default). Cached as a
    pair: starting the two threads again on every call cost 260 us of host time per prefill."""
    from stages.common.tilelang_tools import compile_in_threads

    kernels = compile_in_threads({"prepare": lambda: _compiled_varlen_prepare(H, d_k, d_v, chunk_size, dtype,
                                                                              value_flags),
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
            checks: str = "device") -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
    """The forward pass of a batch of sequences, each from its own state, in FLA's conventions.

    q, k: (B, T, H, d_k), v: (B, T, H, d_v) in fp16 or bf16; g: (B, T, H, d_k) fp32 log gates (<= 0);
    beta: (B, T, H) fp32 in [0, 1]. With cu_seqlens (int32 or int64, (N_seq + 1,)) the batch is
    packed, B = 1, and sequence i is tokens cu_seqlens[i] to cu_seqlens[i + 1] - 1; without it each
    of the B rows is a sequence. initial_state: S_0^T (N_seq, H, d_k, d_v) fp32 or None (zeros).
    Returns o (B, T, H, d_v) in the input dtype, and with output_final_state also the final states
    S^T (N_seq, H, d_k, d_v) fp32. block_dv=None takes stage 5's default_block_dv for N_seq sequences.
    checks: as stage 5's forward, "device" (the default: the varlen prepare flags a bad g or beta as
    it loads it, the index's ops offsets cu_seqlens out of order; `raise_if_flagged(q.device)`
    reports them), "host" (g, beta and cu_seqlens read to the host and refused before the kernels)
    or "off".

    With cu_seqlens: the varlen prepare reads each chunk of each sequence straight from the packed
    tensors (zeros past the sequence's end) and writes the chunk-aligned layout, the varlen recurrence
    walks each sequence's chunks from its own state and writes o to the packed rows. Two kernel
    launches per call, whatever the lengths, one compiled pair of kernels for every batch, no copy of
    the tokens, and no host sync: the chunk table is built on the device (`varlen_index`), sized by
    the most chunks T tokens in N_seq sequences can need, so that the call can be captured in a CUDA
    graph like stage 5's forward (prefill without cu_seqlens).
    """
    from stages.s05_fast_kda.kernel import default_block_dv, forward, streaming_multiprocessors, zero_state

    if cu_seqlens is None:
        return forward(q, k, v, g, beta, chunk_size=chunk_size, block_dv=block_dv, initial_state=initial_state,
                       output_final_state=output_final_state, checks=checks)
    check_prefill_inputs(q, k, v, g, beta, cu_seqlens, initial_state, chunk_size, block_dv, checks)
    T, H, d_k, d_v, N_seq = q.shape[1], q.shape[2], q.shape[3], v.shape[3], cu_seqlens.numel() - 1
    if initial_state is None:
        initial_state = zero_state(N_seq, H, d_k, d_v, q.device)
    if block_dv is None:
        block_dv = default_block_dv(N_seq, H, d_v, streaming_multiprocessors(q.device))

    flags = flags_for(q.device) if checks == "device" else None
    index = varlen_index(cu_seqlens, T, chunk_size, flags)
    kernels = compiled_prefill_kernels(H, d_k, d_v, chunk_size, block_dv, dtype_name(q), flags is not None)
    o, final_state = varlen_forward(q, k, v, g, beta, index, initial_state, chunk_size, kernels, flags)
    return (o, final_state) if output_final_state else o


def check_prefill_inputs(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor",
                         beta: "torch.Tensor", cu_seqlens: "torch.Tensor", initial_state: "torch.Tensor | None" = None,
                         chunk_size: int = DEFAULT_CHUNK_SIZE, block_dv: int | None = None,
                         checks: str = "device") -> None:
    """Every check of `prefill`'s arguments with cu_seqlens (without, `forward` checks them), in the
    order of stage 5's check_forward_inputs: the checks mode, the tensors' types, shapes and dtypes,
    cu_seqlens's type and shape, the initial states, the tile sizes and the 32-bit indexing of the
    largest chunk-aligned layout; then, with checks="host", cu_seqlens's, g's and beta's values (read
    to the host); the device last."""
    check_mode(checks)
    B, T, H, d_k, d_v = check_token_inputs(q, k, v, g, beta, length="T")
    check_cu_seqlens(cu_seqlens, B)
    N_seq = cu_seqlens.numel() - 1
    check_state("initial_state", initial_state, (N_seq, H, d_k, d_v), "(N_seq, H, d_k, d_v)")
    check_kernel_sizes(d_k, d_v, chunk_size, block_dv or DEFAULT_BLOCK_DV)
    check_int32_indexing(max(T, most_chunks(T, N_seq, chunk_size) * chunk_size), H, max(d_k, d_v, chunk_size))
    if checks == "host":
        check_cu_seqlens_values(cu_seqlens, T)
        check_gate_values(g, beta)
    check_on_cuda({"q": q, "k": k, "v": v, "g": g, "beta": beta, "cu_seqlens": cu_seqlens,
                   "initial_state": initial_state})
# --8<-- [end:prefill]


# --8<-- [start:varlen_forward]
def most_chunks(T: int, N_seq: int, chunk_size: int) -> int:
    """The most chunks T tokens cut into N_seq sequences can take: a sequence of n tokens takes
    ceil(n / C) <= floor(n / C) + 1 chunks, and the floors sum to at most floor(T / C)."""
    return T // chunk_size + N_seq


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


def varlen_forward(q, k, v, g, beta, index, initial_state, chunk_size, kernels, flags=None):
    """kernels = (varlen prepare, varlen recurrence) on the packed batch (1, T, ...) as the caller gave
    it; index: `varlen_index` on the inputs' device; flags: the Flags tensor a prepare built with
    value_flags takes, None for one built without: the kernels' outputs allocated (the chunk-aligned
    ones for most_chunks), their two launches (no host sync). Returns (o (1, T, H, d_v), final states
    (N_seq, H, d_k, d_v) fp32)."""
    import torch

    prepare, recurrence = kernels
    (_, T, H, d_k), d_v, N_seq = q.shape, v.shape[3], initial_state.shape[0]
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
    prepare(q, k, v, g, beta, chunks.view(n_chunks, 2), cu_seqlens, *value_flags, *prepared)
    o, final_state = empty(1, T, H, d_v), torch.empty_like(initial_state)
    recurrence(*prepared, initial_state, chunk_offsets, cu_seqlens, o, final_state)
    return o, final_state
# --8<-- [end:varlen_forward]


def check_int32_indexing(rows: int, H: int, width: int) -> None:
    """The kernels compiled for run-time sizes index in 32 bits: a buffer of rows x H x width entries
    (rows: the packed tokens or the chunk-aligned rows, the more) must stay below 2^31 (about
    524,000 rows at H = 32 and d = 128)."""
    if rows * H * width >= 2**31:
        raise ValueError(f"the batch has {rows} rows of {H} x {width} entries, 2^31 or more: "
                         f"prefill it in smaller batches")


def check_block(d_v: int, block_dv: int) -> None:
    """block_dv: a positive divisor of d_v (the programs split the value columns evenly)."""
    if not isinstance(block_dv, int) or block_dv < 1 or d_v % block_dv:
        raise ValueError(f"block_dv must be a positive divisor of d_v = {d_v}, got {block_dv!r}")


@functools.cache  # the page's report and the compile test share one nvcc run
def compile_report(B=64, P=256, H=32, d_k=128, d_v=128, block_dv=DEFAULT_BLOCK_DV, dtype="bfloat16",
                   threads=DEFAULT_THREADS):
    """Lower and compile the decode kernel for sm_90a without a GPU; see stages.common.tilelang_tools."""
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"dtype must be one of {KERNEL_DTYPES}, got {dtype!r}")
    check_block(d_v, block_dv)
    return _compile_report(build_decode_program(B, P, H, d_k, d_v, block_dv, dtype, "float32", threads))


@functools.cache
def varlen_compile_report(kernel="recurrence", H=32, d_k=128, d_v=128, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=64,
                          dtype="bfloat16", value_flags=False):
    """Lower and compile one of prefill's kernels ("prepare" or "recurrence", both varlen) for sm_90a
    as prefill compiles them: the token, row, chunk and sequence counts run-time sizes; value_flags:
    the prepare that flags bad values (prefill's default)."""
    check_kernel_sizes(d_k, d_v, chunk_size, block_dv)
    if kernel == "prepare":
        return _compile_report(build_varlen_prepare_program(*run_time_sizes(), H, d_k, d_v, chunk_size, dtype,
                                                            value_flags=value_flags))
    if kernel == "recurrence":
        return _compile_report(build_varlen_recurrence_program(*run_time_sizes(), H, d_k, d_v, chunk_size, block_dv,
                                                               dtype))
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
