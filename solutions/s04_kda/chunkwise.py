"""Exercise s04.chunkwise (fill): reference B, KDA chunk by chunk.

For chunk [t] with rows Q, K, V, write strengths beta, gates G and gamma[r] = G[0] + ... + G[r]
(a vector of d_k log decays), and the state S^T (d_k x d_v, the kernel layout) left by the chunks
before it:
    M[c, i]    = (k_c ⊙ e^{gamma_c - gamma_i}) · k_i  for i < c      (plain loops)
    T          = (I + L)^{-1},  L[c, i] = beta_i M[c, i]
    W, U       = diag(beta) T (K ⊙ e^{gamma}),  diag(beta) T V
    V_new      = U - W S^T
    A_qk[c, j] = (q_c ⊙ e^{gamma_c - gamma_j}) · k_j  for j <= c     (plain loops)
    O          = (Q ⊙ e^{gamma}) S^T + A_qk V_new
    S^T       <- Diag(e^{gamma_C}) S^T + (K ⊙ e^{gamma_C - gamma})^T V_new

Fill the region. Besides o, record what only the chunked form has: the state as each chunk starts
(chunk_start_states) and each chunk's A_qk, W and U, a row per token. The last chunk may be shorter.
Read: stage 4 page, "Reference B: chunk by chunk".  Check: course check s04
"""

import numpy as np

from stages.common.checks import (Float64Array, check_chunking, check_gate_and_beta, check_qkv,
                                  padded_length)
from stages.s04_kda.reference import ChunkwiseOutput


def chunkwise(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
              chunk_size: int) -> ChunkwiseOutput:
    """Reference B: chunk by chunk, plain loops for M and A_qk, the UT transform by inversion.
    State S^T: (d_k, d_v).

    Returns o with the state at every chunk start, every chunk's A_qk, W and U (ChunkwiseOutput).
    The last chunk may be shorter than chunk_size: nothing in the math needs equal chunks.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="channel")
    check_chunking(N, d_v, chunk_size)
    o = np.zeros((B, N, H, d_v))
    chunk_start_states = np.zeros((B, padded_length(N, chunk_size) // chunk_size, H, d_k, d_v))
    A_qk_rows = np.zeros((B, N, H, chunk_size))  # each token's row of its chunk's A_qk
    W_rows, U_rows = np.zeros((B, N, H, d_k)), np.zeros((B, N, H, d_v))
    # EXERCISE BEGIN
    for b in range(B):
        for h in range(H):
            S_T = np.zeros((d_k, d_v))
            for start in range(0, N, chunk_size):
                rows = slice(start, min(start + chunk_size, N))
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h]
                beta_c = beta[b, rows, h]
                C = len(Q)
                gamma = np.cumsum(g[b, rows, h], axis=0)  # (C, d_k): log decay from the chunk start
                M = np.zeros((C, C))
                for c in range(C):
                    for i in range(c):  # i < c: strictly lower triangular
                        M[c, i] = (K[c] * np.exp(gamma[c] - gamma[i])) @ K[i]
                L = M * beta_c[None, :]  # L[c, i] = beta_i M[c, i] ...
                T = np.linalg.inv(np.eye(C) + L)
                A_hat = beta_c[:, None] * T  # ... pairs with diag(beta) T
                W = A_hat @ (K * np.exp(gamma))
                U = A_hat @ V
                V_new = U - W @ S_T
                A_qk = np.zeros((C, C))
                for c in range(C):
                    for j in range(c + 1):  # j <= c: a token sees itself, undecayed
                        A_qk[c, j] = (Q[c] * np.exp(gamma[c] - gamma[j])) @ K[j]
                o[b, rows, h] = (Q * np.exp(gamma)) @ S_T + A_qk @ V_new
                chunk_start_states[b, start // chunk_size, h] = S_T
                A_qk_rows[b, rows, h, :C], W_rows[b, rows, h], U_rows[b, rows, h] = A_qk, W, U
                decay_to_chunk_end = np.exp(gamma[-1] - gamma)  # (C, d_k), every entry <= 1
                S_T = np.exp(gamma[-1])[:, None] * S_T + (K * decay_to_chunk_end).T @ V_new
    # EXERCISE END
    return ChunkwiseOutput(o, chunk_start_states, A_qk_rows, W_rows, U_rows)
