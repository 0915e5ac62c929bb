"""A second correct answer to exercise s01.build_kernel, tiled otherwise than the course's kernel:
one program per (batch, head) owns every value column (block_dv is ignored), the mask is applied
to the fp32 scores in place, and the intra-chunk term is summed before the inter-chunk one.

tests/course/test_build_exercises.py runs the exercise's tests on it (it is laid out like exercises/, a
folder target): they check behaviour and budgets, so a program unlike the course's passes them.
Kept out of tests/exercises/, which the handout ships.
"""


def build_program(B, N, H, d_k, d_v, chunk_size=64, block_dv=None, dtype="float16", num_stages=2, threads=128):
    """q, k: (B, N, H, d_k), v: (B, N, H, d_v) -> o: (B, N, H, d_v); N a multiple of chunk_size."""
    import tilelang.language as T

    C = chunk_size

    @T.prim_func
    def whole_rows(
        Q: T.Tensor((B, N, H, d_k), dtype),
        K: T.Tensor((B, N, H, d_k), dtype),
        V: T.Tensor((B, N, H, d_v), dtype),
        O: T.Tensor((B, N, H, d_v), dtype),
    ):
        with T.Kernel(B * H, threads=threads) as i_bh:
            Q_s = T.alloc_shared((C, d_k), dtype)
            K_s = T.alloc_shared((C, d_k), dtype)
            V_s = T.alloc_shared((C, d_v), dtype)
            S_s = T.alloc_shared((d_k, d_v), dtype)
            scores_s = T.alloc_shared((C, C), dtype)
            S_f = T.alloc_fragment((d_k, d_v), "float32")
            scores = T.alloc_fragment((C, C), "float32")
            acc_o = T.alloc_fragment((C, d_v), "float32")

            T.clear(S_f)
            for i_c in T.Pipelined(N // C, num_stages=num_stages):
                t0 = i_c * C
                T.copy(Q[i_bh // H, t0:t0 + C, i_bh % H, :], Q_s)
                T.copy(K[i_bh // H, t0:t0 + C, i_bh % H, :], K_s)
                T.copy(V[i_bh // H, t0:t0 + C, i_bh % H, :], V_s)
                T.gemm(Q_s, K_s, scores, transpose_B=True, clear_accum=True)
                for r, j in T.Parallel(C, C):
                    scores[r, j] = T.if_then_else(r >= j, scores[r, j], 0.0)
                T.copy(scores, scores_s)
                T.gemm(scores_s, V_s, acc_o, clear_accum=True)  # intra-chunk first ...
                T.copy(S_f, S_s)
                T.gemm(Q_s, S_s, acc_o)  # ... then the state's part
                T.copy(acc_o, O[i_bh // H, t0:t0 + C, i_bh % H, :])
                T.gemm(K_s, V_s, S_f, transpose_A=True)

    return whole_rows
