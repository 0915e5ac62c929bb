"""Stage 5 kernels: the KDA forward as two TileLang kernels, prepare and recurrence.

prepare: one program per (chunk, batch x head), thousands of them, no state. Per chunk of C tokens:
    gamma = cumsum of the log gates
    A_kk, A_qk from GEMMs on 16-row sub-blocks with anchored exponents (every factor <= 1 off the
    diagonal blocks), written as A_qk (input dtype) and L = diag(beta) A_kk (fp32, on chip);
    Q e^gamma, K e^{gamma_C - gamma} (input dtype) and e^{gamma_C} (fp32) written;
    T = (I + L)^{-1} by blocks in fp32 (merges as TF32 GEMMs), then the GEMMs W = diag(beta) T (K e^gamma),
    U = diag(beta) T V.

recurrence: one program per (block of d_v columns, batch x head), the state S^T (d_k x block_dv)
in registers as an fp32 fragment for the whole sequence, a pipelined chunk loop (stage 1's
kernel with three more GEMM operands); block_dv is 64 where that still gives every SM a program,
else 32 (default_block_dv):
    V_new = U - W S^T
    O     = (Q e^gamma) S^T + A_qk V_new            written before ...
    S^T  <- Diag(e^{gamma_C}) S^T + (K e^{gamma_C - gamma})^T V_new   ... the state moves on

Run `python -m stages.s05_fast_kda.kernel` to compile both for sm_90a and print their ptxas reports
(no GPU needed), or to check them against the float64 references (and FLA, if installed) on a GPU.
"""

import functools
from typing import TYPE_CHECKING

from stages.common.checks import padded_length
from stages.common.device_checks import BAD_BETA, BAD_GATE, FLAG_COUNT, bad_beta, bad_gate, check_mode, flags_for
from stages.common.tilelang_tools import LOG2_E, build_in_turn
from stages.common.tilelang_tools import compile_report as _compile_report
from stages.common.torch_checks import (check_gate, check_gate_values, check_on_cuda, check_qkv, check_tile_sizes,
                                        dtype_name, pad_tokens)
from stages.s05_fast_kda.numerics import FAST_SPAN_LOG, score_operand_dtypes
from stages.s05_fast_kda.reference import SUB_BLOCK  # rows of a sub-block: anchors and the block inverse work on these

if TYPE_CHECKING:
    import torch

DEFAULT_CHUNK_SIZE = 64
DEFAULT_BLOCK_DV = 32
CHANNEL_PASSES = 2  # the score GEMMs sum over d_k in this many passes (their operands hold d_k / 2 channels)


