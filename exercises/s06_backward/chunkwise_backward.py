"""Exercise s06.chunkwise_backward (fix): reference B's backward, one chunk at a time, in reverse.

The forward of chunk [t] (stage 4's reference B; S^T the state at the chunk start, S'^T after it):
    M[c, i] = (k_c ⊙ e^{gamma_c - gamma_i}) . k_i (i < c),  A_qk the same with q_c (i <= c),
    T = (I + M diag(beta))^{-1},  A_hat = diag(beta) T,  W = A_hat (K ⊙ e^{gamma}),  U = A_hat V,
    V_new = U - W S^T,  O = (Q ⊙ e^{gamma}) S^T + A_qk V_new,
    S'^T = Diag(e^{gamma_C}) S^T + (K ⊙ e^{gamma_C - gamma})^T V_new,   gamma = cumsum(g) in the chunk.
The backward takes these lines back from the last to the first, given dO and dS'^T. Besides the
gradients of the inputs it returns those of every chunk's two score matrices, dA_qk and dM, a row per
token: what only a chunked backward forms.

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 6 page, "Reference B: chunk by chunk".  Check: course check s06
"""

import numpy as np

from stages.common.checks import Float64Array, check_chunking
from stages.s06_backward.reference import ChunkwiseGradients, check_gradient_inputs, chunk_forward  # one chunk's forward


