"""Exercise s06.kernel_program (fix): the reverse chunk loop of stage 6's backward, as a TileLang program.

One program per (block of d_v columns, batch x head) carries dS^T (d_k x block_dv, fp32 registers)
from the gradient of the final state back to the gradient of the initial state, one chunk at a time,
the last chunk first. Per chunk, with dS'^T the gradient of the state the chunk ends with:
    dV_new = (K e^{gamma_C - gamma}) dS'^T + A_qk^T dO
    dS^T   = Diag(e^{gamma_C}) dS'^T + (Q e^gamma)^T dO - W^T dV_new
The prepared tensors (Q e^gamma, K e^{gamma_C - gamma}, W, A_qk, e^{gamma_C}) are stage 5's prepare
kernel's outputs, computed again for the backward.

This program builds, runs and looks right, and carries one known bug. Find it and fix it.
Without a GPU the tests run it through the course's tile interpreter (stages.common.interpreter) and
compare its three outputs with reference C's state_gradients; with nvcc they also compile it for
sm_90a, and on a GPU they run it.
Read: stage 6 page, "One chunk backwards" and "Reference C: the kernel's control flow".
Check: course check s06
"""

from stages.s05_fast_kda.kernel import DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE


def build_state_gradient_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=DEFAULT_BLOCK_DV,
                                 dtype="float16", num_stages=2, threads=128):
    """The reverse chunk loop: Q e^gamma, K e^{gamma_C - gamma}, W (B, N, H, d_k), A_qk (B, N, H, C),
    dO (B, N, H, d_v) in `dtype`, e^{gamma_C} (B, N / C, H, d_k) and dS_N^T (B, H, d_k, d_v) in fp32
    -> dS^T at every chunk end (B, N / C, H, d_k, d_v) and dV_new (B, N, H, d_v) in `dtype`, and
    dS_0^T (B, H, d_k, d_v) in fp32.
    """
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    num_chunks = N // C

    @T.prim_func
    def kda_state_gradient(
        Q_decayed: T.Tensor((B, N, H, d_k), dtype),
        K_to_chunk_end: T.Tensor((B, N, H, d_k), dtype),
        W: T.Tensor((B, N, H, d_k), dtype),
        A_qk: T.Tensor((B, N, H, C), dtype),
        Chunk_decay: T.Tensor((B, num_chunks, H, d_k), accum_dtype),
        dO: T.Tensor((B, N, H, d_v), dtype),
        D_final_state: T.Tensor((B, H, d_k, d_v), accum_dtype),
        D_states: T.Tensor((B, num_chunks, H, d_k, d_v), dtype),
        dV_new: T.Tensor((B, N, H, d_v), dtype),
        D_initial_state: T.Tensor((B, H, d_k, d_v), accum_dtype),
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv

            Q_decayed_s = T.alloc_shared((C, d_k), dtype)
            K_to_chunk_end_s = T.alloc_shared((C, d_k), dtype)
            W_s = T.alloc_shared((C, d_k), dtype)
            A_qk_s = T.alloc_shared((C, C), dtype)
            chunk_decay_s = T.alloc_shared((d_k,), accum_dtype)
            dO_s = T.alloc_shared((C, block_dv), dtype)
            dS_s = T.alloc_shared((d_k, block_dv), dtype)  # dS'^T as a GEMM operand, and as stored
            dV_new_s = T.alloc_shared((C, block_dv), dtype)
            minus_dV_new_s = T.alloc_shared((C, block_dv), dtype)  # the GEMM adds: -W^T dV_new

            dS_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state's gradient: lives across chunks
            dV_new_f = T.alloc_fragment((C, block_dv), accum_dtype)

            T.copy(D_final_state[b, h, :, v0:v0 + block_dv], dS_f)
            for step in T.Pipelined(num_chunks, num_stages=num_stages):
                i_c = num_chunks - 1 - step  # the last chunk first
                t0 = i_c * C
                T.copy(Q_decayed[b, t0:t0 + C, h, :], Q_decayed_s)
                T.copy(K_to_chunk_end[b, t0:t0 + C, h, :], K_to_chunk_end_s)
                T.copy(W[b, t0:t0 + C, h, :], W_s)
                T.copy(A_qk[b, t0:t0 + C, h, :], A_qk_s)
                T.copy(Chunk_decay[b, i_c, h, :], chunk_decay_s)
                T.copy(dO[b, t0:t0 + C, h, v0:v0 + block_dv], dO_s)

                # EXERCISE BEGIN
                T.copy(dS_f, dS_s)
                T.fence_proxy_async()  # dS_s seen by the TMA store (stages/kda/tiles.py: "TMA stores")
                T.copy(dS_s, D_states[b, i_c, h, :, v0:v0 + block_dv])  # the gradient this chunk ends with
                # through the state update, then through the output
                T.gemm(K_to_chunk_end_s, dS_s, dV_new_f, clear_accum=True)
                T.gemm(A_qk_s, dO_s, dV_new_f, transpose_A=True)
                for r, j in T.Parallel(C, block_dv):
                    dV_new_s[r, j] = dV_new_f[r, j]
                    minus_dV_new_s[r, j] = -dV_new_f[r, j]
                T.fence_proxy_async()  # dV_new_s seen by the TMA store (stages/kda/tiles.py: "TMA stores")
                T.copy(dV_new_s, dV_new[b, t0:t0 + C, h, v0:v0 + block_dv])

                # back past the chunk
                T.gemm(Q_decayed_s, dO_s, dS_f, transpose_A=True)
                T.gemm(W_s, minus_dV_new_s, dS_f, transpose_A=True)
                for d, j in T.Parallel(d_k, block_dv):
                    dS_f[d, j] *= chunk_decay_s[d]
                # EXERCISE END
            T.copy(dS_f, D_initial_state[b, h, :, v0:v0 + block_dv])

    return kda_state_gradient
