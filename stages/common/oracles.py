"""Independent oracles: closed forms that share no code with references A, B, C, for the tests and the pages."""

import numpy as np


def causal_linear_attention(q, k, v):
    """o = (Q K^T ⊙ M) V per (batch, head), M the inclusive causal mask: the quadratic form of
    linear attention, computed without any state. q, k: (B, N, H, d_k); v: (B, N, H, d_v)."""
    scores = np.einsum("bthd,bshd->bhts", q, k)
    scores = scores * np.tril(np.ones(scores.shape[-2:]))
    return np.einsum("bhts,bshd->bthd", scores, v)


def delta_rule(q, k, v, beta, g=None):
    """DeltaNet (g None) or Gated DeltaNet, in the prediction-error form of the delta rule:
        S^T <- alpha_t S^T;   S^T <- S^T + beta_t k_t (v_t - S k_t)^T;   o_t = S q_t
    one online gradient step on ||S k_t - v_t||^2 / 2 per token, with no Householder matrix formed.
    q, k: (B, N, H, d_k); v: (B, N, H, d_v); beta, g = log(alpha): (B, N, H). State S^T: (d_k, d_v)."""
    B, N, H, d_k = q.shape
    o = np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            S_T = np.zeros((d_k, v.shape[3]))
            for t in range(N):
                if g is not None:
                    S_T = np.exp(g[b, t, h]) * S_T
                prediction_error = v[b, t, h] - k[b, t, h] @ S_T
                S_T = S_T + beta[b, t, h] * np.outer(k[b, t, h], prediction_error)
                o[b, t, h] = q[b, t, h] @ S_T
    return o


def token_gated_linear_attention(q, k, v, g):
    """o_t = sum_{j <= t} e^{gamma_t - gamma_j} (q_t . k_j) v_j with gamma = cumsum(g) over the whole
    sequence: the quadratic form of linear attention with a scalar gate per token, no state.
    q, k: (B, N, H, d_k); v: (B, N, H, d_v); g = log(alpha): (B, N, H)."""
    gamma = np.cumsum(g, axis=1)  # (B, N, H)
    log_decay = gamma.transpose(0, 2, 1)[:, :, :, None] - gamma.transpose(0, 2, 1)[:, :, None, :]
    causal = np.tril(np.ones(log_decay.shape[-2:], dtype=bool))
    decay = np.exp(np.where(causal, log_decay, -np.inf))  # (B, H, t, j), zero for j > t
    scores = np.einsum("bthd,bshd->bhts", q, k) * decay
    return np.einsum("bhts,bshd->bthd", scores, v)


def kda_delta_rule(q, k, v, g, beta):
    """KDA in the prediction-error form of the delta rule, one decay per key channel:
        S^T <- Diag(a_t) S^T;   S^T <- S^T + beta_t k_t (v_t - S k_t)^T;   o_t = S q_t
    with no Householder matrix formed. q, k: (B, N, H, d_k); v: (B, N, H, d_v); g = log(a):
    (B, N, H, d_k); beta: (B, N, H). State S^T: (d_k, d_v), zero at the start."""
    return kda_delta_rule_from_state(q, k, v, g, beta, None)[0]


def kda_delta_rule_from_state(q, k, v, g, beta, initial_state):
    """kda_delta_rule from S_0^T = initial_state (B, H, d_k, d_v), or zeros for None.
    Returns (o, the final state S^T (B, H, d_k, d_v))."""
    B, N, H, d_k = q.shape
    d_v = v.shape[3]
    o, final_state = np.zeros((B, N, H, d_v)), np.zeros((B, H, d_k, d_v))
    for b in range(B):
        for h in range(H):
            S_T = np.zeros((d_k, d_v)) if initial_state is None else np.array(initial_state[b, h], dtype=np.float64)
            for t in range(N):
                S_T = np.exp(g[b, t, h])[:, None] * S_T  # row d of S^T decays at its own rate
                prediction_error = v[b, t, h] - k[b, t, h] @ S_T
                S_T = S_T + beta[b, t, h] * np.outer(k[b, t, h], prediction_error)
                o[b, t, h] = q[b, t, h] @ S_T
            final_state[b, h] = S_T
    return o, final_state


def channel_gated_linear_attention(q, k, v, g):
    """o_t = sum_{j <= t} ((q_t ⊙ e^{gamma_t - gamma_j}) . k_j) v_j with gamma = cumsum(g) over the
    whole sequence: linear attention with one gate per key channel, no state and no delete term.
    q, k: (B, N, H, d_k); v: (B, N, H, d_v); g = log(a): (B, N, H, d_k)."""
    gamma = np.cumsum(g, axis=1)
    log_decay = gamma[:, :, None] - gamma[:, None, :]  # (B, t, j, H, d_k)
    causal = np.tril(np.ones(log_decay.shape[1:3], dtype=bool))[None, :, :, None, None]
    decay = np.exp(np.where(causal, log_decay, -np.inf))  # zero for j > t
    scores = np.einsum("bthd,btjhd,bjhd->bhtj", q, decay, k)
    return np.einsum("bhtj,bjhd->bthd", scores, v)


def scalar_decay_attention(q, k, v, g):
    """o_t = sum_{j <= t} alpha_h^(t - j) (q_t . k_j) v_j per (batch, head h), alpha_h = e^{g_h}: the
    quadratic form of linear attention with a constant decay per head, with no state and no chunks.
    q, k: (B, N, H, d_k); v: (B, N, H, d_v); g = log(alpha): (H,)."""
    N = q.shape[1]
    offsets = np.arange(N)[:, None] - np.arange(N)[None, :]  # t - j
    causal = offsets >= 0
    decay = np.where(causal, np.exp(g[:, None, None] * np.where(causal, offsets, 0)), 0.0)  # (H, t, j)
    scores = np.einsum("bthd,bshd->bhts", q, k) * decay
    return np.einsum("bhts,bshd->bthd", scores, v)
