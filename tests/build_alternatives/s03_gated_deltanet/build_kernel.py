"""A second correct answer to exercise s03.build_kernel, unlike the course's kernel: the grid's axes
are swapped (batch x head first), beta is paired with the rows of the system instead of its columns,
(I + diag(beta) M) Y = diag(beta) [K ⊙ e^{gamma} | V], so that Y is [W | U] with no scaling after the
solve; the intra-chunk term is summed before the inter-chunk one; and the decayed queries and keys
get tiles of their own.

The pairing is right: with L = M diag(beta) the course solves (I + L) X = R and takes diag(beta) X;
multiplying that system on the left by diag(beta) gives (I + diag(beta) M) (diag(beta) X) = diag(beta) R.

tests/course/test_build_exercises.py runs the exercise's tests on it (a folder target laid out like
exercises/). Kept out of tests/exercises/, which the handout ships.
"""

LOG2_E = 1.4426950408889634


def build_program(B, N, H, d_k, d_v, chunk_size=64, block_dv=32, dtype="float16", num_stages=2, threads=128):
    """q, k: (B, N, H, d_k), v: (B, N, H, d_v), g, beta: (B, N, H) float32 -> o: (B, N, H, d_v)."""
    import tilelang.language as T

    C = chunk_size
    width = d_k + block_dv

    @T.prim_func
    def row_paired(
        Q: T.Tensor((B, N, H, d_k), dtype),
        K: T.Tensor((B, N, H, d_k), dtype),
        V: T.Tensor((B, N, H, d_v), dtype),
        G: T.Tensor((B, N, H), "float32"),
        Beta: T.Tensor((B, N, H), "float32"),
        O: T.Tensor((B, N, H, d_v), dtype),
    ):
        with T.Kernel(B * H, d_v // block_dv, threads=threads) as (i_bh, i_v):
            b, h, v0 = i_bh // H, i_bh % H, i_v * block_dv
            Q_s = T.alloc_shared((C, d_k), dtype)
            K_s = T.alloc_shared((C, d_k), dtype)
            V_s = T.alloc_shared((C, block_dv), dtype)
            Q_decayed_s = T.alloc_shared((C, d_k), dtype)
            K_to_end_s = T.alloc_shared((C, d_k), dtype)
            gamma_s = T.alloc_shared((C,), "float32")
            beta_s = T.alloc_shared((C,), "float32")
            L_s = T.alloc_shared((C, C), "float32")
            Y_s = T.alloc_shared((C, width), "float32")
            W_s = T.alloc_shared((C, d_k), dtype)
            S_s = T.alloc_shared((d_k, block_dv), dtype)
            A_qk_s = T.alloc_shared((C, C), dtype)
            V_new_s = T.alloc_shared((C, block_dv), dtype)
            S_f = T.alloc_fragment((d_k, block_dv), "float32")
            scores = T.alloc_fragment((C, C), "float32")
            W_S = T.alloc_fragment((C, block_dv), "float32")
            acc_o = T.alloc_fragment((C, block_dv), "float32")

            T.clear(S_f)
            for i_c in T.Pipelined(N // C, num_stages=num_stages):
                t0 = i_c * C
                T.copy(Q[b, t0:t0 + C, h, :], Q_s)
                T.copy(K[b, t0:t0 + C, h, :], K_s)
                T.copy(V[b, t0:t0 + C, h, v0:v0 + block_dv], V_s)
                for r in T.Parallel(C):
                    beta_s[r] = Beta[b, t0 + r, h]
                    gamma_s[r] = 0
                    for j in T.serial(r + 1):
                        gamma_s[r] += G[b, t0 + j, h]

                T.gemm(K_s, K_s, scores, transpose_B=True, clear_accum=True)
                for c, i in T.Parallel(C, C):  # beta of the row: L = diag(beta) M
                    L_s[c, i] = T.if_then_else(
                        i < c, beta_s[c] * scores[c, i] * T.exp2((gamma_s[c] - gamma_s[i]) * LOG2_E), 0.0)
                T.gemm(Q_s, K_s, scores, transpose_B=True, clear_accum=True)
                for c, j in T.Parallel(C, C):
                    A_qk_s[c, j] = T.if_then_else(j <= c, scores[c, j] * T.exp2((gamma_s[c] - gamma_s[j]) * LOG2_E), 0.0)

                for r, d in T.Parallel(C, d_k):  # the right-hand side already carries beta
                    Y_s[r, d] = beta_s[r] * K_s[r, d] * T.exp2(gamma_s[r] * LOG2_E)
                for r, d in T.Parallel(C, block_dv):
                    Y_s[r, d_k + d] = beta_s[r] * V_s[r, d]
                for r in T.serial(1, C):
                    for d in T.Parallel(width):
                        for j in T.serial(r):
                            Y_s[r, d] -= L_s[r, j] * Y_s[j, d]

                for r, d in T.Parallel(C, d_k):
                    W_s[r, d] = Y_s[r, d]
                    Q_decayed_s[r, d] = Q_s[r, d] * T.exp2(gamma_s[r] * LOG2_E)
                    K_to_end_s[r, d] = K_s[r, d] * T.exp2((gamma_s[C - 1] - gamma_s[r]) * LOG2_E)
                T.copy(S_f, S_s)
                T.gemm(W_s, S_s, W_S, clear_accum=True)
                for r, d in T.Parallel(C, block_dv):
                    V_new_s[r, d] = Y_s[r, d_k + d] - W_S[r, d]

                T.gemm(A_qk_s, V_new_s, acc_o, clear_accum=True)
                T.gemm(Q_decayed_s, S_s, acc_o)
                T.copy(acc_o, O[b, t0:t0 + C, h, v0:v0 + block_dv])

                for d, c in T.Parallel(d_k, block_dv):
                    S_f[d, c] *= T.exp2(gamma_s[C - 1] * LOG2_E)
                T.gemm(K_to_end_s, V_new_s, S_f, transpose_A=True)

    return row_paired
