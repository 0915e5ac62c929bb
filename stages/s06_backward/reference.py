"""Stage 6 references in NumPy float64: the gradients of KDA, token by token and chunk by chunk.

    S_t = S_{t-1} Diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T        o_t = S_t q_t
                                                             (paper layout: S is d_v x d_k)

The forward pass is stage 4's, with an initial state S_0 and the final state S_N as an output.
Given do = dLoss/do (B, N, H, d_v) and, optionally, dLoss/dS_N, each function returns the gradients
of the loss with respect to q, k (B, N, H, d_k), v (B, N, H, d_v), the log gates g = log a
(B, N, H, d_k), beta (B, N, H) and S_0. Both states, and their gradients, are passed as S^T in the
kernel layout, (B, H, d_k, d_v), the layout of stage 5's `initial_state` and FLA's.

- `recurrent_backward` (A) runs the recurrence forward, keeping every S_t, then walks back in time
  carrying dS_t = dLoss/dS_t (paper layout, d_v x d_k).
- `chunkwise_backward` (B) runs stage 4's reference B forward, keeping the state at every chunk
  start (S^T, the kernel layout), then walks back over the chunks carrying dS^T, and inside a chunk
  takes every forward step of reference B backwards: the state update, the output, V_new, the WY
  factors, the UT transform, the scores M and A_qk, and last the cumulative gate gamma.
"""

from typing import NamedTuple

import numpy as np

from stages.common.checks import (Float64Array, check_chunking, check_gate_and_beta, check_output_gradient, check_qkv,
                                  check_state)


class Gradients(NamedTuple):
    """What a backward reference returns: the gradients, then the forward's o and final state."""

    dq: Float64Array  # (B, N, H, d_k)
    dk: Float64Array  # (B, N, H, d_k)
    dv: Float64Array  # (B, N, H, d_v)
    dg: Float64Array  # (B, N, H, d_k)
    dbeta: Float64Array  # (B, N, H)
    d_initial_state: Float64Array  # (B, H, d_k, d_v), S^T layout
    o: Float64Array  # (B, N, H, d_v), the forward's output
    final_state: Float64Array  # (B, H, d_k, d_v), S_N^T


def _check(q, k, v, g, beta, do, initial_state, d_final_state):
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="channel")
    check_output_gradient(do, B, N, H, d_v)
    check_state("initial_state", initial_state, B, H, d_k, d_v)
    check_state("d_final_state", d_final_state, B, H, d_k, d_v)
    return B, N, H, d_k, d_v


