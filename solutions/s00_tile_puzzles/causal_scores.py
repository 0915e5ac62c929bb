"""Puzzle s00.causal_scores (fill): a causal mask on a GEMM's result.

S[c, r, j] = Q_c[r] . K_c[j] where j <= r, and 0 where j > r: the scores of chunk c (its C
queries against its C keys, Q_c = Q[c * C:(c + 1) * C]) with the future masked out and the
diagonal kept, as every stage's intra-chunk term needs them. One block per chunk; its loads are
written. Multiply Q_s by K_s transposed into the fragment S_f, mask S_f in a T.Parallel loop over
its (r, j) elements, store it into S[c].

Read: stage 0 page, "s00.causal_scores".  Check: course check s00.causal_scores
"""


def causal_scores(N, d, chunk_size=16, threads=32, dtype="float16", accum_dtype="float32"):
    """The TileLang program for Q, K: (N, d) -> S: (N // chunk_size, chunk_size, chunk_size) in
    accum_dtype, each chunk's Q K^T masked to j <= r. One warp (threads=32) for a chunk of 16: a
    warp's share of a GEMM is a multiple of 16 rows."""
    import tilelang.language as T

    C = chunk_size

    @T.prim_func
    def causal_scores_program(Q: T.Tensor((N, d), dtype), K: T.Tensor((N, d), dtype),
                              S: T.Tensor((N // C, C, C), accum_dtype)):
        with T.Kernel(N // C, threads=threads) as c:
            Q_s = T.alloc_shared((C, d), dtype)
            K_s = T.alloc_shared((C, d), dtype)
            S_f = T.alloc_fragment((C, C), accum_dtype)
            T.copy(Q[c * C:(c + 1) * C, :], Q_s)
            T.copy(K[c * C:(c + 1) * C, :], K_s)
            # EXERCISE BEGIN
            # --8<-- [start:answer]
            T.gemm(Q_s, K_s, S_f, transpose_B=True, clear_accum=True)
            for r, j in T.Parallel(C, C):
                S_f[r, j] = T.if_then_else(j <= r, S_f[r, j], 0)
            T.copy(S_f, S[c, :, :])
            # --8<-- [end:answer]
            # EXERCISE END

    return causal_scores_program
