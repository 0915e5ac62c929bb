"""Variants of stage 5's prepare kernel, to time against the committed one in one GPU run.

The run of 2026-11-30 (benchmarks/results/s05_variants.csv) named "committed" the kernel as it was
before commit ee09b80; its fastest variant, staged_all, has been the committed kernel since
(tests/test_s05_variants.py checks that it builds the library's program), so "committed" below means
the kernel that run started from.

    python -m benchmarks.studies.s05_variants --out DIR [--quick] [--variants a,b] [--no-fla]

Each variant is a function with build_prepare_program's parameters and outputs (stages/s05_fast_kda/
kernel.py is not touched). On a GPU the script compiles each variant (a failure is recorded and the
run goes on), checks its six outputs against the committed kernel's on the same bf16 inputs (rel L2
of each) and its o through the committed recurrence against FLA's chunk_kda (if installed, unless
--no-fla), then times the prepare kernel alone (one launch captured as a CUDA graph, replayed under
triton.testing.do_bench, median; 3 interleaved rounds, median over them) at B=1 N=16384 H=32 and
B=8 N=4096 H=16, with the committed recurrence once per shape for the kernels' total. Writes
DIR/variants.csv and prints a table.

Where the time goes in the committed kernel (ncu at B=1 N=16384 H=32: the L1/LSU data pipe 66% busy,
issue 32%, barrier and short-scoreboard stalls), counted per warp from the generated CUDA: the slab
passes of the off-diagonal scores are scalar (their row count C - s0 is a loop variable, so nothing
vectorizes) and their 4-byte gamma reads 4-way bank conflicted, about a quarter of the kernel's
shared-memory wavefronts; W, U and the diagonal A_qk are stored to global memory from the MMA
fragments (4- and 2-byte stores spread over 8 rows, 8 wavefronts per instruction), another sixth; the
pass writing K e^gamma in place carries a __syncthreads in each of its 8 unrolled steps (the barrier
pass cannot prove the swizzled in-place read and write are one thread's); V's load from HBM starts
only after the score passes, so its latency is exposed.
"""

import argparse
import csv
import functools
import statistics
import sys
import time
import traceback
from pathlib import Path

from stages.common.tilelang_tools import LOG2_E
from stages.s05_fast_kda.kernel import CHANNEL_PASSES, DEFAULT_CHUNK_SIZE, SUB_BLOCK, default_prepare_threads

SHAPES = [(1, 16384, 32, 128), (8, 4096, 16, 128)]  # B, N, H, D
QUICK_SHAPES = [(1, 16384, 32, 128)]
ROUNDS, QUICK_ROUNDS = 3, 2
DTYPE = "bfloat16"
PREPARE_OUT = [5, 6, 7, 8, 9, 10]
OUTPUTS = ("w", "u", "q_decayed", "k_to_chunk_end", "a_qk", "chunk_decay")
FIELDS = ["round", "B", "N", "H", "D", "variant", "prepare_ms", "recurrence_ms", "kernels_ms", "fla_ms",
          "compile_s", *[f"rel_l2_{name}" for name in OUTPUTS], "rel_l2_o_vs_fla",
          "rel_l2_o_committed_vs_fla", "error"]