# --8<-- [start:recurrent_backward]
def recurrent_backward(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                       do: Float64Array, initial_state: Float64Array | None = None,
                       d_final_state: Float64Array | None = None) -> Gradients:
    """Reference A: the reverse-time recurrence of dS, token by token. State S: (d_v, d_k), the paper layout.

    Write the step in three parts, X_t = S_{t-1} D_t (D_t = Diag(a_t), a_t = e^{g_t}),
    P_t = I - beta_t k_t k_t^T (symmetric), S_t = X_t P_t + beta_t v_t k_t^T, and o_t = S_t q_t.
    Start from dS_N = (d_final_state^T, or 0) and, for t = N, ..., 1:

        dS_t   += do_t q_t^T                              o_t = S_t q_t reads S_t
        dq_t    = S_t^T do_t                              ... and q_t
        dv_t    = beta_t dS_t k_t                         the write beta_t v_t k_t^T
        dbeta_t = (v_t - X_t k_t)^T dS_t k_t              the write, and the delete -beta_t X_t k_t k_t^T
        dk_t    = beta_t [dS_t^T (v_t - X_t k_t) - X_t^T dS_t k_t]
                                                          k_t on both sides of the rank-one terms
        dX_t    = dS_t P_t                                through the Householder factor
        dg_t[j] = sum_i X_t[i, j] dX_t[i, j]              dLoss/da_t ⊙ a_t: column j of X_t is a_t[j] S_{t-1}[:, j]
        dS_{t-1} = dX_t D_t                               through the decay

    and d_initial_state = dS_0^T. The forward keeps every S_t (a reference can afford N + 1 states;
    P_t is singular when beta_t ||k_t||^2 = 1, so S_{t-1} cannot be recovered from S_t).
    """
    B, N, H, d_k, d_v = _check(q, k, v, g, beta, do, initial_state, d_final_state)
    dq, dk, dg = (np.zeros((B, N, H, d_k)) for _ in range(3))
    dv, o = np.zeros((B, N, H, d_v)), np.zeros((B, N, H, d_v))
    dbeta = np.zeros((B, N, H))
    d_initial_state, final_state = np.zeros((B, H, d_k, d_v)), np.zeros((B, H, d_k, d_v))
    for b in range(B):
        for h in range(H):
            S = np.zeros((d_v, d_k)) if initial_state is None else initial_state[b, h].T.copy()
            states = [S]  # states[t] = S_t
            for t in range(N):  # forward: stage 4's reference A
                k_t, beta_t = k[b, t, h], beta[b, t, h]
                householder = np.eye(d_k) - beta_t * np.outer(k_t, k_t)
                S = S @ np.diag(np.exp(g[b, t, h])) @ householder + beta_t * np.outer(v[b, t, h], k_t)
                o[b, t, h] = S @ q[b, t, h]
                states.append(S)
            final_state[b, h] = S.T
            dS = np.zeros((d_v, d_k)) if d_final_state is None else d_final_state[b, h].T.copy()
            for t in reversed(range(N)):  # backward: states[t + 1] = S_t in the math's 1-based time
                q_t, k_t, v_t, beta_t = q[b, t, h], k[b, t, h], v[b, t, h], beta[b, t, h]
                a_t = np.exp(g[b, t, h])
                X = states[t] * a_t[None, :]  # S_{t-1} Diag(a_t): column j scaled by a_t[j]
                dS = dS + np.outer(do[b, t, h], q_t)
                dq[b, t, h] = states[t + 1].T @ do[b, t, h]
                error = v_t - X @ k_t  # what the write adds beyond what the delete removes
                dS_k = dS @ k_t
                dv[b, t, h] = beta_t * dS_k
                dbeta[b, t, h] = error @ dS_k
                dk[b, t, h] = beta_t * (dS.T @ error - X.T @ dS_k)
                dX = dS - beta_t * np.outer(dS_k, k_t)  # dS_t P_t, with no d_k x d_k matrix formed
                dg[b, t, h] = np.sum(X * dX, axis=0)
                dS = dX * a_t[None, :]  # dX_t D_t
            d_initial_state[b, h] = dS.T
    return Gradients(dq, dk, dv, dg, dbeta, d_initial_state, o, final_state)
# --8<-- [end:recurrent_backward]


class _Chunk(NamedTuple):
    """Reference B's forward tensors of one chunk (stage 4's names), recomputed by the backward."""

    gamma: Float64Array  # (C, d_k), cumulative log decay from the chunk start
    M: Float64Array  # (C, C), strictly lower
    T: Float64Array  # (C, C), (I + L)^{-1}
    A_hat: Float64Array  # (C, C), diag(beta) T
    W: Float64Array  # (C, d_k)
    U: Float64Array  # (C, d_v)
    A_qk: Float64Array  # (C, C), lower, diagonal included


def _chunk_forward(Q, K, V, G, beta_c):
    """Everything of one chunk that does not read the state, as stage 4's reference B computes it."""
    C = len(Q)
    gamma = np.cumsum(G, axis=0)
    M, A_qk = np.zeros((C, C)), np.zeros((C, C))
    for c in range(C):
        for i in range(c + 1):
            decay = np.exp(gamma[c] - gamma[i])
            M[c, i] = (K[c] * decay) @ K[i] if i < c else 0.0  # strict: i < c
            A_qk[c, i] = (Q[c] * decay) @ K[i]  # inclusive: j <= c
    T = np.linalg.inv(np.eye(C) + M * beta_c[None, :])  # L[c, i] = beta_i M[c, i] ...
    A_hat = beta_c[:, None] * T  # ... pairs with diag(beta) T
    return _Chunk(gamma, M, T, A_hat, A_hat @ (K * np.exp(gamma)), A_hat @ V, A_qk)


