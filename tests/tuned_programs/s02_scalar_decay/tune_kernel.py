"""A second answer to exercise s02.tune_kernel, written apart from the course's kernel: the key decay
scales V_s in place once the intra-chunk GEMM has read it (one shared buffer fewer), the query decay
is Gamma's first column times alpha, and the chunk loop runs unpipelined on 256 threads. The tune
tests pass on it as on the solution (tests/course/test_tune_exercises.py): any program under the target does.
"""

from stages.common.tilelang_tools import LOG2_E


def build_program(B, N, H, d_k, d_v, chunk_size=64, block_dv=32, dtype="float16", num_stages=1, threads=256):
    """q, k: (B, N, H, d_k), v: (B, N, H, d_v), g: (H,) float32 -> o: (B, N, H, d_v)."""
    import tilelang.language as T

    C = chunk_size

    @T.prim_func
    def tuned(
        Q: T.Tensor((B, N, H, d_k), dtype),
        K: T.Tensor((B, N, H, d_k), dtype),
        V: T.Tensor((B, N, H, d_v), dtype),
        G: T.Tensor((H,), "float32"),
        O: T.Tensor((B, N, H, d_v), dtype),
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv
            Q_s = T.alloc_shared((C, d_k), dtype)
            K_s = T.alloc_shared((C, d_k), dtype)
            V_s = T.alloc_shared((C, block_dv), dtype)  # V, then key_decay ⊙ V in place
            S_s = T.alloc_shared((d_k, block_dv), dtype)
            P_s = T.alloc_shared((C, C), dtype)  # decayed, masked scores
            to_end_s = T.alloc_shared((C,), "float32")  # alpha^(C - 1 - r)
            S = T.alloc_fragment((d_k, block_dv), "float32")
            P = T.alloc_fragment((C, C), "float32")
            out = T.alloc_fragment((C, block_dv), "float32")
            gamma = T.alloc_fragment((C, C), "float32")
            from_start = T.alloc_fragment((C,), "float32")  # alpha^(r + 1)
            across = T.alloc_var("float32")

            log2_alpha = G[h] * LOG2_E
            for r, j in T.Parallel(C, C):
                gamma[r, j] = T.if_then_else(j <= r, T.exp2((r - j) * log2_alpha), 0)
            for r in T.Parallel(C):
                from_start[r] = gamma[r, 0] * T.exp2(log2_alpha)
                to_end_s[r] = T.exp2((C - 1 - r) * log2_alpha)
            across = T.exp2(C * log2_alpha)
            T.fill(S, 0)
            for i_c in T.Pipelined(N // C, num_stages=num_stages):
                T.copy(Q[b, i_c * C:(i_c + 1) * C, h, :], Q_s)
                T.copy(K[b, i_c * C:(i_c + 1) * C, h, :], K_s)
                T.copy(V[b, i_c * C:(i_c + 1) * C, h, v0:v0 + block_dv], V_s)
                T.gemm(Q_s, K_s, P, transpose_B=True, clear_accum=True)
                for r, j in T.Parallel(C, C):
                    P_s[r, j] = P[r, j] * gamma[r, j]
                T.copy(S, S_s)
                T.gemm(Q_s, S_s, out, clear_accum=True)
                for r, c in T.Parallel(C, block_dv):
                    out[r, c] = out[r, c] * from_start[r]
                T.gemm(P_s, V_s, out)
                T.copy(out, O[b, i_c * C:(i_c + 1) * C, h, v0:v0 + block_dv])
                for r, c in T.Parallel(C, block_dv):
                    V_s[r, c] = V_s[r, c] * to_end_s[r]
                for d, c in T.Parallel(d_k, block_dv):
                    S[d, c] = S[d, c] * across
                T.gemm(K_s, V_s, S, transpose_A=True)

    return tuned