# --8<-- [start:prepare_setup]
def build_prepare_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
                          channel_passes=CHANNEL_PASSES, any_gate=True, value_flags=False, solve_outputs=False):
    """The prepare kernel: q, k (B, N, H, d_k), v (B, N, H, d_v) in `dtype`, g (B, N, H, d_k) and
    beta (B, N, H) in fp32 -> W, Q e^gamma, K e^{gamma_C - gamma} (B, N, H, d_k), U (B, N, H, d_v),
    A_qk (B, N, H, C) in `dtype`, e^{gamma_C} (B, N / C, H, d_k) in fp32.

    The score GEMMs sum over d_k in `channel_passes` passes, so their operands hold d_k /
    channel_passes channels: at C = 64, d_k = 128, two passes bring shared memory to 105 KiB, two
    blocks per SM. N must be a multiple of chunk_size (the wrapper pads), chunk_size of SUB_BLOCK,
    d_k of 16 * channel_passes. threads=None takes default_prepare_threads(chunk_size).
    any_gate=False leaves out the exact path for sub-blocks past the operands' range
    (anchored_scores_macro): the kernel as it was before it, to time what the path costs.
    value_flags=True adds a parameter Flags (FLAG_COUNT,) int32 after Beta (outputs from index 6 on)
    and checks every g and beta as it is loaded (flag_bad_values_macro): forward's default kernel.
    Without it the program has no Flags: stage 5's exercise builds that one, and checks="off" runs it.
    solve_outputs=True adds two fp32 outputs after e^{gamma_C}: A_kk (B, N, H, C), strictly lower, and
    T = (I + L)^{-1} (B, N, H, C), row r of a chunk in token r's row as A_qk: stage 6's intra kernel
    reads them, so the backward differentiates the A_kk and T that the forward used, bit for bit.

    From the loads on, the body is the macros below (stage 7's varlen prepare runs the same ones).
    """
    import tilelang.language as T

    threads = threads or default_prepare_threads(chunk_size)
    C, sub = chunk_size, SUB_BLOCK
    accum_dtype = "float32"
    num_chunks = N // C
    channels_per_pass = d_k // channel_passes
    diagonal_dtype, slab_dtype = score_operand_dtypes(dtype)
    flag_bad_values = flag_bad_values_macro(C, d_k)
    cumulative_gates = cumulative_gates_macro(C, d_k)
    anchored_scores = anchored_scores_macro(C, channel_passes, channels_per_pass, diagonal_dtype, any_gate)
    block_inverse = block_inverse_macro(C)
    wy_outputs = wy_outputs_macro(C)

    @T.macro
    def prepare(Q, K, V, G, Beta, Flags, W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay, A_kk, Inverse):
        with T.Kernel(num_chunks, B * H, threads=threads) as (i_c, i_bh):
            b, h = i_bh // H, i_bh % H
            t0 = i_c * C

            Q_s = T.alloc_shared((C, d_k), dtype)
            K_s = T.alloc_shared((C, d_k), dtype)
            gamma_s = T.alloc_shared((C, d_k), accum_dtype)
            beta_s = T.alloc_shared((C,), accum_dtype)
            # the score GEMMs' operands (anchored_scores_macro): decay from the anchor to the row, and
            # from the column to the anchor, in the types score_operand_dtypes gives
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

            T.copy(Q[b, t0:t0 + C, h, :], Q_s)
            T.copy(K[b, t0:t0 + C, h, :], K_s)
            T.copy(Beta[b, t0:t0 + C, h], beta_s)
            T.copy(G[b, t0:t0 + C, h, :], gamma_s)  # all loads in flight at once, then the sum on chip
            if Flags is not None:  # value_flags: the gates and betas checked as they arrive
                flag_bad_values(gamma_s, beta_s, Flags)
            cumulative_gates(gamma_s)

            if A_kk is None:
                anchored_scores(Q_s, K_s, gamma_s, beta_s, Q_row_s, K_row_s, K_col_s, Q_slab_s, K_slab_row_s,
                                K_slab_col_s, kk_f, qk_f, kk_slab_f, qk_slab_f, L_s, A_qk_s)
            else:  # solve_outputs: with unit betas the scores give A_kk itself; it goes out, then takes its betas
                unit_betas_s = T.alloc_shared((C,), accum_dtype)
                for r in T.Parallel(C):
                    unit_betas_s[r] = 1
                anchored_scores(Q_s, K_s, gamma_s, unit_betas_s, Q_row_s, K_row_s, K_col_s, Q_slab_s, K_slab_row_s,
                                K_slab_col_s, kk_f, qk_f, kk_slab_f, qk_slab_f, L_s, A_qk_s)
                T.copy(L_s, A_kk[b, t0:t0 + C, h, :])
                for r, j in T.Parallel(C, C):
                    L_s[r, j] = L_s[r, j] * beta_s[j]  # the product the scores form with beta: the same bits
            # one store of whole rows (TMA), where writing from the fragments scattered 2-byte stores
            T.copy(A_qk_s, A_qk[b, t0:t0 + C, h, :])
            # --8<-- [end:prepare_setup]

            # --8<-- [start:prepare_decayed]
            # the last reads of gamma and Q: the recurrence's decayed operands, and K e^gamma (in its
            # own buffer: written in place, K_s cost a barrier per unrolled step)
            for r, d in T.Parallel(C, d_k):
                decay_from_start = T.exp2(gamma_s[r, d] * LOG2_E)
                Q_decayed[b, t0 + r, h, d] = Q_s[r, d] * decay_from_start
                K_to_chunk_end[b, t0 + r, h, d] = K_s[r, d] * T.exp2((gamma_s[C - 1, d] - gamma_s[r, d]) * LOG2_E)
                Kg_s[r, d] = K_s[r, d] * decay_from_start
            for d in T.Parallel(d_k):
                Chunk_decay[b, i_c, h, d] = T.exp2(gamma_s[C - 1, d] * LOG2_E)
            # loaded this late, V_s can take the bytes of Q_s (TileLang plans shared memory by lifetime)
            T.copy(V[b, t0:t0 + C, h, :], V_s)

            block_inverse(L_s, T_s, T_diag_s, merge_s, block_row_f)
            if Inverse is not None:
                T.copy(T_s, Inverse[b, t0:t0 + C, h, :])
            wy_outputs(T_s, beta_s, A_hat_s, Kg_s, V_s, w_f, u_f, W_s, U_s)
            T.copy(W_s, W[b, t0:t0 + C, h, :])
            T.copy(U_s, U[b, t0:t0 + C, h, :])
            # --8<-- [end:prepare_decayed]


    # one body, four signatures (a TileLang program's parameters are fixed where it is written):
    # with or without Flags after Beta, with or without A_kk and T after Chunk_decay
    if value_flags and solve_outputs:  # stage 6's backward, checks="device"
        @T.prim_func
        def kda_prepare(
            Q: T.Tensor((B, N, H, d_k), dtype),
            K: T.Tensor((B, N, H, d_k), dtype),
            V: T.Tensor((B, N, H, d_v), dtype),
            G: T.Tensor((B, N, H, d_k), accum_dtype),
            Beta: T.Tensor((B, N, H), accum_dtype),
            Flags: T.Tensor((FLAG_COUNT,), "int32"),
            W: T.Tensor((B, N, H, d_k), dtype),
            U: T.Tensor((B, N, H, d_v), dtype),
            Q_decayed: T.Tensor((B, N, H, d_k), dtype),
            K_to_chunk_end: T.Tensor((B, N, H, d_k), dtype),
            A_qk: T.Tensor((B, N, H, C), dtype),
            Chunk_decay: T.Tensor((B, num_chunks, H, d_k), accum_dtype),
            A_kk: T.Tensor((B, N, H, C), accum_dtype),
            Inverse: T.Tensor((B, N, H, C), accum_dtype),
        ):
            prepare(Q, K, V, G, Beta, Flags, W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay, A_kk, Inverse)
    elif solve_outputs:  # stage 6's backward, checks="off" or "host"
        @T.prim_func
        def kda_prepare(
            Q: T.Tensor((B, N, H, d_k), dtype),
            K: T.Tensor((B, N, H, d_k), dtype),
            V: T.Tensor((B, N, H, d_v), dtype),
            G: T.Tensor((B, N, H, d_k), accum_dtype),
            Beta: T.Tensor((B, N, H), accum_dtype),
            W: T.Tensor((B, N, H, d_k), dtype),
            U: T.Tensor((B, N, H, d_v), dtype),
            Q_decayed: T.Tensor((B, N, H, d_k), dtype),
            K_to_chunk_end: T.Tensor((B, N, H, d_k), dtype),
            A_qk: T.Tensor((B, N, H, C), dtype),
            Chunk_decay: T.Tensor((B, num_chunks, H, d_k), accum_dtype),
            A_kk: T.Tensor((B, N, H, C), accum_dtype),
            Inverse: T.Tensor((B, N, H, C), accum_dtype),
        ):
            prepare(Q, K, V, G, Beta, None, W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay, A_kk, Inverse)
    elif value_flags:  # the forward's default
        @T.prim_func
        def kda_prepare(
            Q: T.Tensor((B, N, H, d_k), dtype),
            K: T.Tensor((B, N, H, d_k), dtype),
            V: T.Tensor((B, N, H, d_v), dtype),
            G: T.Tensor((B, N, H, d_k), accum_dtype),
            Beta: T.Tensor((B, N, H), accum_dtype),
            Flags: T.Tensor((FLAG_COUNT,), "int32"),
            W: T.Tensor((B, N, H, d_k), dtype),
            U: T.Tensor((B, N, H, d_v), dtype),
            Q_decayed: T.Tensor((B, N, H, d_k), dtype),
            K_to_chunk_end: T.Tensor((B, N, H, d_k), dtype),
            A_qk: T.Tensor((B, N, H, C), dtype),
            Chunk_decay: T.Tensor((B, num_chunks, H, d_k), accum_dtype),
        ):
            prepare(Q, K, V, G, Beta, Flags, W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay, None, None)
    else:  # the kernel as stage 5's exercise builds it
        @T.prim_func
        def kda_prepare(
            Q: T.Tensor((B, N, H, d_k), dtype),
            K: T.Tensor((B, N, H, d_k), dtype),
            V: T.Tensor((B, N, H, d_v), dtype),
            G: T.Tensor((B, N, H, d_k), accum_dtype),
            Beta: T.Tensor((B, N, H), accum_dtype),
            W: T.Tensor((B, N, H, d_k), dtype),
            U: T.Tensor((B, N, H, d_v), dtype),
            Q_decayed: T.Tensor((B, N, H, d_k), dtype),
            K_to_chunk_end: T.Tensor((B, N, H, d_k), dtype),
            A_qk: T.Tensor((B, N, H, C), dtype),
            Chunk_decay: T.Tensor((B, num_chunks, H, d_k), accum_dtype),
        ):
            prepare(Q, K, V, G, Beta, None, W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay, None, None)

    return kda_prepare


