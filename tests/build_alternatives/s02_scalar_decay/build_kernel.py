"""A second correct answer to exercise s02.build_kernel, unlike the course's kernel: the grid's axes
are swapped (batch x head first); the decays are computed in each chunk, not once; the query's decay goes on Q and the key's on K before their products, not
on the accumulator and on V; and the mask is a separate select from the decay.

tests/course/test_build_exercises.py runs the exercise's tests on it (a folder target laid out like
exercises/). Kept out of tests/exercises/, which the handout ships.
"""

LOG2_E = 1.4426950408889634


def build_program(B, N, H, d_k, d_v, chunk_size=64, block_dv=32, dtype="float16", num_stages=2, threads=128):
    """q, k: (B, N, H, d_k), v: (B, N, H, d_v), g: (H,) float32 -> o: (B, N, H, d_v)."""
    import tilelang.language as T

    C = chunk_size

    @T.prim_func
    def decayed_operands(
        Q: T.Tensor((B, N, H, d_k), dtype),
        K: T.Tensor((B, N, H, d_k), dtype),
        V: T.Tensor((B, N, H, d_v), dtype),
        G: T.Tensor((H,), "float32"),
        O: T.Tensor((B, N, H, d_v), dtype),
    ):
        with T.Kernel(B * H, d_v // block_dv, threads=threads) as (i_bh, i_v):
            b, h, v0 = i_bh // H, i_bh % H, i_v * block_dv
            Q_s = T.alloc_shared((C, d_k), dtype)
            K_s = T.alloc_shared((C, d_k), dtype)
            V_s = T.alloc_shared((C, block_dv), dtype)
            Q_decayed_s = T.alloc_shared((C, d_k), dtype)
            K_decayed_s = T.alloc_shared((C, d_k), dtype)
            S_s = T.alloc_shared((d_k, block_dv), dtype)
            scores_s = T.alloc_shared((C, C), dtype)
            S_f = T.alloc_fragment((d_k, block_dv), "float32")
            scores = T.alloc_fragment((C, C), "float32")
            acc_o = T.alloc_fragment((C, block_dv), "float32")

            T.clear(S_f)
            for i_c in T.Pipelined(N // C, num_stages=num_stages):
                t0 = i_c * C
                T.copy(Q[b, t0:t0 + C, h, :], Q_s)
                T.copy(K[b, t0:t0 + C, h, :], K_s)
                T.copy(V[b, t0:t0 + C, h, v0:v0 + block_dv], V_s)
                log2_a = G[h] * LOG2_E
                for r, d in T.Parallel(C, d_k):
                    Q_decayed_s[r, d] = Q_s[r, d] * T.exp2((r + 1) * log2_a)
                    K_decayed_s[r, d] = K_s[r, d] * T.exp2((C - 1 - r) * log2_a)

                T.gemm(Q_s, K_s, scores, transpose_B=True, clear_accum=True)
                for r, j in T.Parallel(C, C):
                    scores_s[r, j] = T.if_then_else(r >= j, scores[r, j] * T.exp2((r - j) * log2_a), 0.0)
                T.gemm(scores_s, V_s, acc_o, clear_accum=True)
                T.copy(S_f, S_s)
                T.gemm(Q_decayed_s, S_s, acc_o)
                T.copy(acc_o, O[b, t0:t0 + C, h, v0:v0 + block_dv])

                for d, c in T.Parallel(d_k, block_dv):
                    S_f[d, c] = S_f[d, c] * T.exp2(C * log2_a)
                T.gemm(K_decayed_s, V_s, S_f, transpose_A=True)

    return decayed_operands
