"""Exercise s02.kernel_program (fix): the decays of a stage 2 TileLang program.

One program per (block of d_v columns, batch x head) walks the chunks. In each chunk it builds the
head's decays (the table Gamma, the causal mask folded in, the query decay of each row, the key decay
of each row and the state's decay across a chunk) and applies them: to the intra-chunk scores, to the
inter-chunk term row by row, and to the state as it moves past the chunk. The region between the
markers is that work.

It is not the course's kernel: written product by product, it loads what each GEMM reads (the
queries and the keys cross from global memory twice per chunk) and rebuilds the decays in every
chunk; the build exercise asks for fewer bytes, and tune_kernel.py is about that waste. It is not the
bug. The program compiles and looks right, and carries one known bug, one that no compiler sees.
Find it and fix it. Without a GPU the tests run the program through the course's tile interpreter
(stages.common.interpreter) and compare it with reference C; with nvcc they also compile it for
sm_90a, and on a GPU they run it.
Read: stage 2 page, "The kernel".  Check: course check s02
"""

from stages.common.tilelang_tools import LOG2_E
from stages.s02_scalar_decay.kernel import DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE


def build_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=DEFAULT_BLOCK_DV,
                  dtype="float16", num_stages=2, threads=128):
    """The TileLang program for q, k: (B, N, H, d_k), v: (B, N, H, d_v), g: (H,) float32
    -> o: (B, N, H, d_v).

    N must be a multiple of chunk_size (the wrapper pads), block_dv must divide d_v.
    """
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    num_chunks = N // C

    @T.prim_func
    def scalar_decay_fwd(
        Q: T.Tensor((B, N, H, d_k), dtype),
        K: T.Tensor((B, N, H, d_k), dtype),
        V: T.Tensor((B, N, H, d_v), dtype),
        G: T.Tensor((H,), accum_dtype),
        O: T.Tensor((B, N, H, d_v), dtype),
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv

            Q_s = T.alloc_shared((C, d_k), dtype)
            Q_inter_s = T.alloc_shared((C, d_k), dtype)  # the queries of the inter-chunk GEMM
            K_scores_s = T.alloc_shared((C, d_k), dtype)  # the keys of Q K^T
            K_s = T.alloc_shared((C, d_k), dtype)  # the keys of the state's update
            V_s = T.alloc_shared((C, block_dv), dtype)
            V_decayed_s = T.alloc_shared((C, block_dv), dtype)  # key_decay ⊙ V: V_s stays as loaded
            S_s = T.alloc_shared((d_k, block_dv), dtype)  # the state as a GEMM operand
            scores_s = T.alloc_shared((C, C), dtype)
            key_decay_s = T.alloc_shared((C,), accum_dtype)  # read with V_s's layout, not acc_o's

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state: lives across chunks
            scores = T.alloc_fragment((C, C), accum_dtype)
            acc_o = T.alloc_fragment((C, block_dv), accum_dtype)
            decay = T.alloc_fragment((C, C), accum_dtype)  # Gamma
            query_decay = T.alloc_fragment((C,), accum_dtype)
            state_decay = T.alloc_var(accum_dtype)

            # EXERCISE BEGIN
            T.clear(S_f)  # once, outside the chunk loop: the state carries over
            for i_c in T.Pipelined(num_chunks, num_stages=num_stages):
                t0 = i_c * C
                # this chunk's decays
                log2_alpha = G[h] * LOG2_E
                for r, j in T.Parallel(C, C):
                    decay[r, j] = T.if_then_else(j <= r, T.exp2((r - j) * log2_alpha), 0)
                for r in T.Parallel(C):
                    query_decay[r] = T.exp2((r + 1) * log2_alpha)
                    key_decay_s[r] = T.exp2((C - 1 - r) * log2_alpha)
                state_decay = T.exp2(C * log2_alpha)

                # intra-chunk scores Q K^T times the decay table
                T.copy(Q[b, t0:t0 + C, h, :], Q_s)
                T.copy(K[b, t0:t0 + C, h, :], K_scores_s)
                T.gemm(Q_s, K_scores_s, scores, transpose_B=True, clear_accum=True)
                for r, j in T.Parallel(C, C):
                    scores_s[r, j] = scores[r, j] * decay[r, j]

                # inter-chunk term Q S^T, decayed per row, then the intra-chunk term on top
                T.copy(Q[b, t0:t0 + C, h, :], Q_inter_s)
                T.copy(V[b, t0:t0 + C, h, v0:v0 + block_dv], V_s)
                T.copy(S_f, S_s)
                T.gemm(Q_inter_s, S_s, acc_o, clear_accum=True)
                for r, c in T.Parallel(C, block_dv):
                    acc_o[r, c] *= query_decay[r]
                T.gemm(scores_s, V_s, acc_o)
                T.copy(acc_o, O[b, t0:t0 + C, h, v0:v0 + block_dv])

                # the state moves past this chunk: decay it, then add K^T (key_decay ⊙ V)
                T.copy(K[b, t0:t0 + C, h, :], K_s)
                for r, c in T.Parallel(C, block_dv):
                    V_decayed_s[r, c] = V_s[r, c] * key_decay_s[r]
                for d, c in T.Parallel(d_k, block_dv):
                    S_f[d, c] *= state_decay
                T.gemm(K_s, V_decayed_s, S_f, transpose_A=True)
                # EXERCISE END

    return scalar_decay_fwd
