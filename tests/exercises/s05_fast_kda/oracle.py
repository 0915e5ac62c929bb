"""Independent oracles for stage 5's tests: no code shared with the references of stages 4 and 5."""

import numpy as np


def kda_delta_rule(q, k, v, g, beta, initial_state=None):
    """KDA in the prediction-error form of the delta rule, per token:
        S^T <- Diag(a_t) S^T;   S^T <- S^T + beta_t k_t (v_t - S k_t)^T;   o_t = S q_t
    (one gradient step on ||S k_t - v_t||^2 / 2 after a per-channel decay, no Householder matrix).
    q, k: (B, N, H, d_k); v: (B, N, H, d_v); g = log(a): (B, N, H, d_k); beta: (B, N, H);
    initial_state: S_0^T (B, H, d_k, d_v) or None. Returns (o, final S^T: (B, H, d_k, d_v))."""
    B, N, H, d_k = q.shape
    d_v = v.shape[3]
    o = np.zeros((B, N, H, d_v))
    final_state = np.zeros((B, H, d_k, d_v))
    for b in range(B):
        for h in range(H):
            S_T = np.zeros((d_k, d_v)) if initial_state is None else initial_state[b, h].astype(np.float64)
            for t in range(N):
                S_T = np.exp(g[b, t, h])[:, None] * S_T
                prediction_error = v[b, t, h] - k[b, t, h] @ S_T
                S_T = S_T + beta[b, t, h] * np.outer(k[b, t, h], prediction_error)
                o[b, t, h] = q[b, t, h] @ S_T
            final_state[b, h] = S_T
    return o, final_state


def decayed_scores(Q, K, gamma):
    """A_kk[c, i] = sum_d k_c[d] k_i[d] e^{gamma_c[d] - gamma_i[d]} for i < c, and A_qk the same with q_c
    for i <= c, straight from the definition (one exponent per (c, i, d), never above 0 where kept).
    Q, K, gamma: (C, d_k). Returns (A_kk, A_qk), both (C, C)."""
    C = len(K)
    log_decay = gamma[:, None, :] - gamma[None, :, :]  # (c, i, d)
    causal = np.tril(np.ones((C, C), dtype=bool))[:, :, None]
    decay = np.exp(np.where(causal, log_decay, -np.inf))  # zero above the diagonal, no overflow
    A_kk = np.einsum("cd,id,cid->ci", K, K, decay) * np.tri(C, k=-1)
    A_qk = np.einsum("cd,id,cid->ci", Q, K, decay)
    return A_kk, A_qk


def chunk_recurrence(w, u, q_decayed, k_to_chunk_end, a_qk, chunk_decay, initial_state=None):
    """The recurrence over chunks from the prepare kernel's outputs, whole value rows at once:
        V_new = U - W S^T;   O = Q_decayed S^T + A_qk V_new;   S^T <- Diag(chunk_decay) S^T + K_to_chunk_end^T V_new
    w, q_decayed, k_to_chunk_end: (B, N, H, d_k); u: (B, N, H, d_v); a_qk: (B, N, H, C);
    chunk_decay: (B, N / C, H, d_k); initial_state: S_0^T (B, H, d_k, d_v) or None.
    Returns (o: (B, N, H, d_v), final S^T: (B, H, d_k, d_v)), in float64."""
    B, N, H, d_k = w.shape
    C, d_v = a_qk.shape[3], u.shape[3]
    o = np.zeros((B, N, H, d_v))
    final_state = np.zeros((B, H, d_k, d_v))
    for b in range(B):
        for h in range(H):
            S_T = np.zeros((d_k, d_v)) if initial_state is None else initial_state[b, h].astype(np.float64)
            for i_c in range(N // C):
                rows = slice(i_c * C, (i_c + 1) * C)
                V_new = u[b, rows, h] - w[b, rows, h] @ S_T
                o[b, rows, h] = q_decayed[b, rows, h] @ S_T + a_qk[b, rows, h] @ V_new
                S_T = chunk_decay[b, i_c, h][:, None] * S_T + k_to_chunk_end[b, rows, h].T @ V_new
            final_state[b, h] = S_T
    return o, final_state