# --8<-- [start:value_flags]
def flag_bad_values_macro(C, d_k):
    """The macro flag_bad_values(gamma_s, beta_s, Flags): a chunk's log gates (C, d_k) and betas (C,)
    fp32 in shared memory, as loaded (before cumulative_gates), checked on the device: a g that is
    not finite and <= 0 sets Flags[BAD_GATE], a beta outside [0, 1] or NaN Flags[BAD_BETA]
    (stages.common.device_checks). Rows past a sequence's end are loaded as zeros, good values, so
    padding never sets a flag. Nothing is written but a 1 into Flags, and only by a bad value."""
    import tilelang.language as T

    @T.macro
    def flag_bad_values(gamma_s, beta_s, Flags):
        for r, d in T.Parallel(C, d_k):
            if bad_gate(gamma_s[r, d]):  # every lane that finds one writes the same 1
                Flags[BAD_GATE] = 1
        for r in T.Parallel(C):
            if bad_beta(beta_s[r]):
                Flags[BAD_BETA] = 1

    return flag_bad_values
# --8<-- [end:value_flags]


# --8<-- [start:prepare_gates]
def cumulative_gates_macro(C, d_k):
    """The macro cumulative_gates(gamma_s): the log gates of a chunk (C, d_k) fp32 in shared memory
    become their cumulative sums from the chunk start, gamma[r] = g[0] + ... + g[r], in place."""
    import tilelang.language as T

    @T.macro
    def cumulative_gates(gamma_s):
        # one thread per channel walks the rows in a register (T.cumsum lowers to one warp per
        # column, whose strided reads all hit one smem bank)
        for d in T.Parallel(d_k):
            running = T.alloc_var("float32")
            running = 0
            for r in T.unroll(C):
                running += gamma_s[r, d]
                gamma_s[r, d] = running

    return cumulative_gates
# --8<-- [end:prepare_gates]


