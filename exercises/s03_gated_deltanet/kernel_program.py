"""Exercise s03.kernel_program (fix): the UT transform of a stage 3 TileLang program.

One program per (block of d_v columns, batch x head) keeps its slice of the state S^T (d_k x
block_dv) in an fp32 register fragment and walks the chunks. Per chunk it builds the decay table, L
and A_qk; the region between the markers then solves (I + L) X = [K ⊙ e^{gamma} | V] by forward
substitution on the tiles, turns X into W and U, and forms the pseudo-values V_new = U - W S^T that
the output and the state update read.

It is not the course's kernel: the inter-chunk term loads the queries from global memory a second
time (into a tile of their own, decayed there), so they cross twice per chunk; the build exercise
asks for fewer bytes. That is not the bug. The program compiles and looks right, and carries one
known bug, one that no compiler sees. Find it and fix it. Without a GPU the tests run the program
through the course's tile interpreter (stages.common.interpreter) and compare it with reference C;
with nvcc they also compile it for sm_90a, and on a GPU they run it.
Read: stage 3 page, "The kernel".  Check: course check s03
"""

from stages.common.tilelang_tools import LOG2_E
from stages.s03_gated_deltanet.kernel import DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE


def build_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=DEFAULT_BLOCK_DV,
                  dtype="float16", num_stages=2, threads=128):
    """The TileLang program for q, k: (B, N, H, d_k), v: (B, N, H, d_v), g: (B, N, H) fp32,
    beta: (B, N, H) fp32 -> o: (B, N, H, d_v). State S^T: (d_k, block_dv) per program.

    N must be a multiple of chunk_size (the wrapper pads), block_dv must divide d_v.
    """
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    num_chunks = N // C
    width = d_k + block_dv  # the columns of [K ⊙ e^{gamma} | V], solved together

    @T.prim_func
    def gated_deltanet_fwd(
        Q: T.Tensor((B, N, H, d_k), dtype),
        K: T.Tensor((B, N, H, d_k), dtype),
        V: T.Tensor((B, N, H, d_v), dtype),
        G: T.Tensor((B, N, H), accum_dtype),
        Beta: T.Tensor((B, N, H), accum_dtype),
        O: T.Tensor((B, N, H, d_v), dtype),
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv

            Q_s = T.alloc_shared((C, d_k), dtype)
            Q_decayed_s = T.alloc_shared((C, d_k), dtype)  # Q ⊙ e^{gamma}, for the inter-chunk term
            K_s = T.alloc_shared((C, d_k), dtype)
            V_s = T.alloc_shared((C, block_dv), dtype)
            gamma_s = T.alloc_shared((C,), accum_dtype)
            beta_s = T.alloc_shared((C,), accum_dtype)
            L_s = T.alloc_shared((C, C), accum_dtype)  # every thread reads row r of L
            X_s = T.alloc_shared((C, width), accum_dtype)  # [K ⊙ e^{gamma} | V], solved in place
            W_s = T.alloc_shared((C, d_k), dtype)
            S_s = T.alloc_shared((d_k, block_dv), dtype)  # the state as a GEMM operand
            A_qk_s = T.alloc_shared((C, C), dtype)
            V_new_s = T.alloc_shared((C, block_dv), dtype)

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state: lives across chunks
            Gamma = T.alloc_fragment((C, C), accum_dtype)
            scores = T.alloc_fragment((C, C), accum_dtype)  # K K^T, then Q K^T
            W_S = T.alloc_fragment((C, block_dv), accum_dtype)
            acc_o = T.alloc_fragment((C, block_dv), accum_dtype)

            T.clear(S_f)  # once, outside the chunk loop: the state carries over
            for i_c in T.Pipelined(num_chunks, num_stages=num_stages):
                t0 = i_c * C
                T.copy(Q[b, t0:t0 + C, h, :], Q_s)
                T.copy(K[b, t0:t0 + C, h, :], K_s)
                T.copy(V[b, t0:t0 + C, h, v0:v0 + block_dv], V_s)
                # gamma restarts at every chunk; each row sums its own prefix (C threads, no scan)
                for r in T.Parallel(C):
                    beta_s[r] = Beta[b, t0 + r, h]
                    gamma_s[r] = 0
                    for j in T.serial(r + 1):
                        gamma_s[r] += G[b, t0 + j, h]

                # the decay table; above the diagonal the exponent is positive and unused
                for c, i in T.Parallel(C, C):
                    Gamma[c, i] = T.if_then_else(i <= c, T.exp2((gamma_s[c] - gamma_s[i]) * LOG2_E), 0)

                # L[c, i] = beta_i e^{gamma_c - gamma_i} k_c . k_i, strictly below the diagonal
                T.gemm(K_s, K_s, scores, transpose_B=True, clear_accum=True)
                for c, i in T.Parallel(C, C):
                    L_s[c, i] = T.if_then_else(i < c, beta_s[i] * scores[c, i] * Gamma[c, i], 0)
                # A_qk[c, j] = e^{gamma_c - gamma_j} q_c . k_j, the diagonal included
                T.gemm(Q_s, K_s, scores, transpose_B=True, clear_accum=True)
                for c, j in T.Parallel(C, C):
                    A_qk_s[c, j] = T.if_then_else(j <= c, scores[c, j] * Gamma[c, j], 0)

                # EXERCISE BEGIN
                # the right-hand sides [K ⊙ e^{gamma} | V], solved together
                for r, d in T.Parallel(C, d_k):
                    X_s[r, d] = beta_s[r] * K_s[r, d] * T.exp2(gamma_s[r] * LOG2_E)
                for r, j in T.Parallel(C, block_dv):
                    X_s[r, d_k + j] = beta_s[r] * V_s[r, j]

                # one forward substitution for both right-hand sides: row r needs rows j < r solved
                for r in T.serial(1, C):
                    for col in T.Parallel(width):
                        for j in T.serial(r):
                            X_s[r, col] -= L_s[r, j] * X_s[j, col]

                # W, U, and the pseudo-values V_new = U - W S^T
                for r, d in T.Parallel(C, d_k):
                    W_s[r, d] = X_s[r, d]
                T.copy(S_f, S_s)
                T.gemm(W_s, S_s, W_S, clear_accum=True)
                for r, j in T.Parallel(C, block_dv):
                    V_new_s[r, j] = X_s[r, d_k + j] - W_S[r, j]  # U - W S^T
                # EXERCISE END

                # the inter-chunk term reads the queries decayed, Q ⊙ e^{gamma}, from a tile of their own
                T.copy(Q[b, t0:t0 + C, h, :], Q_decayed_s)
                for r, d in T.Parallel(C, d_k):
                    Q_decayed_s[r, d] = Q_decayed_s[r, d] * T.exp2(gamma_s[r] * LOG2_E)
                T.gemm(Q_decayed_s, S_s, acc_o, clear_accum=True)
                T.gemm(A_qk_s, V_new_s, acc_o)
                T.copy(acc_o, O[b, t0:t0 + C, h, v0:v0 + block_dv])

                # only now does the state move past this chunk: decay it first, then add
                # (K ⊙ e^{gamma_C - gamma})^T V_new, the chunk's keys decayed to the chunk's end
                for d, j in T.Parallel(d_k, block_dv):
                    S_f[d, j] *= T.exp2(gamma_s[C - 1] * LOG2_E)
                for r, d in T.Parallel(C, d_k):
                    K_s[r, d] = K_s[r, d] * T.exp2((gamma_s[C - 1] - gamma_s[r]) * LOG2_E)
                T.gemm(K_s, V_new_s, S_f, transpose_A=True)

    return gated_deltanet_fwd
