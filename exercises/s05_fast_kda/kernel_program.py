"""Exercise s05.kernel_program (fill): the block inverse's merges in stage 5's prepare kernel.

One program per (chunk, batch x head) computes the chunk's scores, then T = (I + L)^{-1} in fp32
shared memory, then W and U. The diagonal 16 x 16 blocks of T are solved (forward substitution) just
above the region; fill the region: for every block row P below the first, the entries left of its
diagonal block,
    T[P, :P] = -T[P, P] (L[P, :P] T[:P, :P])          (block row P of (I + L) T = I),
on the tensor cores, with every other entry of T_s left as it is. The buffers it works with:
    L_s          (C, C) fp32 shared: L = beta_i A_kk, strictly lower triangular;
    T_s          (C, C) fp32 shared: T, its diagonal blocks solved, zero elsewhere; the region
                 writes the blocks left of the diagonal, and the code after it reads the whole of T_s;
    T_diag_s     (C, SUB_BLOCK) fp32 shared: the diagonal blocks T[P, P] stacked, rows p0:p0 + SUB_BLOCK
                 hold block row P's;
    merge_s      (SUB_BLOCK, C) fp32 shared: room for one block row of a product, as a GEMM operand;
    block_row_f  (SUB_BLOCK, C) fp32 fragment: a GEMM accumulator of one block row.
The sizes of a T.gemm must be known when the program is built; p0 is a loop variable.

Without a GPU the tests run your program through the course's tile interpreter
(stages.common.interpreter) and compare W, U and the other outputs with reference C
(stages.s05_fast_kda.reference.prepare; its inverse is block_inverse); with nvcc they also compile
it for sm_90a, and on a GPU they run it.
Read: stage 5 page, "The inverse by blocks" and "The prepare kernel".  Check: course check s05
"""

from stages.common.tilelang_tools import LOG2_E
from stages.s05_fast_kda.kernel import (CHANNEL_PASSES, DEFAULT_CHUNK_SIZE, SUB_BLOCK, default_prepare_threads,
                                         exact_diagonal_block_macro)
from stages.s05_fast_kda.numerics import FAST_SPAN_LOG, score_operand_dtypes


def build_prepare_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
                          channel_passes=CHANNEL_PASSES):
    """The prepare kernel: q, k (B, N, H, d_k), v (B, N, H, d_v) in `dtype`, g (B, N, H, d_k) and
    beta (B, N, H) in fp32 -> W, Q e^gamma, K e^{gamma_C - gamma} (B, N, H, d_k), U (B, N, H, d_v),
    A_qk (B, N, H, C) in `dtype`, e^{gamma_C} (B, N / C, H, d_k) in fp32.

    The score GEMMs sum over d_k in `channel_passes` passes, so their operands hold d_k /
    channel_passes channels: at C = 64, d_k = 128, two passes bring shared memory to 105 KiB, two
    blocks per SM. N must be a multiple of chunk_size (the wrapper pads), chunk_size of SUB_BLOCK,
    d_k of 16 * channel_passes. threads=None takes default_prepare_threads(chunk_size).
    """
    import tilelang.language as T

    threads = threads or default_prepare_threads(chunk_size)
    C, sub = chunk_size, SUB_BLOCK
    accum_dtype = "float32"
    num_chunks = N // C
    channels_per_pass = d_k // channel_passes
    diagonal_dtype, slab_dtype = score_operand_dtypes(dtype)
    blocks = C // sub
    largest_span = FAST_SPAN_LOG[diagonal_dtype]
    exact_diagonal_block = exact_diagonal_block_macro(d_k)  # a sub-block term by term, at any gate

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
            # the score GEMMs' operands: decay from the anchor to the row, and from the column to the
            # anchor. On the diagonal blocks a factor reaches a_min^-8, so 16-bit inputs get fp32 there
            # (the tensor cores read TF32: fp16's 10 mantissa bits, fp32's range); on the slabs every
            # factor is <= 1, so fp16 holds them (bf16 would keep 7 bits): |q|, |k| < 65504 suffices
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
            # gamma[r] = g[0] + ... + g[r]: one thread per channel walks the rows in a register
            # (T.cumsum lowers to one warp per column, whose strided reads all hit one smem bank)
            for d in T.Parallel(d_k):
                running = T.alloc_var(accum_dtype)
                running = 0
                for r in T.unroll(C):
                    running += gamma_s[r, d]
                    gamma_s[r, d] = running

            # a diagonal sub-block's largest anchored factor is e^span, span the larger of gamma_first -
            # gamma_middle (its first row's) and gamma_middle - gamma_last (its last column's), over the
            # channels; a flag per sub-block in shared memory, so that every thread takes one branch below
            exact_s = T.alloc_shared((blocks,), "int32")
            for blk in T.Parallel(blocks):
                exact_s[blk] = 0
            for blk, d in T.Parallel(blocks, d_k):
                middle = gamma_s[blk * sub + sub // 2, d]
                span = T.max(gamma_s[blk * sub, d] - middle, middle - gamma_s[blk * sub + sub - 1, d])
                if span > largest_span:  # every lane that finds one writes the same 1
                    exact_s[blk] = 1

            # diagonal sub-blocks: rows and columns anchored at the middle row of their sub-block
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
            # one store of whole rows (TMA), where writing from the fragments scattered 2-byte stores
            T.fence_proxy_async()  # A_qk_s seen by the TMA store (stages/kda/tiles.py: "TMA stores")
            T.copy(A_qk_s, A_qk[b, t0:t0 + C, h, :])

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

            # diagonal blocks of T = (I + L)^{-1}: forward substitution, one lane per (block, column), the
            # lane's column of its block in registers, so the 16 steps need no barrier between them
            T.clear(T_s)
            T.sync_threads()  # the whole block's clear lands before the solving lanes write T_s
            for blk, col in T.Parallel(C // sub, sub):
                # T[blk * sub + r, blk * sub + col] for r < sub, one register each (the rows are unrolled
                # as the program is built, so that every index into the list is a number)
                column = [T.alloc_var(accum_dtype) for _ in range(sub)]
                for r in tuple(range(sub)):
                    i = blk * sub + r
                    column[r][0] = T.if_then_else(col == r, 1.0, 0.0)
                    for j in tuple(range(r)):
                        column[r][0] -= L_s[i, blk * sub + j] * column[j][0]
                    T_s[i, blk * sub + col] = column[r][0]
                    T_diag_s[i, col] = column[r][0]
            # EXERCISE BEGIN
            raise NotImplementedError("s05.kernel_program: fill this region; see the docstring and the page")
            # EXERCISE END

            for r, c in T.Parallel(C, C):
                A_hat_s[r, c] = T_s[r, c] * beta_s[r]  # diag(beta) T, after the inverse
            T.gemm(A_hat_s, Kg_s, w_f, clear_accum=True)
            T.gemm(A_hat_s, V_s, u_f, clear_accum=True)
            # through shared memory, then whole-row stores (TMA): the fragments' own stores are 4-byte
            # writes spread over 8 rows, about 8 L1 wavefronts per instruction
            T.copy(w_f, W_s)
            T.copy(u_f, U_s)
            T.fence_proxy_async()  # W_s, U_s seen by the TMA store (stages/kda/tiles.py: "TMA stores")
            T.copy(W_s, W[b, t0:t0 + C, h, :])
            T.copy(U_s, U[b, t0:t0 + C, h, :])

    return kda_prepare