def _build(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
           channel_passes=CHANNEL_PASSES, *, fused_passes=False, unrolled_slabs=False, kg_buffer=False,
           staged_stores=False, staged_a_qk=False, early_v=False, paired_gemms=False, paired_slab_gemms=False,
           fp16_score_operands=False, fp16_slab_operands=False, tf32_diagonal_operands=()):
    """build_prepare_program with switches; all off is the committed kernel, statement for statement.

    fused_passes: each anchored-operand pass reads gamma (and K) once per element and takes one
        exp2 for the row and one for the column operand (the committed passes read gamma three times).
    unrolled_slabs: the slab loop expanded at build time (a Python tuple), so each slab's pass has a
        static extent and vectorizes; one pass per slab and channel pass writes the row operands
        (rows >= s0) and the column operand (the sub rows above s0), C - s0 + sub rows in all.
    kg_buffer: K e^gamma written to its own buffer instead of K_s in place (no barrier per step).
    staged_stores: W and U written to shared memory first (stmatrix), then copied out by TMA stores
        of whole rows (the committed kernel stores them from the MMA fragments).
    staged_a_qk: A_qk too, in A_hat_s's bytes (+8 KiB of shared memory: 113 KiB, two blocks per SM
        exactly fill the H200's 228 KiB).
    early_v: V loaded into registers at the start (its latency hidden behind the score passes),
        moved to shared memory where the committed kernel loads it.
    paired_gemms: GEMMs that share an operand issued together (T.wgmma_gemm, no wait between them)
        and waited for once: K_row K_col^T with Q_row K_col^T on the diagonal blocks, and
        A_hat (K e^gamma) with A_hat V; one wait where there were two.
    paired_slab_gemms: the slabs' two GEMMs likewise.
    fp16_score_operands: with bf16 inputs, the anchored operands of every score GEMM (Q_row, K_row,
        K_col, diagonal blocks and slabs) held in fp16: 10 mantissa bits where bf16 keeps 7, the
        precision of TF32. NOT safe in range: on the diagonal blocks the factor e^{gamma_r - gamma_m}
        of a row r above its block's middle row m (and e^{gamma_m - gamma_c} of a column below it)
        exceeds 1, up to a_min^{-8} for the smallest gate a_min (docs/generated/s05_anchor_range.md:
        about 56 at a_min = 0.5, 709 at 0.3, 6.9e4 at 0.1), and fp16 ends at 65504 where bf16 goes on
        to fp32's 3e38: with gates near 0.1 or below an operand overflows to inf and the scores are nan.
    fp16_slab_operands: with bf16 inputs, the off-diagonal slabs' anchored operands held in fp16, in
        their own buffers (Q_slab_s, K_slab_row_s of (C, channels), K_slab_col_s of (sub, channels));
        the diagonal blocks keep operands in the input dtype. A slab's factors are products of gates,
        all <= 1, so a slab operand is no larger than its q or k (|q|, |k| < 65504, as L2-normalized
        keys and queries are) at any gate; what underflows below fp16's 6e-8 contributes less than
        that to a score.
    tf32_diagonal_operands: the input dtypes (of "float16", "bfloat16") for which the diagonal blocks'
        anchored operands are held in fp32, which the tensor cores read as TF32: fp16's 10 mantissa bits with fp32's range, so the
        factors up to a_min^{-8} fit at any gate bf16 takes (twice the bytes: 12 KiB more shared memory
        at two channel passes, and the slabs' operands then need buffers of their own).
    """
    import tilelang.language as T

    threads = threads or default_prepare_threads(chunk_size)
    C, sub = chunk_size, SUB_BLOCK
    accum_dtype = "float32"
    num_chunks = N // C
    channels_per_pass = d_k // channel_passes
    slab_starts = tuple(range(sub, C, sub)) if unrolled_slabs else range(sub, C, sub)

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
        with T.Kernel(num_chunks, B * H, threads=threads) as (i_c, i_bh):
            b, h = i_bh // H, i_bh % H
            t0 = i_c * C

            Q_s = T.alloc_shared((C, d_k), dtype)
            K_s = T.alloc_shared((C, d_k), dtype)
            gamma_s = T.alloc_shared((C, d_k), accum_dtype)
            beta_s = T.alloc_shared((C,), accum_dtype)
            score_dtype = "float16" if fp16_score_operands and dtype == "bfloat16" else dtype
            diagonal_dtype = "float32" if dtype in tf32_diagonal_operands else score_dtype
            Q_row_s = T.alloc_shared((C, channels_per_pass), diagonal_dtype)
            K_row_s = T.alloc_shared((C, channels_per_pass), diagonal_dtype)
            K_col_s = T.alloc_shared((C, channels_per_pass), diagonal_dtype)
            # the slabs' operands: buffers of their own with fp16_slab_operands (as the library kernel has)
            # or where their dtype differs from the diagonal's; else the diagonal's buffers, under a
            # meta_var so that they keep their names
            slab_dtype = "float16" if fp16_slab_operands and dtype == "bfloat16" else score_dtype
            own_slab_buffers = fp16_slab_operands or slab_dtype != diagonal_dtype
            Q_slab_s = T.alloc_shared((C, channels_per_pass), slab_dtype) if own_slab_buffers else T.meta_var(Q_row_s)
            K_slab_row_s = (T.alloc_shared((C, channels_per_pass), slab_dtype) if own_slab_buffers
                            else T.meta_var(K_row_s))
            K_slab_col_s = (T.alloc_shared((sub, channels_per_pass), slab_dtype) if own_slab_buffers
                            else T.meta_var(K_col_s))
            L_s = T.alloc_shared((C, C), accum_dtype)
            T_s = T.alloc_shared((C, C), accum_dtype)
            T_diag_s = T.alloc_shared((C, sub), accum_dtype)
            merge_s = T.alloc_shared((sub, C), accum_dtype)
            A_hat_s = T.alloc_shared((C, C), dtype)
            V_s = T.alloc_shared((C, d_v), dtype)
            Kg_s = T.alloc_shared((C, d_k), dtype) if kg_buffer else K_s
            A_qk_s = A_hat_s if staged_a_qk else None  # copied out before A_hat_s is written: its bytes
            W_s = T.alloc_shared((C, d_k), dtype) if staged_stores else None
            U_s = T.alloc_shared((C, d_v), dtype) if staged_stores else None

            kk_f = T.alloc_fragment((C, C), accum_dtype)
            qk_f = T.alloc_fragment((C, C), accum_dtype)
            kk_slab_f = T.alloc_fragment((C, sub), accum_dtype)
            qk_slab_f = T.alloc_fragment((C, sub), accum_dtype)
            w_f = T.alloc_fragment((C, d_k), accum_dtype)
            u_f = T.alloc_fragment((C, d_v), accum_dtype)
            block_row_f = T.alloc_fragment((sub, C), accum_dtype)
            V_f = T.alloc_fragment((C, d_v), dtype) if early_v else None

            T.copy(Q[b, t0:t0 + C, h, :], Q_s)
            T.copy(K[b, t0:t0 + C, h, :], K_s)
            T.copy(Beta[b, t0:t0 + C, h], beta_s)
            T.copy(G[b, t0:t0 + C, h, :], gamma_s)
            if early_v:
                T.copy(V[b, t0:t0 + C, h, :], V_f)
            for d in T.Parallel(d_k):
                running = T.alloc_var(accum_dtype)
                running = 0
                for r in T.unroll(C):
                    running += gamma_s[r, d]
                    gamma_s[r, d] = running

            # diagonal sub-blocks, anchored at the middle row of their sub-block
            for channel_pass in range(channel_passes):
                d0 = channel_pass * channels_per_pass
                if fused_passes:
                    for r, d in T.Parallel(C, channels_per_pass):
                        from_anchor = (gamma_s[r, d0 + d] - gamma_s[(r // sub) * sub + sub // 2, d0 + d]) * LOG2_E
                        key = K_s[r, d0 + d]
                        to_row = T.exp2(from_anchor)
                        Q_row_s[r, d] = Q_s[r, d0 + d] * to_row
                        K_row_s[r, d] = key * to_row
                        K_col_s[r, d] = key * T.exp2(-from_anchor)
                else:
                    for r, d in T.Parallel(C, channels_per_pass):
                        middle = gamma_s[(r // sub) * sub + sub // 2, d0 + d]
                        Q_row_s[r, d] = Q_s[r, d0 + d] * T.exp2((gamma_s[r, d0 + d] - middle) * LOG2_E)
                        K_row_s[r, d] = K_s[r, d0 + d] * T.exp2((gamma_s[r, d0 + d] - middle) * LOG2_E)
                        K_col_s[r, d] = K_s[r, d0 + d] * T.exp2((middle - gamma_s[r, d0 + d]) * LOG2_E)
                if paired_gemms:
                    T.wgmma_gemm(K_row_s, K_col_s, kk_f, transpose_B=True, clear_accum=channel_pass == 0)
                    T.wgmma_gemm(Q_row_s, K_col_s, qk_f, transpose_B=True, clear_accum=channel_pass == 0)
                    T.wait_wgmma(0)
                else:
                    T.gemm(K_row_s, K_col_s, kk_f, transpose_B=True, clear_accum=channel_pass == 0)
                    T.gemm(Q_row_s, K_col_s, qk_f, transpose_B=True, clear_accum=channel_pass == 0)
            for r, j in T.Parallel(C, C):
                same_block = r // sub == j // sub
                L_s[r, j] = T.if_then_else(same_block and j < r, kk_f[r, j] * beta_s[j], 0)
                if j // sub >= r // sub:
                    if staged_a_qk:
                        A_qk_s[r, j] = T.if_then_else(j <= r, qk_f[r, j], 0)
                    else:
                        A_qk[b, t0 + r, h, j] = T.if_then_else(j <= r, qk_f[r, j], 0)

            # off-diagonal slabs, anchored at the first row below each
            for s0 in slab_starts:
                for channel_pass in range(channel_passes):
                    d0 = channel_pass * channels_per_pass
                    if unrolled_slabs:
                        # rows s0 - sub .. C - 1: the column operand above s0, the row operands from s0 on
                        for r, d in T.Parallel(C - s0 + sub, channels_per_pass):
                            row = s0 - sub + r
                            from_anchor = (gamma_s[row, d0 + d] - gamma_s[s0, d0 + d]) * LOG2_E
                            key = K_s[row, d0 + d]
                            if r >= sub:
                                to_row = T.exp2(from_anchor)  # <= 1
                                Q_slab_s[row, d] = Q_s[row, d0 + d] * to_row
                                K_slab_row_s[row, d] = key * to_row
                            else:
                                K_slab_col_s[r, d] = key * T.exp2(-from_anchor)  # <= 1
                    elif fused_passes:
                        for r, d in T.Parallel(C - s0, channels_per_pass):
                            to_row = T.exp2((gamma_s[s0 + r, d0 + d] - gamma_s[s0, d0 + d]) * LOG2_E)
                            Q_slab_s[s0 + r, d] = Q_s[s0 + r, d0 + d] * to_row
                            K_slab_row_s[s0 + r, d] = K_s[s0 + r, d0 + d] * to_row
                        for j, d in T.Parallel(sub, channels_per_pass):
                            col = s0 - sub + j
                            K_slab_col_s[j, d] = K_s[col, d0 + d] * T.exp2((gamma_s[s0, d0 + d] - gamma_s[col, d0 + d]) * LOG2_E)
                    else:
                        for r, d in T.Parallel(C - s0, channels_per_pass):
                            to_row = T.exp2((gamma_s[s0 + r, d0 + d] - gamma_s[s0, d0 + d]) * LOG2_E)
                            Q_slab_s[s0 + r, d] = Q_s[s0 + r, d0 + d] * to_row
                            K_slab_row_s[s0 + r, d] = K_s[s0 + r, d0 + d] * to_row
                        for j, d in T.Parallel(sub, channels_per_pass):
                            col = s0 - sub + j
                            to_anchor = T.exp2((gamma_s[s0, d0 + d] - gamma_s[col, d0 + d]) * LOG2_E)
                            K_slab_col_s[j, d] = K_s[col, d0 + d] * to_anchor
                    first = channel_pass == 0
                    if paired_slab_gemms:
                        T.wgmma_gemm(K_slab_row_s, K_slab_col_s[0:sub, :], kk_slab_f, transpose_B=True, clear_accum=first)
                        T.wgmma_gemm(Q_slab_s, K_slab_col_s[0:sub, :], qk_slab_f, transpose_B=True, clear_accum=first)
                        T.wait_wgmma(0)
                    else:
                        T.gemm(K_slab_row_s, K_slab_col_s[0:sub, :], kk_slab_f, transpose_B=True, clear_accum=first)
                        T.gemm(Q_slab_s, K_slab_col_s[0:sub, :], qk_slab_f, transpose_B=True, clear_accum=first)
                for r, j in T.Parallel(C, sub):
                    if r >= s0:
                        L_s[r, s0 - sub + j] = kk_slab_f[r, j] * beta_s[s0 - sub + j]
                        if staged_a_qk:
                            A_qk_s[r, s0 - sub + j] = qk_slab_f[r, j]
                        else:
                            A_qk[b, t0 + r, h, s0 - sub + j] = qk_slab_f[r, j]
            if staged_a_qk:
                T.copy(A_qk_s, A_qk[b, t0:t0 + C, h, :])

            # the recurrence's decayed operands, and K e^gamma
            for r, d in T.Parallel(C, d_k):
                decay_from_start = T.exp2(gamma_s[r, d] * LOG2_E)
                Q_decayed[b, t0 + r, h, d] = Q_s[r, d] * decay_from_start
                K_to_chunk_end[b, t0 + r, h, d] = K_s[r, d] * T.exp2((gamma_s[C - 1, d] - gamma_s[r, d]) * LOG2_E)
                Kg_s[r, d] = K_s[r, d] * decay_from_start
            for d in T.Parallel(d_k):
                Chunk_decay[b, i_c, h, d] = T.exp2(gamma_s[C - 1, d] * LOG2_E)
            if early_v:
                T.copy(V_f, V_s)
            else:
                T.copy(V[b, t0:t0 + C, h, :], V_s)

            # diagonal blocks of T = (I + L)^{-1} by forward substitution
            T.clear(T_s)
            for r in T.serial(sub):
                for blk, col in T.Parallel(C // sub, sub):
                    i = blk * sub + r
                    solved = T.alloc_var(accum_dtype)
                    solved = T.if_then_else(col == r, 1, 0)
                    for j in T.serial(r):
                        solved -= L_s[i, blk * sub + j] * T_s[blk * sub + j, blk * sub + col]
                    T_s[i, blk * sub + col] = solved
                    T_diag_s[i, col] = solved
            for p0 in range(sub, C, sub):
                T.gemm(L_s[p0:p0 + sub, :], T_s, block_row_f, clear_accum=True)
                T.copy(block_row_f, merge_s)
                T.gemm(T_diag_s[p0:p0 + sub, :], merge_s, block_row_f, clear_accum=True)
                for r, c in T.Parallel(sub, C):
                    if c < p0:
                        T_s[p0 + r, c] = -block_row_f[r, c]

            for r, c in T.Parallel(C, C):
                A_hat_s[r, c] = T_s[r, c] * beta_s[r]
            if paired_gemms:
                T.wgmma_gemm(A_hat_s, Kg_s, w_f, clear_accum=True)
                T.wgmma_gemm(A_hat_s, V_s, u_f, clear_accum=True)
                T.wait_wgmma(0)
            else:
                T.gemm(A_hat_s, Kg_s, w_f, clear_accum=True)
                T.gemm(A_hat_s, V_s, u_f, clear_accum=True)
            if staged_stores:
                T.copy(w_f, W_s)
                T.copy(u_f, U_s)
                T.copy(W_s, W[b, t0:t0 + C, h, :])
                T.copy(U_s, U[b, t0:t0 + C, h, :])
            else:
                T.copy(w_f, W[b, t0:t0 + C, h, :])
                T.copy(u_f, U[b, t0:t0 + C, h, :])

    return kda_prepare


def committed(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
              channel_passes=CHANNEL_PASSES):
    """The committed kernel rebuilt here with every switch off: the control (its time should equal
    stages.s05_fast_kda.kernel.build_prepare_program's)."""
    return _build(B, N, H, d_k, d_v, chunk_size, dtype, threads, channel_passes)


def vectorized_slabs(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
                     channel_passes=CHANNEL_PASSES):
    """The anchored-operand passes with less shared-memory traffic: the slab loop unrolled at build
    time, so each slab pass has a static extent and vectorizes (4-wide float4/uint2 accesses instead of
    scalar ones, whose 4-byte gamma reads were 4-way bank conflicted), one pass per slab and channel
    pass for the row and the column operands; every pass reads gamma and K once per element.
    Counted from the generated code, about a quarter of the kernel's shared-memory wavefronts go."""
    return _build(B, N, H, d_k, d_v, chunk_size, dtype, threads, channel_passes, fused_passes=True,
                  unrolled_slabs=True)


def vectorized_kg(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
                  channel_passes=CHANNEL_PASSES):
    """vectorized_slabs, and K e^gamma written to its own buffer (which takes the bytes of the dead
    K_row_s and K_col_s, so shared memory stays 105 KiB) instead of K_s in place: the in-place pass
    had a __syncthreads in each of its 8 unrolled steps, gone here."""
    return _build(B, N, H, d_k, d_v, chunk_size, dtype, threads, channel_passes, fused_passes=True,
                  unrolled_slabs=True, kg_buffer=True)


def staged_wu(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
              channel_passes=CHANNEL_PASSES):
    """vectorized_kg, and W, U staged in shared memory (in the bytes of Q_s/V_s and K_s, dead by then:
    still 105 KiB) and written out by TMA stores of whole rows. The committed kernel stores them from
    the MMA fragments: 4-byte stores spread over 8 rows, about 8 L1 wavefronts per instruction."""
    return _build(B, N, H, d_k, d_v, chunk_size, dtype, threads, channel_passes, fused_passes=True,
                  unrolled_slabs=True, kg_buffer=True, staged_stores=True)


def staged_all(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
               channel_passes=CHANNEL_PASSES):
    """staged_wu, and A_qk staged too (the diagonal blocks were 2-byte stores over 8 rows per
    instruction) and written by one TMA store after the slabs. Costs 8 KiB of shared memory (113 KiB:
    two blocks per SM still fit, exactly, in the H200's 228 KiB)."""
    return _build(B, N, H, d_k, d_v, chunk_size, dtype, threads, channel_passes, fused_passes=True,
                  unrolled_slabs=True, kg_buffer=True, staged_stores=True, staged_a_qk=True)


def slabs_early_v(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
                  channel_passes=CHANNEL_PASSES):
    """vectorized_slabs, and V loaded from HBM into registers at the start (16 registers a thread),
    moved to shared memory where the committed kernel loads it: the load's latency overlaps the score
    passes instead of standing between the decayed pass and the block inverse."""
    return _build(B, N, H, d_k, d_v, chunk_size, dtype, threads, channel_passes, fused_passes=True,
                  unrolled_slabs=True, early_v=True)


def paired(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
           channel_passes=CHANNEL_PASSES):
    """staged_all, and the GEMMs that share an operand issued together and waited for once (the score
    GEMMs of the diagonal blocks, the W and U GEMMs): 3 waits fewer a chunk."""
    return _build(B, N, H, d_k, d_v, chunk_size, dtype, threads, channel_passes, fused_passes=True,
                  unrolled_slabs=True, kg_buffer=True, staged_stores=True, staged_a_qk=True, paired_gemms=True)


def paired_slabs(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
                 channel_passes=CHANNEL_PASSES):
    """paired, and the slabs' score GEMMs paired too: 9 waits fewer a chunk."""
    return _build(B, N, H, d_k, d_v, chunk_size, dtype, threads, channel_passes, fused_passes=True,
                  unrolled_slabs=True, kg_buffer=True, staged_stores=True, staged_a_qk=True, paired_gemms=True,
                  paired_slab_gemms=True)


def fp16_scores(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
                channel_passes=CHANNEL_PASSES):
    """staged_all, and with bf16 inputs every score GEMM's anchored operands in fp16 (3 more mantissa
    bits, the same bytes). Through the tile interpreter (tests/test_s05_variants.py) at B=1 N=256 H=2
    d=128, gates in [0.5, 0.999]: o's rel L2 against float64 4.96e-3 -> 4.53e-3, where the H200 measured
    4.96e-3 for the committed kernel and 4.47e-3 for FLA (benchmarks/results/precision.csv).
    Kept as the record of what was tried, not to adopt: the diagonal blocks' factors exceed 1 (up to
    a_min^{-8}), and with gates near 0.1 their fp16 operands overflow to inf and o is nan, where bf16
    operands are fine (fp16_slabs keeps the gain where it is safe)."""
    return _build(B, N, H, d_k, d_v, chunk_size, dtype, threads, channel_passes, fused_passes=True,
                  unrolled_slabs=True, kg_buffer=True, staged_stores=True, staged_a_qk=True, fp16_score_operands=True)


def fp16_slabs(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
               channel_passes=CHANNEL_PASSES):
    """staged_all, and with bf16 inputs the off-diagonal slabs' anchored operands in fp16, in buffers
    of their own, where every factor is a product of gates (<= 1) and fp16 cannot overflow; the
    diagonal blocks, whose factors reach a_min^{-8}, keep bf16 operands. Slab buffers of their own
    shorten the diagonal buffers' lives: 107 KiB of shared memory where staged_all takes 113. Through
    the tile interpreter, as for fp16_scores: 4.96e-3 -> 4.94e-3 at gates in [0.5, 0.999] (the slab
    scores are products of many gates there; the error sits on the diagonal), 5.49e-3 -> 5.25e-3 at
    [0.99, 0.999]."""
    return _build(B, N, H, d_k, d_v, chunk_size, dtype, threads, channel_passes, fused_passes=True,
                  unrolled_slabs=True, kg_buffer=True, staged_stores=True, staged_a_qk=True, fp16_slab_operands=True)


def tf32_diagonal(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
                  channel_passes=CHANNEL_PASSES):
    """fp16_slabs, and the diagonal blocks' anchored operands in fp32, read by the tensor cores as
    TF32: the precision fp16_scores gave the diagonal, without its overflow. With fp16 inputs too, whose
    diagonal operands can overflow once gates fall below 0.25 (0.25^{-8} = 65536). TileLang lowers the
    fp32 GEMMs to mma.sync (m16n8k8, TF32), not wgmma; 112.25 KiB of shared memory, 122 registers
    (bf16). Through the tile interpreter, as for fp16_scores: 4.53e-3 at gates in [0.5, 0.999] (TF32
    rounded to nearest; 4.41e-3 with the low bits truncated instead), 4.58e-3 at [0.01, 0.1]
    (staged_all 5.14e-3, fp16_scores nan); fp16 inputs at [0.01, 0.1]: 5.97e-4 where staged_all is nan."""
    return _build(B, N, H, d_k, d_v, chunk_size, dtype, threads, channel_passes, fused_passes=True,
                  unrolled_slabs=True, kg_buffer=True, staged_stores=True, staged_a_qk=True, fp16_slab_operands=True,
                  tf32_diagonal_operands=("float16", "bfloat16"))


def tf32_diagonal_bf16(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
                       channel_passes=CHANNEL_PASSES):
    """tf32_diagonal for bf16 inputs only; fp16 inputs keep fp16 diagonal operands, as fp16_slabs. On the
    H200 the fp32 operands read as TF32 gave fp16 inputs 8.37e-4 against float64 where the fp16 ones gave
    6.59e-4 and FLA 7.34e-4 (gates in [0.9, 0.999], N=4096), likely because the tensor cores take an
    fp32 operand's leading bits as TF32 without rounding, where the conversion to fp16 rounds to nearest."""
    return _build(B, N, H, d_k, d_v, chunk_size, dtype, threads, channel_passes, fused_passes=True,
                  unrolled_slabs=True, kg_buffer=True, staged_stores=True, staged_a_qk=True, fp16_slab_operands=True,
                  tf32_diagonal_operands=("bfloat16",))


VARIANTS = {"committed": committed, "vectorized_slabs": vectorized_slabs, "vectorized_kg": vectorized_kg,
            "staged_wu": staged_wu, "staged_all": staged_all, "slabs_early_v": slabs_early_v,
            "paired": paired, "paired_slabs": paired_slabs, "fp16_scores": fp16_scores,
            "fp16_slabs": fp16_slabs, "tf32_diagonal": tf32_diagonal,
            "tf32_diagonal_bf16": tf32_diagonal_bf16}


# ------------------------------------------------------------------ the GPU run

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for variants.csv")
    parser.add_argument("--quick", action="store_true",
                        help=f"{len(QUICK_SHAPES)} shape, {QUICK_ROUNDS} rounds, shorter timings")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated names (default: all): " + ", ".join(VARIANTS))
    parser.add_argument("--rounds", type=int, default=None, help=f"interleaved rounds (default {ROUNDS})")
    parser.add_argument("--no-fla", action="store_true", help="skip FLA (its autotune takes a minute or two)")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in names if name not in VARIANTS]
    if unknown or not names:
        parser.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    args.variants = names
    args.shapes = QUICK_SHAPES if args.quick else SHAPES
    args.rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def _compile_all(names, shapes, log):
    """Every (variant, shape) compiled in threads: {(name, shape): (kernel, seconds) or the failure's text}."""
    return compile_timed({(name, shape): functools.partial(VARIANTS[name], *shape, shape[3], DEFAULT_CHUNK_SIZE, DTYPE)
                          for shape in shapes for name in names}, PREPARE_OUT, log)


def compile_timed(builders, out_idx, log):
    """{key: (compiled kernel, seconds) or the failure's text} for {key: a function building a program},
    compiled in threads (stages.common.tilelang_tools.compile_in_threads); a failure is recorded and
    the run goes on."""
    import tilelang

    from stages.common.tilelang_tools import compile_in_threads

    def compiler(build):
        started = time.time()
        return tilelang.compile(build(), out_idx=out_idx, target="cuda"), time.time() - started

    results = compile_in_threads({key: functools.partial(compiler, build) for key, build in builders.items()}, log)
    return {key: result if isinstance(result, tuple) else f"{type(result).__name__}: {str(result).strip()[-300:]}"
            for key, result in results.items()}


def rel_l2(actual, expected):
    """||actual - expected|| / ||expected|| of two tensors, in float64 (the variants' error measure)."""
    actual, expected = actual.double(), expected.double()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def graph_timer(quick):
    """timer(launch) -> milliseconds per launch: a CUDA graph of it replayed under triton's do_bench
    (CUDA events around the launch where it does not capture); fewer rounds when quick."""
    import torch
    from triton.testing import do_bench

    from benchmarks.fair import capture

    warmup, rep = (10, 40) if quick else (25, 100)

    def timer(launch):
        try:
            function = capture(launch).replay
        except Exception:  # noqa: BLE001 - CUDA events around the launch instead
            torch.cuda.synchronize()
            function = launch
        return float(do_bench(function, warmup=warmup, rep=rep, return_mode="median"))

    return timer


def run(args, log):
    import torch

    from benchmarks import bench
    from stages.s05_fast_kda import kernel

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timer = graph_timer(args.quick)
    compiled = _compile_all(args.variants, args.shapes, log)
    rows = []
    for shape in args.shapes:
        B, N, H, D = shape
        label = f"B={B} N={N} H={H} D={D}"
        inputs = bench.make_inputs(bench.STAGES["s05"], B, N, H, D, torch.bfloat16)
        reference = kernel.compiled_prepare(B, N, H, D, D, DEFAULT_CHUNK_SIZE, DTYPE, None)
        recurrence = kernel.compiled_recurrence(B, N, H, D, D, DEFAULT_CHUNK_SIZE, kernel.DEFAULT_BLOCK_DV, DTYPE,
                                                 2, 128)
        state = torch.zeros(B, H, D, D, dtype=torch.float32, device="cuda")
        expected = [t.clone() for t in reference(*inputs)]
        committed_o = recurrence(*expected, state)[0]
        fla_o, fla_call = None, None
        if not args.no_fla:
            try:
                fla_call = bench.fla(bench.STAGES["s05"])
                fla_o = fla_call(*inputs)
                log(f"{label}: FLA ready")
            except Exception as failure:  # noqa: BLE001
                log(f"{label}: FLA failed: {type(failure).__name__}: {failure}")
                fla_call = None
        base = dict(B=B, N=N, H=H, D=D)
        checks = {}
        for name in args.variants:
            result = compiled[(name, shape)]
            row = dict(base, variant=name)
            if isinstance(result, str):
                checks[name] = dict(row, error=f"compile: {result}")
                continue
            prepare, compile_s = result
            row["compile_s"] = f"{compile_s:.1f}"
            try:
                actual = prepare(*inputs)
                for output_name, a, e in zip(OUTPUTS, actual, expected):
                    row[f"rel_l2_{output_name}"] = f"{rel_l2(a, e):.3e}"
                o = recurrence(*actual, state)[0]
                if fla_o is not None:
                    row["rel_l2_o_vs_fla"] = f"{rel_l2(o, fla_o):.3e}"
                    row["rel_l2_o_committed_vs_fla"] = f"{rel_l2(committed_o, fla_o):.3e}"
                del actual, o
                checks[name] = row
                log(f"{label} {name}: checked, rel L2 vs committed: "
                    + ", ".join(f"{n} {row[f'rel_l2_{n}']}" for n in OUTPUTS)
                    + (f"; o vs FLA {row['rel_l2_o_vs_fla']}" if "rel_l2_o_vs_fla" in row else ""))
            except Exception as failure:  # noqa: BLE001 - recorded, the run goes on
                traceback.print_exc()
                checks[name] = dict(row, error=f"run: {type(failure).__name__}: {str(failure)[:300]}")
        torch.cuda.synchronize()
        prepared = [t.clone() for t in expected]
        recurrence_ms = None
        for round_number in range(1, args.rounds + 1):
            order = list(args.variants) if round_number % 2 else list(reversed(args.variants))
            try:
                recurrence_ms = timer(functools.partial(recurrence, *prepared, state))
            except Exception as failure:  # noqa: BLE001
                log(f"{label}: recurrence timing failed: {failure}")
            fla_ms = None
            if fla_call is not None:
                try:
                    fla_ms = timer(functools.partial(fla_call, *inputs))
                except Exception as failure:  # noqa: BLE001
                    log(f"{label}: FLA timing failed: {failure}")
            for name in order:
                row = dict(checks[name], round=round_number)
                if "error" not in row:
                    prepare = compiled[(name, shape)][0]
                    try:
                        row["prepare_ms"] = f"{timer(functools.partial(prepare, *inputs)):.4f}"
                        if recurrence_ms is not None:
                            row["recurrence_ms"] = f"{recurrence_ms:.4f}"
                            row["kernels_ms"] = f"{float(row['prepare_ms']) + recurrence_ms:.4f}"
                    except Exception as failure:  # noqa: BLE001
                        traceback.print_exc()
                        row["error"] = f"timing: {type(failure).__name__}: {str(failure)[:300]}"
                if fla_ms is not None:
                    row["fla_ms"] = f"{fla_ms:.4f}"
                rows.append(row)
                log(f"round {round_number} {label} {name}: prepare {row.get('prepare_ms', 'failed')} ms"
                    + (f" ({row['error']})" if row.get("error") else ""))
            _write(out / "variants.csv", rows)
        inputs = expected = prepared = committed_o = fla_o = None  # freed before the next shape's
        torch.cuda.empty_cache()
    print_table(rows, log)
    return rows


def _write(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def summarize(rows):
    """{(B, N, H, D): {variant: (median prepare ms, median kernels ms, median FLA ms, max rel L2)}}."""
    table = {}
    for row in rows:
        shape = tuple(int(row[k]) for k in ("B", "N", "H", "D"))
        table.setdefault(shape, {}).setdefault(row["variant"], []).append(row)

    def median_of(named, field):
        values = [float(r[field]) for r in named if r.get(field) not in (None, "")]
        return statistics.median(values) if values else None

    summary = {}
    for shape, variants in table.items():
        summary[shape] = {}
        for name, named in variants.items():
            errors = [float(named[0][f"rel_l2_{n}"]) for n in OUTPUTS if named[0].get(f"rel_l2_{n}") not in (None, "")]
            summary[shape][name] = (median_of(named, "prepare_ms"), median_of(named, "kernels_ms"),
                                    median_of(named, "fla_ms"), max(errors) if errors else None,
                                    named[0].get("error", ""))
    return summary


def print_table(rows, log=print):
    def text(value, form):
        return form.format(value) if value is not None else "-"

    for shape, variants in summarize(rows).items():
        log(f"B={shape[0]} N={shape[1]} H={shape[2]} D={shape[3]}: variant, prepare ms, kernels ms, "
            "speed-up of prepare vs committed, FLA/kernels, max rel L2 vs committed")
        committed_ms = variants.get("committed", (None,))[0]
        for name, (prepare_ms, kernels_ms, fla_ms, error, failure) in variants.items():
            gain = prepare_ms and committed_ms and committed_ms / prepare_ms
            ratio = kernels_ms and fla_ms and fla_ms / kernels_ms
            log(f"  {name:18s} {text(prepare_ms, '{:.4f}'):>8s} {text(kernels_ms, '{:.4f}'):>8s} "
                f"{text(gain, '{:.3f}x'):>8s} {text(ratio, '{:.2f}x'):>7s} {text(error, '{:.1e}'):>8s} {failure}")


def main(argv=None):
    args = parse_args(argv)
    started = time.time()

    def log(message):
        print(f"[{time.time() - started:6.1f} s] {message}", flush=True)

    log(f"variants {', '.join(args.variants)}; shapes {args.shapes}; {args.rounds} rounds; "
        f"FLA {'off' if args.no_fla else 'on'}")
    run(args, log)
    log(f"done; {Path(args.out) / 'variants.csv'}")


if __name__ == "__main__":
    sys.exit(main())