# --8<-- [start:chunkwise_backward]
def chunkwise_backward(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                       do: Float64Array, chunk_size: int, initial_state: Float64Array | None = None,
                       d_final_state: Float64Array | None = None) -> Gradients:
    """Reference B: chunk by chunk, in reverse. State S^T: (d_k, d_v), the kernel layout; dS^T likewise.

    The forward of chunk [t] (stage 4's reference B; S^T the state at the chunk start, S'^T after it):
        V_new = U - W S^T,   O = (Q ⊙ e^{gamma}) S^T + A_qk V_new,
        S'^T  = Diag(e^{gamma_C}) S^T + (K ⊙ e^{gamma_C - gamma})^T V_new.
    Backward, given dO and dS'^T, each line the chain rule through one forward line, last line first:

        dV_new  = (K ⊙ e^{gamma_C - gamma}) dS'^T + A_qk^T dO
        dS^T    = Diag(e^{gamma_C}) dS'^T + (Q ⊙ e^{gamma})^T dO - W^T dV_new      (to the chunk before)
        dA_qk   = dO V_new^T (lower, diagonal included),   dW = -dV_new S,   dU = dV_new
        dA_hat  = dW (K ⊙ e^{gamma})^T + dU V^T,   dV = A_hat^T dU,   d(K ⊙ e^{gamma}) = A_hat^T dW
        A_hat = diag(beta) T:    dbeta_c += sum_i dA_hat[c, i] T[c, i],   dT = diag(beta) dA_hat
        T = (I + L)^{-1}:        dL = -T^T dT T^T, kept on the strict lower triangle (where L depends
                                 on the inputs; its diagonal and upper triangle are constants)
        L[c, i] = beta_i M[c, i]: dbeta_i += sum_c dL[c, i] M[c, i],   dM = dL diag(beta)

    beta thus enters twice, by rows after the solve and by columns inside it: the two gradients add.
    M and A_qk are sums over channels d of x_c[d] k_i[d] e^{gamma_c[d] - gamma_i[d]} (x = k or q):
    each entry hands dM[c, i] k_i e^{..} to row c, dM[c, i] k_c e^{..} to row i, and
    +-dM[c, i] k_c k_i e^{..} to dgamma_c and dgamma_i. With the terms of e^{gamma} (Q, K),
    e^{gamma_C - gamma} and e^{gamma_C}, dgamma[r] collects every per-position contribution; since
    gamma[r] = g[0] + ... + g[r], the gate gradient is its reverse cumulative sum:
        dg[s] = dgamma[s] + dgamma[s + 1] + ... + dgamma[C - 1].

    The forward keeps the state at every chunk start; the rest of a chunk is recomputed. The last
    chunk may be shorter than chunk_size.
    """
    B, N, H, d_k, d_v = _check(q, k, v, g, beta, do, initial_state, d_final_state)
    check_chunking(N, d_v, chunk_size)
    dq, dk, dg = (np.zeros((B, N, H, d_k)) for _ in range(3))
    dv, o = np.zeros((B, N, H, d_v)), np.zeros((B, N, H, d_v))
    dbeta = np.zeros((B, N, H))
    d_initial_state, final_state = np.zeros((B, H, d_k, d_v)), np.zeros((B, H, d_k, d_v))
    chunks = [slice(start, min(start + chunk_size, N)) for start in range(0, N, chunk_size)]
    for b in range(B):
        for h in range(H):
            S_T = np.zeros((d_k, d_v)) if initial_state is None else initial_state[b, h].copy()
            chunk_start_states = []
            for rows in chunks:  # forward: stage 4's reference B, keeping S^T at every chunk start
                chunk_start_states.append(S_T)
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h]
                f = _chunk_forward(Q, K, V, g[b, rows, h], beta[b, rows, h])
                V_new = f.U - f.W @ S_T
                o[b, rows, h] = (Q * np.exp(f.gamma)) @ S_T + f.A_qk @ V_new
                S_T = np.exp(f.gamma[-1])[:, None] * S_T + (K * np.exp(f.gamma[-1] - f.gamma)).T @ V_new
            final_state[b, h] = S_T

            dS_T = np.zeros((d_k, d_v)) if d_final_state is None else d_final_state[b, h].copy()
            for rows, S_T in reversed(list(zip(chunks, chunk_start_states))):  # backward, last chunk first
                Q, K, V, beta_c, dO = q[b, rows, h], k[b, rows, h], v[b, rows, h], beta[b, rows, h], do[b, rows, h]
                f = _chunk_forward(Q, K, V, g[b, rows, h], beta_c)
                C, gamma = len(Q), f.gamma
                decay_to_end = np.exp(gamma[-1] - gamma)  # (C, d_k)
                V_new = f.U - f.W @ S_T
                dQ, dK, dgamma = np.zeros((C, d_k)), np.zeros((C, d_k)), np.zeros((C, d_k))
                dbeta_c = np.zeros(C)

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
                dL = np.tril(-f.T.T @ dT @ f.T.T, -1)  # strict: i < c
                dbeta_c += np.sum(dL * f.M, axis=0)  # beta by columns, inside the solve
                dM = dL * beta_c[None, :]

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
                dS_T = dS_T_before
            d_initial_state[b, h] = dS_T
    return Gradients(dq, dk, dv, dg, dbeta, d_initial_state, o, final_state)
# --8<-- [end:chunkwise_backward]
