"""A second correct answer to exercise s05.build_kernel, unlike the course's recurrence kernel: the
grid's axes are swapped (batch x head first); the output is stored from its fragment, not staged in
shared memory; the intra-chunk term is summed before the inter-chunk one; the pseudo-values go to
shared memory straight from a loop; and the state's decay is read from global memory where it is used.

tests/course/test_build_exercises.py runs the exercise's tests on it (a folder target laid out like
exercises/). Kept out of tests/exercises/, which the handout ships.
"""


def build_recurrence_program(B, N, H, d_k, d_v, chunk_size=64, block_dv=32, dtype="float16", num_stages=2,
                             threads=128):
    """Prepared W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay and S_0^T -> o, the final S^T."""
    import tilelang.language as T

    C = chunk_size

    @T.prim_func
    def unstaged(
        W: T.Tensor((B, N, H, d_k), dtype),
        U: T.Tensor((B, N, H, d_v), dtype),
        Q_decayed: T.Tensor((B, N, H, d_k), dtype),
        K_to_chunk_end: T.Tensor((B, N, H, d_k), dtype),
        A_qk: T.Tensor((B, N, H, C), dtype),
        Chunk_decay: T.Tensor((B, N // C, H, d_k), "float32"),
        Initial_state: T.Tensor((B, H, d_k, d_v), "float32"),
        O: T.Tensor((B, N, H, d_v), dtype),
        Final_state: T.Tensor((B, H, d_k, d_v), "float32"),
    ):
        with T.Kernel(B * H, d_v // block_dv, threads=threads) as (i_bh, i_v):
            b, h, v0 = i_bh // H, i_bh % H, i_v * block_dv
            W_s = T.alloc_shared((C, d_k), dtype)
            U_s = T.alloc_shared((C, block_dv), dtype)
            Q_s = T.alloc_shared((C, d_k), dtype)
            K_s = T.alloc_shared((C, d_k), dtype)
            A_s = T.alloc_shared((C, C), dtype)
            S_s = T.alloc_shared((d_k, block_dv), dtype)
            V_new_s = T.alloc_shared((C, block_dv), dtype)
            S_f = T.alloc_fragment((d_k, block_dv), "float32")
            W_S = T.alloc_fragment((C, block_dv), "float32")
            acc_o = T.alloc_fragment((C, block_dv), "float32")

            T.copy(Initial_state[b, h, :, v0:v0 + block_dv], S_f)
            for i_c in T.Pipelined(N // C, num_stages=num_stages):
                t0 = i_c * C
                T.copy(W[b, t0:t0 + C, h, :], W_s)
                T.copy(U[b, t0:t0 + C, h, v0:v0 + block_dv], U_s)
                T.copy(Q_decayed[b, t0:t0 + C, h, :], Q_s)
                T.copy(K_to_chunk_end[b, t0:t0 + C, h, :], K_s)
                T.copy(A_qk[b, t0:t0 + C, h, :], A_s)

                T.copy(S_f, S_s)
                T.gemm(W_s, S_s, W_S, clear_accum=True)
                for r, c in T.Parallel(C, block_dv):
                    V_new_s[r, c] = U_s[r, c] - W_S[r, c]
                T.gemm(A_s, V_new_s, acc_o, clear_accum=True)  # intra-chunk first ...
                T.gemm(Q_s, S_s, acc_o)  # ... then the state's part
                T.copy(acc_o, O[b, t0:t0 + C, h, v0:v0 + block_dv])

                for d, c in T.Parallel(d_k, block_dv):
                    S_f[d, c] *= Chunk_decay[b, i_c, h, d]
                T.gemm(K_s, V_new_s, S_f, transpose_A=True)
            T.copy(S_f, Final_state[b, h, :, v0:v0 + block_dv])

    return unstaged