def chunkwise_backward(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                       do: Float64Array, chunk_size: int, initial_state: Float64Array | None = None,
                       d_final_state: Float64Array | None = None) -> ChunkwiseGradients:
    """Reference B: chunk by chunk, in reverse. State S^T: (d_k, d_v), the kernel layout; dS^T likewise.

    Arguments as `recurrent_backward`'s, and chunk_size C (the last chunk may be shorter). The forward
    keeps S^T at every chunk start; the backward recomputes the rest of a chunk and takes each of its
    forward lines back, last line first. Returns the gradients with dA_qk and dM of every chunk
    (ChunkwiseGradients).
    """
    B, N, H, d_k, d_v = check_gradient_inputs(q, k, v, g, beta, do, initial_state, d_final_state)
    check_chunking(N, d_v, chunk_size)
    dq, dk, dg = (np.zeros((B, N, H, d_k)) for _ in range(3))
    dv, o = np.zeros((B, N, H, d_v)), np.zeros((B, N, H, d_v))
    dbeta = np.zeros((B, N, H))
    d_initial_state, final_state = np.zeros((B, H, d_k, d_v)), np.zeros((B, H, d_k, d_v))
    dA_qk_rows, dM_rows = np.zeros((B, N, H, chunk_size)), np.zeros((B, N, H, chunk_size))  # each token's row
    chunks = [slice(start, min(start + chunk_size, N)) for start in range(0, N, chunk_size)]
    for b in range(B):
        for h in range(H):
            S_T = np.zeros((d_k, d_v)) if initial_state is None else initial_state[b, h].copy()
            chunk_start_states = []
            for rows in chunks:  # forward: stage 4's reference B, keeping S^T at every chunk start
                chunk_start_states.append(S_T)
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h]
                f = chunk_forward(Q, K, V, g[b, rows, h], beta[b, rows, h])
                V_new = f.U - f.W @ S_T
                o[b, rows, h] = (Q * np.exp(f.gamma)) @ S_T + f.A_qk @ V_new
                S_T = np.exp(f.gamma[-1])[:, None] * S_T + (K * np.exp(f.gamma[-1] - f.gamma)).T @ V_new
            final_state[b, h] = S_T

            dS_T = np.zeros((d_k, d_v)) if d_final_state is None else d_final_state[b, h].copy()
            for rows, S_T in reversed(list(zip(chunks, chunk_start_states))):  # backward, last chunk first
                Q, K, V, beta_c, dO = q[b, rows, h], k[b, rows, h], v[b, rows, h], beta[b, rows, h], do[b, rows, h]
                f = chunk_forward(Q, K, V, g[b, rows, h], beta_c)
                C, gamma = len(Q), f.gamma
                decay_to_end = np.exp(gamma[-1] - gamma)  # (C, d_k)
                V_new = f.U - f.W @ S_T
                dQ, dK, dgamma = np.zeros((C, d_k)), np.zeros((C, d_k)), np.zeros((C, d_k))
                dbeta_c = np.zeros(C)

                # EXERCISE BEGIN
                # S'^T = Diag(e^{gamma_C}) S^T + (K ⊙ e^{gamma_C - gamma})^T V_new
                dV_new = (K * decay_to_end) @ dS_T
                dK_to_end = V_new @ dS_T.T  # d(K ⊙ e^{gamma_C - gamma})
                dK += dK_to_end * decay_to_end
                dgamma -= dK_to_end * K * decay_to_end  # the exponent -gamma[r] ...
                dgamma[-1] += np.sum(dK_to_end * K * decay_to_end, axis=0)  # ... and +gamma_C
                dgamma[-1] += np.exp(gamma[-1]) * np.sum(S_T * dS_T, axis=1)  # Diag(e^{gamma_C}) S^T
                dS_T_before = np.exp(gamma[-1])[:, None] * dS_T

                # O = (Q ⊙ e^{gamma}) S^T + A_qk V_new
                dQ_decayed = dO @ S_T.T
                dQ += dQ_decayed * np.exp(gamma)
                dgamma += dQ_decayed * Q * np.exp(gamma)
                dS_T_before += (Q * np.exp(gamma)).T @ dO
                dA_qk = np.tril(dO @ V_new.T)  # j <= c
                dV_new += f.A_qk.T @ dO

                # V_new = U - W S^T
                dU, dW = dV_new, -dV_new @ S_T.T
                dS_T_before -= f.W.T @ dV_new

                # W = A_hat (K ⊙ e^{gamma}),  U = A_hat V
                dA_hat = dW @ (K * np.exp(gamma)).T + dU @ V.T
                dK_decayed = f.A_hat.T @ dW
                dK += dK_decayed * np.exp(gamma)
                dgamma += dK_decayed * K * np.exp(gamma)
                dv[b, rows, h] = f.A_hat.T @ dU

                # A_hat = diag(beta) T,  T = (I + L)^{-1},  L[c, i] = beta_i M[c, i]
                dbeta_c += np.sum(dA_hat * f.T, axis=1)  # beta by rows, after the solve
                dT = beta_c[:, None] * dA_hat
                dL = np.tril(-f.T @ dT @ f.T, -1)  # strict: i < c
                dbeta_c += np.sum(dL * f.M, axis=0)  # beta by columns, inside the solve
                dM = dL * beta_c[None, :]
                dA_qk_rows[b, rows, h, :C], dM_rows[b, rows, h, :C] = dA_qk, dM

                # M[c, i] and A_qk[c, j]: plain loops, as the forward computes them
                for c in range(C):
                    for i in range(c + 1):
                        decay = np.exp(gamma[c] - gamma[i])
                        if i < c:
                            dK[c] += dM[c, i] * K[i] * decay
                            dK[i] += dM[c, i] * K[c] * decay
                            dgamma[c] += dM[c, i] * K[c] * K[i] * decay
                            dgamma[i] -= dM[c, i] * K[c] * K[i] * decay
                        dQ[c] += dA_qk[c, i] * K[i] * decay
                        dK[i] += dA_qk[c, i] * Q[c] * decay
                        dgamma[c] += dA_qk[c, i] * Q[c] * K[i] * decay
                        dgamma[i] -= dA_qk[c, i] * Q[c] * K[i] * decay

                # gamma[r] = g[0] + ... + g[r]: a reverse cumulative sum over the chunk
                dG = np.zeros((C, d_k))
                running = np.zeros(d_k)
                for r in reversed(range(C)):
                    running = running + dgamma[r]
                    dG[r] = running
                dq[b, rows, h], dk[b, rows, h], dg[b, rows, h], dbeta[b, rows, h] = dQ, dK, dG, dbeta_c
                # EXERCISE END
                dS_T = dS_T_before
            d_initial_state[b, h] = dS_T
    return ChunkwiseGradients(dq, dk, dv, dg, dbeta, d_initial_state, o, final_state, dA_qk_rows, dM_rows)