# --8<-- [start:prepare_scores]
def anchored_scores_macro(C, channel_passes, channels_per_pass, diagonal_dtype, any_gate=True):
    """The macro anchored_scores(...): from a chunk's Q_s, K_s (C, d_k), gamma_s (cumulative) and
    beta_s, L = A_kk diag(beta) (strictly lower) into L_s and A_qk (lower, with its diagonal) into
    A_qk_s, through GEMMs of anchored operands (the row, column and slab buffers, of channels_per_pass
    channels, and their fp32 accumulators kk_f, qk_f (C, C), kk_slab_f, qk_slab_f (C, SUB_BLOCK)).

    Any gate: a diagonal sub-block whose gates span more than FAST_SPAN_LOG[diagonal_dtype] (its
    anchored factors would leave the operands' range) takes its block again term by term, in fp32
    (exact_diagonal_block); the others run the anchored GEMMs alone. any_gate=False builds the
    anchored GEMMs alone (gates outside the span then overflow)."""
    import tilelang.language as T

    sub = SUB_BLOCK
    d_k = channel_passes * channels_per_pass
    blocks = C // sub
    flag_wide_spans = flag_wide_spans_macro(C, d_k, FAST_SPAN_LOG[diagonal_dtype])
    exact_diagonal_block = exact_diagonal_block_macro(d_k)

    @T.macro
    def anchored_scores(Q_s, K_s, gamma_s, beta_s, Q_row_s, K_row_s, K_col_s, Q_slab_s, K_slab_row_s, K_slab_col_s,
                        kk_f, qk_f, kk_slab_f, qk_slab_f, L_s, A_qk_s):
        # a flag per sub-block in shared memory, so that every thread takes one branch below
        if any_gate:
            exact_s = T.alloc_shared((blocks,), "int32")
            flag_wide_spans(gamma_s, exact_s)

        # diagonal sub-blocks: rows and columns anchored at the middle row of their sub-block;
        # each element reads gamma and K once and takes one exp2 for each direction
        for channel_pass in range(channel_passes):
            d0 = channel_pass * channels_per_pass
            for r, d in T.Parallel(C, channels_per_pass):
                from_anchor = (gamma_s[r, d0 + d] - gamma_s[(r // sub) * sub + sub // 2, d0 + d]) * LOG2_E
                key = K_s[r, d0 + d]
                to_row = T.exp2(from_anchor)
                Q_row_s[r, d] = Q_s[r, d0 + d] * to_row
                K_row_s[r, d] = key * to_row
                K_col_s[r, d] = key * T.exp2(-from_anchor)
            T.gemm(K_row_s, K_col_s, kk_f, transpose_B=True, clear_accum=channel_pass == 0)
            T.gemm(Q_row_s, K_col_s, qk_f, transpose_B=True, clear_accum=channel_pass == 0)
        for r, j in T.Parallel(C, C):
            same_block = r // sub == j // sub
            L_s[r, j] = T.if_then_else(same_block and j < r, kk_f[r, j] * beta_s[j], 0)
            if j // sub >= r // sub:  # the diagonal blocks and the zeros right of them; the slabs fill the rest
                A_qk_s[r, j] = T.if_then_else(j <= r, qk_f[r, j], 0)
        # the sub-blocks out of the operands' range (their GEMM entries above may be inf or NaN, kept
        # to their own block by the mask) again, term by term: a uniform branch, so the chunks in range
        # run one test per sub-block and nothing else
        if any_gate:
            for blk in T.serial(blocks):
                if exact_s[blk] == 1:
                    exact_diagonal_block(Q_s, K_s, gamma_s, beta_s, L_s, A_qk_s, blk * sub)

        # off-diagonal: one slab of sub columns at a time, anchored at the first row below it;
        # rows above the slab keep stale operands: their GEMM rows are computed and never stored.
        # The slabs are unrolled when the program is built (a tuple, not a loop), so each pass has
        # a static extent and TileLang vectorizes it: one pass per slab writes the column operand
        # (the sub rows above s0) and the row operands (rows s0 on)
        for s0 in tuple(range(sub, C, sub)):
            for channel_pass in range(channel_passes):
                d0 = channel_pass * channels_per_pass
                for r, d in T.Parallel(C - s0 + sub, channels_per_pass):
                    row = s0 - sub + r
                    from_anchor = (gamma_s[row, d0 + d] - gamma_s[s0, d0 + d]) * LOG2_E
                    key = K_s[row, d0 + d]
                    if r >= sub:
                        to_row = T.exp2(from_anchor)  # <= 1
                        Q_slab_s[row, d] = Q_s[row, d0 + d] * to_row
                        K_slab_row_s[row, d] = key * to_row
                    else:
                        K_slab_col_s[r, d] = key * T.exp2(-from_anchor)  # to the anchor: <= 1
                first = channel_pass == 0
                T.gemm(K_slab_row_s, K_slab_col_s, kk_slab_f, transpose_B=True, clear_accum=first)
                T.gemm(Q_slab_s, K_slab_col_s, qk_slab_f, transpose_B=True, clear_accum=first)
            for r, j in T.Parallel(C, sub):
                if r >= s0:
                    L_s[r, s0 - sub + j] = kk_slab_f[r, j] * beta_s[s0 - sub + j]
                    A_qk_s[r, s0 - sub + j] = qk_slab_f[r, j]

    return anchored_scores
# --8<-- [end:prepare_scores]


# --8<-- [start:wide_spans]
def flag_wide_spans_macro(C, d_k, largest_span):
    """The macro flag_wide_spans(gamma_s, exact_s): from a chunk's cumulative gates gamma_s (C, d_k)
    fp32, exact_s[P] = 1 (int32, one per SUB_BLOCK-row sub-block) where the diagonal sub-block P's
    middle-row anchored factors span more than largest_span e-folds in some channel, else 0.

    A sub-block's largest anchored factor is e^span, span the larger of gamma_first - gamma_middle
    (its first row's) and gamma_middle - gamma_last (its last column's): every other row's and
    column's lies between them. Stage 5's scores and stage 6's intra kernel test the flags."""
    import tilelang.language as T

    sub = SUB_BLOCK
    blocks = C // sub

    @T.macro
    def flag_wide_spans(gamma_s, exact_s):
        for blk in T.Parallel(blocks):
            exact_s[blk] = 0
        for blk, d in T.Parallel(blocks, d_k):
            middle = gamma_s[blk * sub + sub // 2, d]
            span = T.max(gamma_s[blk * sub, d] - middle, middle - gamma_s[blk * sub + sub - 1, d])
            if span > largest_span:  # every lane that finds one writes the same 1
                exact_s[blk] = 1

    return flag_wide_spans
# --8<-- [end:wide_spans]


# --8<-- [start:prepare_exact_block]
def exact_diagonal_block_macro(d_k):
    """The macro exact_diagonal_block(Q_s, K_s, gamma_s, beta_s, L_s, A_qk_s, first): the diagonal
    sub-block of rows and columns first .. first + SUB_BLOCK - 1 of L = A_kk diag(beta) into L_s and
    of A_qk into A_qk_s, as their definition, A[r, j] = sum_d x_r[d] k_j[d] e^{gamma_r[d] - gamma_j[d]}
    (j <= r): each decay is taken whole, so it is <= 1 at any gate, and summed in fp32 on the CUDA
    cores (d_k multiply-adds per entry and score, one exp2 shared by the two scores)."""
    import tilelang.language as T

    sub = SUB_BLOCK

    @T.macro
    def exact_diagonal_block(Q_s, K_s, gamma_s, beta_s, L_s, A_qk_s, first):
        for r, j in T.Parallel(sub, sub):
            row, col = first + r, first + j
            key_score = T.alloc_var("float32")
            key_score = 0
            query_score = T.alloc_var("float32")
            query_score = 0
            for step in T.serial(d_k):
                # lane j starts at channel j: the 16 columns' rows of a warp then lie in different banks
                d = (step + j) % d_k
                # j <= r: gamma_r <= gamma_j and the decay is <= 1; above the diagonal (masked below)
                # the exponent is clamped at 0 so that nothing overflows there either
                decay = T.exp2(T.min(gamma_s[row, d] - gamma_s[col, d], 0) * LOG2_E)
                decayed_key = T.cast(K_s[col, d], "float32") * decay
                key_score += T.cast(K_s[row, d], "float32") * decayed_key
                query_score += T.cast(Q_s[row, d], "float32") * decayed_key
            L_s[row, col] = T.if_then_else(j < r, key_score * beta_s[col], 0)
            A_qk_s[row, col] = T.if_then_else(j <= r, query_score, 0)

    return exact_diagonal_block
# --8<-- [end:prepare_exact_block]


# --8<-- [start:prepare_inverse]
def block_inverse_macro(C):
    """The macro block_inverse(L_s, T_s, T_diag_s, merge_s, block_row_f): T = (I + L)^{-1} into T_s
    (C, C) fp32 shared, for L (C, C) strictly lower in L_s, by SUB_BLOCK x SUB_BLOCK blocks. T_diag_s
    (C, SUB_BLOCK) gets the diagonal blocks stacked; merge_s (SUB_BLOCK, C) shared and block_row_f
    (SUB_BLOCK, C) fragment are room for one block row. Stages 5, 6 and 7 invert with it."""
    import tilelang.language as T

    sub = SUB_BLOCK

    @T.macro
    def block_inverse(L_s, T_s, T_diag_s, merge_s, block_row_f):
        # diagonal blocks of T = (I + L)^{-1}: forward substitution, one lane per (block, column);
        # each lane reads back only the rows it wrote itself, and sums in a register
        T.clear(T_s)
        for r in T.serial(sub):
            for blk, col in T.Parallel(C // sub, sub):
                i = blk * sub + r
                solved = T.alloc_var("float32")
                solved = T.if_then_else(col == r, 1, 0)
                for j in T.serial(r):
                    solved -= L_s[i, blk * sub + j] * T_s[blk * sub + j, blk * sub + col]
                T_s[i, blk * sub + col] = solved
                T_diag_s[i, col] = solved
        # block row P from the rows above it: T[P, :P] = -T[P, P] (L[P, :P] T[:P, :P]), as two TF32
        # tensor-core GEMMs over all C columns (a GEMM's sizes must be static; P is a loop variable).
        # Only the columns left of P are kept: there L[P, :] T = L[P, :P] T[:P, :P], because block
        # row P of T_s is still zero left of its diagonal block when the first GEMM reads it
        for p0 in range(sub, C, sub):
            T.gemm(L_s[p0:p0 + sub, :], T_s, block_row_f, clear_accum=True)
            T.copy(block_row_f, merge_s)
            T.gemm(T_diag_s[p0:p0 + sub, :], merge_s, block_row_f, clear_accum=True)
            for r, c in T.Parallel(sub, C):
                if c < p0:
                    T_s[p0 + r, c] = -block_row_f[r, c]

    return block_inverse
# --8<-- [end:prepare_inverse]


# --8<-- [start:prepare_outputs]
def wy_outputs_macro(C):
    """The macro wy_outputs(...): W = diag(beta) T (K e^gamma) and U = diag(beta) T V from T_s, beta_s,
    Kg_s and V_s, staged in W_s and U_s (through the fp32 fragments w_f, u_f) for stores of whole rows."""
    import tilelang.language as T

    @T.macro
    def wy_outputs(T_s, beta_s, A_hat_s, Kg_s, V_s, w_f, u_f, W_s, U_s):
        for r, c in T.Parallel(C, C):
            A_hat_s[r, c] = T_s[r, c] * beta_s[r]  # diag(beta) T, after the inverse
        T.gemm(A_hat_s, Kg_s, w_f, clear_accum=True)
        T.gemm(A_hat_s, V_s, u_f, clear_accum=True)
        # through shared memory, then whole-row stores (TMA): the fragments' own stores are 4-byte
        # writes spread over 8 rows, about 8 L1 wavefronts per instruction
        T.copy(w_f, W_s)
        T.copy(u_f, U_s)

    return wy_outputs
# --8<-- [end:prepare_outputs]


# --8<-- [start:recurrence_program]
def build_recurrence_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=DEFAULT_BLOCK_DV,
                             dtype="float16", num_stages=2, threads=128):
    """The recurrence kernel: the prepare kernel's outputs and S_0^T (B, H, d_k, d_v) fp32
    -> o (B, N, H, d_v) in `dtype` and the final state S^T (B, H, d_k, d_v) in fp32.

    N must be a multiple of chunk_size, block_dv must divide d_v.
    """
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    num_chunks = N // C
    chunk_output = chunk_output_macro(C, block_dv)
    advance_state = advance_state_macro(d_k, block_dv)

    @T.prim_func
    def kda_recurrence(
        W: T.Tensor((B, N, H, d_k), dtype),
        U: T.Tensor((B, N, H, d_v), dtype),
        Q_decayed: T.Tensor((B, N, H, d_k), dtype),
        K_to_chunk_end: T.Tensor((B, N, H, d_k), dtype),
        A_qk: T.Tensor((B, N, H, C), dtype),
        Chunk_decay: T.Tensor((B, num_chunks, H, d_k), accum_dtype),
        Initial_state: T.Tensor((B, H, d_k, d_v), accum_dtype),
        O: T.Tensor((B, N, H, d_v), dtype),
        Final_state: T.Tensor((B, H, d_k, d_v), accum_dtype),
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv

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

            T.copy(Initial_state[b, h, :, v0:v0 + block_dv], S_f)  # once, outside the chunk loop
            for i_c in T.Pipelined(num_chunks, num_stages=num_stages):
                t0 = i_c * C
                T.copy(W[b, t0:t0 + C, h, :], W_s)
                T.copy(U[b, t0:t0 + C, h, v0:v0 + block_dv], U_s)
                T.copy(Q_decayed[b, t0:t0 + C, h, :], Q_decayed_s)
                T.copy(K_to_chunk_end[b, t0:t0 + C, h, :], K_to_chunk_end_s)
                T.copy(A_qk[b, t0:t0 + C, h, :], A_qk_s)
                T.copy(Chunk_decay[b, i_c, h, :], chunk_decay_s)

                chunk_output(S_f, S_s, W_s, U_s, Q_decayed_s, A_qk_s, V_new_f, V_new_s, acc_o, O_s)
                # through shared memory, then one TMA store: from the fragment, o went out in 4-byte
                # stores spread over 8 rows
                T.copy(O_s, O[b, t0:t0 + C, h, v0:v0 + block_dv])
                advance_state(S_f, chunk_decay_s, K_to_chunk_end_s, V_new_s)
            T.copy(S_f, Final_state[b, h, :, v0:v0 + block_dv])

    return kda_recurrence


def chunk_output_macro(C, block_dv):
    """The macro chunk_output(...): one chunk's output from the state S^T (S_f, d_k x block_dv fp32) it
    starts from and the prepare kernel's operands in shared memory, into O_s (C, block_dv); V_new_s
    keeps the pseudo-values for the state's update (advance_state)."""
    import tilelang.language as T

    @T.macro
    def chunk_output(S_f, S_s, W_s, U_s, Q_decayed_s, A_qk_s, V_new_f, V_new_s, acc_o, O_s):
        # the pseudo-values V_new = U - W S^T (S^T cast to the input dtype first)
        T.copy(S_f, S_s)
        T.gemm(W_s, S_s, V_new_f, clear_accum=True)
        for r, j in T.Parallel(C, block_dv):
            V_new_f[r, j] = U_s[r, j] - V_new_f[r, j]
        T.copy(V_new_f, V_new_s)

        # inter-chunk term, then the intra-chunk term added into the same accumulator
        T.gemm(Q_decayed_s, S_s, acc_o, clear_accum=True)
        T.gemm(A_qk_s, V_new_s, acc_o)
        T.copy(acc_o, O_s)

    return chunk_output


def advance_state_macro(d_k, block_dv):
    """The macro advance_state(S_f, chunk_decay_s, K_to_chunk_end_s, V_new_s): the state past one
    chunk, S^T <- Diag(e^{gamma_C}) S^T + (K e^{gamma_C - gamma})^T V_new, once the chunk's output is
    out (stages 5, 6 and 7)."""
    import tilelang.language as T

    @T.macro
    def advance_state(S_f, chunk_decay_s, K_to_chunk_end_s, V_new_s):
        # only now does the state move past this chunk: decay row by row, then the GEMM
        for d, j in T.Parallel(d_k, block_dv):
            S_f[d, j] *= chunk_decay_s[d]
        T.gemm(K_to_chunk_end_s, V_new_s, S_f, transpose_A=True)

    return advance_state
# --8<-- [end:recurrence_program]


@functools.cache
def compiled_prepare(B, N, H, d_k, d_v, chunk_size, dtype, threads, solve_outputs=False):
    """The prepare kernel compiled for the GPU (its outputs allocated by the call): made once per shape.
    Without the value flags: forward's checks="host" and "off", the benchmarks' kernels alone;
    solve_outputs=True (A_kk and T too): stage 6's backward."""
    import tilelang

    program = build_in_turn(build_prepare_program, B, N, H, d_k, d_v, chunk_size, dtype, threads,
                            solve_outputs=solve_outputs)
    return tilelang.compile(program, out_idx=prepare_outputs(value_flags=False, solve_outputs=solve_outputs),
                            target="cuda")


@functools.cache
def compiled_flagged_prepare(B, N, H, d_k, d_v, chunk_size, dtype, threads, solve_outputs=False):
    """The prepare kernel that also takes Flags after beta and flags bad values (value_flags=True):
    forward's default, checks="device" (and the backward's, with solve_outputs). Made once per shape."""
    import tilelang

    program = build_in_turn(build_prepare_program, B, N, H, d_k, d_v, chunk_size, dtype, threads, value_flags=True,
                            solve_outputs=solve_outputs)
    return tilelang.compile(program, out_idx=prepare_outputs(value_flags=True, solve_outputs=solve_outputs),
                            target="cuda")


def prepare_outputs(value_flags=False, solve_outputs=False):
    """The indices of build_prepare_program's outputs among its parameters (out_idx): six (eight with
    solve_outputs) after the five inputs and, with value_flags, Flags."""
    first = 6 if value_flags else 5
    return list(range(first, first + (8 if solve_outputs else 6)))


@functools.cache
def compiled_recurrence(B, N, H, d_k, d_v, chunk_size, block_dv, dtype, num_stages, threads):
    """The recurrence kernel compiled for the GPU (o and the final state allocated by the call): made once per shape."""
    import tilelang

    program = build_in_turn(build_recurrence_program, B, N, H, d_k, d_v, chunk_size, block_dv, dtype, num_stages,
                            threads)
    return tilelang.compile(program, out_idx=[7, 8], target="cuda")


# --8<-- [start:forward]
def forward(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
            chunk_size: int = DEFAULT_CHUNK_SIZE, block_dv: int | None = None, num_stages: int = 2,
            threads: int = 128, prepare_threads: int | None = None, initial_state: "torch.Tensor | None" = None,
            output_final_state: bool = False, checks: str = "device",
            return_prepared: bool = False) -> "torch.Tensor | tuple[torch.Tensor, ...]":
    """Run both kernels on CUDA tensors q, k: (B, N, H, d_k), v: (B, N, H, d_v) (fp16 or bf16),
    g: (B, N, H, d_k) fp32 log gates (<= 0), beta: (B, N, H) fp32 in [0, 1].

    block_dv=None takes default_block_dv for this shape and GPU.
    initial_state: S_0^T (B, H, d_k, d_v) fp32 or None (zeros). Returns o: (B, N, H, d_v) in the
    input dtype, and with output_final_state also the final state S^T (B, H, d_k, d_v) fp32.
    N need not be a multiple of chunk_size: the sequence is zero-padded, which is exact (see
    reference.kernel_mirror).

    Shapes, dtypes and devices are checked here, on the host. g's and beta's values (finite g <= 0,
    beta in [0, 1]) by `checks`: "device" (the default) leaves them to the prepare kernel, which flags
    a bad one as it loads it (stages.common.device_checks: `raise_if_flagged(q.device)` reports it
    where the caller synchronizes anyway); the call has no host sync and can be captured in a CUDA
    graph. "host" reads them to the host first and raises before any kernel runs (a pass over both
    and a device sync: the mode to debug a caller with). "off": the caller vouches for them, and the
    kernel runs without the flags.

    return_prepared: also return, last, the prepare kernel's eight outputs with solve_outputs (W, U,
    Q e^gamma, K e^{gamma_C - gamma}, A_qk, e^{gamma_C}, A_kk, T, on the tokens padded to a multiple of
    chunk_size), which stage 6's backward would otherwise compute again (chunk_kda's
    disable_recompute); the recurrence reads the first six.
    """
    B, N, H, d_k, d_v = check_forward_inputs(q, k, v, g, beta, initial_state, chunk_size, block_dv, checks)
    if block_dv is None:
        block_dv = default_block_dv(B, H, d_v, streaming_multiprocessors(q.device))

    N_padded = padded_length(N, chunk_size)
    q, k, v, g, beta = pad_tokens(N_padded, q, k, v, g, beta)
    if initial_state is None:
        initial_state = zero_state(B, H, d_k, d_v, q.device)
    value_flags = checks == "device"
    compile_prepare = compiled_flagged_prepare if value_flags else compiled_prepare
    shape = (B, N_padded, H, d_k, d_v, chunk_size, dtype_name(q), prepare_threads)
    # solve_outputs only when asked: the other calls share the cache entry (and compile) of the benchmarks'
    prepare = compile_prepare(*shape, solve_outputs=True) if return_prepared else compile_prepare(*shape)
    recurrence = compiled_recurrence(B, N_padded, H, d_k, d_v, chunk_size, block_dv, dtype_name(q), num_stages,
                                      threads)
    flags = (flags_for(q.device),) if value_flags else ()
    prepared = prepare(q, k, v, g, beta, *flags)
    o, final_state = recurrence(*prepared[:6], initial_state)
    outputs = (o[:, :N], final_state) if output_final_state else (o[:, :N],)
    if return_prepared:
        outputs += (prepared,)
    return outputs if len(outputs) > 1 else outputs[0]
# --8<-- [end:forward]


# --8<-- [start:checks]
def check_forward_inputs(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor",
                         beta: "torch.Tensor", initial_state: "torch.Tensor | None" = None,
                         chunk_size: int = DEFAULT_CHUNK_SIZE, block_dv: int | None = None,
                         checks: str = "device") -> tuple[int, int, int, int, int]:
    """Every check of `forward`'s arguments (see its docstring); returns (B, N, H, d_k, d_v).

    In this order: the checks mode; what the tensors' types, shapes and dtypes tell (check_token_inputs,
    the initial state) and the tile sizes (check_kernel_sizes); then, with checks="host", what only
    their values tell (check_gate_values: a NaN, a gate above 0, beta outside [0, 1]; one pass and one
    device sync); the device last, so that every other mistake shows, and is tested, on a machine
    without a GPU. Any gate <= 0 runs: there is no range to check (anchored_scores_macro).
    """
    check_mode(checks)
    B, N, H, d_k, d_v = check_token_inputs(q, k, v, g, beta)
    check_state("initial_state", initial_state, (B, H, d_k, d_v), "(B, H, d_k, d_v)")
    check_kernel_sizes(d_k, d_v, chunk_size, block_dv or DEFAULT_BLOCK_DV)
    if checks == "host":
        check_gate_values(g, beta)
    check_on_cuda({"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state})
    return B, N, H, d_k, d_v


def check_token_inputs(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor",
                       beta: "torch.Tensor", length: str = "N") -> tuple[int, int, int, int, int]:
    """q, k: (B, N, H, d_k) and v: (B, N, H, d_v), of one dtype, fp16 or bf16; g: (B, N, H, d_k) and
    beta: (B, N, H) in fp32; all contiguous tensors. Types, shapes and dtypes only: no value is read.
    `length` names the token axis in the messages (T in stage 7's prefill). Returns (B, N, H, d_k, d_v)."""
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate("g", g, (B, N, H, d_k), f"(B, {length}, H, d_k)")
    check_gate("beta", beta, (B, N, H), f"(B, {length}, H)")
    return B, N, H, d_k, d_v


def check_state(name: str, state: "torch.Tensor | None", shape: tuple[int, ...], axes: str) -> None:
    """state (an initial state, or the gradient of a final state) is None or a contiguous fp32 tensor of
    the given shape: S^T in the kernel layout, `axes` naming its axes, "(B, H, d_k, d_v)" say."""
    if state is not None:
        check_gate(name, state, shape, axes)


def check_kernel_sizes(d_k: int, d_v: int, chunk_size: int, block_dv: int) -> None:
    """The sizes the kernels are built for: the tensor cores' tile sizes (stages.common), chunks of 2 or
    4 sub-blocks for the block inverse, and d_k in CHANNEL_PASSES channel passes of whole 16-wide GEMM
    steps."""
    if chunk_size not in (2 * SUB_BLOCK, 4 * SUB_BLOCK):
        raise ValueError(f"chunk_size must be {2 * SUB_BLOCK} or {4 * SUB_BLOCK}, got {chunk_size}")
    if d_k % (16 * CHANNEL_PASSES):
        raise ValueError(f"d_k must be a multiple of {16 * CHANNEL_PASSES} ({CHANNEL_PASSES} channel passes "
                         f"of the score GEMMs), got {d_k}")
    check_tile_sizes(d_k, d_v, chunk_size, block_dv)
# --8<-- [end:checks]


# --8<-- [start:default_block_dv]
def default_block_dv(B: int, H: int, d_v: int, num_sms: int) -> int:
    """The recurrence's columns a program: 64 where B * H * d_v / 64 programs still give each of the
    GPU's num_sms SMs one, else DEFAULT_BLOCK_DV (32).

    Every program of one (batch, head) reads the same W, Q e^gamma, K e^{gamma_C - gamma} and A_qk, so
    64 columns halve what the recurrence reads; but each program walks all N / C chunks in a row, so
    fewer programs than SMs leave SMs idle for the whole kernel (the stage 5 page times both sides).
    """
    wide = 2 * DEFAULT_BLOCK_DV
    return wide if d_v % wide == 0 and B * H * (d_v // wide) >= num_sms else DEFAULT_BLOCK_DV
# --8<-- [end:default_block_dv]


@functools.cache
def streaming_multiprocessors(device: "torch.device") -> int:
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count


def zero_state(B: int, H: int, d_k: int, d_v: int, device: "torch.device") -> "torch.Tensor":
    """S_0^T = 0 (B, H, d_k, d_v) fp32 on `device`: one tensor per shape and device, made once.

    Shared safely because it never leaves forward and nothing writes it: the recurrence kernel only
    reads Initial_state. While a CUDA graph is being captured a fresh tensor is made instead (one
    made then would live in the graph's private memory pool, not beside the others).
    """
    import torch

    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros((B, H, d_k, d_v), dtype=torch.float32, device=device)
    return _cached_zero_state(B, H, d_k, d_v, device)


@functools.lru_cache(maxsize=8)  # a few shapes: a long-lived caller with many batch sizes holds at most 8
def _cached_zero_state(B, H, d_k, d_v, device):
    import torch

    with torch.inference_mode(False):  # a normal tensor even when first made under inference_mode
        return torch.zeros((B, H, d_k, d_v), dtype=torch.float32, device=device)


def default_prepare_threads(chunk_size):
    """As many warps as the C x 16 slab GEMMs can share (one per 16 x 8 tile): 256 threads at C = 64.

    The prepare kernel's elementwise passes and merges are most of its work; more warps split them.
    """
    return 32 * (chunk_size // 16) * (SUB_BLOCK // 8)


@functools.cache  # the page's report and the compile test share one nvcc run
def compile_report(kernel="recurrence", B=1, N=4096, H=8, d_k=128, d_v=128, chunk_size=DEFAULT_CHUNK_SIZE,
                   block_dv=DEFAULT_BLOCK_DV, dtype="float16", value_flags=False):
    """Lower and compile one kernel ("prepare" or "recurrence") for sm_90a without a GPU; value_flags:
    the prepare that flags bad values (forward's default)."""
    check_kernel_sizes(d_k, d_v, chunk_size, block_dv)
    if kernel == "prepare":
        return _compile_report(build_prepare_program(B, N, H, d_k, d_v, chunk_size, dtype, value_flags=value_flags))
    if kernel == "recurrence":
        return _compile_report(build_recurrence_program(B, N, H, d_k, d_v, chunk_size, block_dv, dtype))
    raise ValueError(f"kernel must be 'prepare' or 'recurrence', got {kernel!r}")


def main():
    import torch

    from stages.common.errors import error_report
    from stages.common.inputs import make_inputs
    from stages.s05_fast_kda.reference import recurrent

    for kernel in ("prepare", "recurrence"):
        print(f"{kernel} sm_90a:", compile_report(kernel).summary())
    if not torch.cuda.is_available():
        print("no CUDA device: compile-only")
        return
    x = make_inputs(2, 1024, 4, 128, 128, gate="channel", beta_range=(0.1, 0.9), seed=0)
    expected = recurrent(x.q, x.k, x.v, x.g, x.beta)
    g, beta = (torch.tensor(a, dtype=torch.float32, device="cuda") for a in (x.g, x.beta))
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = (torch.tensor(a, dtype=dtype, device="cuda") for a in (x.q, x.k, x.v))
        o = forward(q, k, v, g, beta)
        print(f"{dtype} kernels vs reference A:", error_report(o, expected))
        try:
            from fla.ops import chunk_kda
        except ImportError:
            continue
        fla_output = chunk_kda(q, k, v, g, beta, scale=1.0)[0]
        print(f"{dtype} FLA chunk_kda vs reference A:", error_report(fla_output, expected))


if __name__ == "__main__":
    main()
