"""Exercise s04.recurrent (fix): reference A, Kimi Delta Attention token by token.

    S_t = S_{t-1} Diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T        o_t = S_t q_t
                                                             (paper layout: S is d_v x d_k)

g = log(a) has shape (B, N, H, d_k): one gate per token, head and key channel; beta is (B, N, H).

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 4 page, "Reference A: token by token".  Check: course check s04
"""

import numpy as np

from stages.common.checks import Float64Array, check_gate_and_beta, check_qkv


def recurrent(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array) -> Float64Array:
    """Reference A: the recurrence token by token. State S: (d_v, d_k), the paper layout."""
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="channel")
    o = np.zeros((B, N, H, d_v))
    for b in range(B):
        for h in range(H):
            S = np.zeros((d_v, d_k))
            for t in range(N):
                # EXERCISE BEGIN
                k_t, beta_t = k[b, t, h], beta[b, t, h]
                decay = np.diag(np.exp(g[b, t, h]))  # Diag(a_t): one rate per key channel
                householder = np.eye(d_k) - beta_t * np.outer(k_t, k_t)
                S = S @ decay @ householder + beta_t * np.outer(v[b, t, h], k_t)
                o[b, t, h] = S @ q[b, t, h]
                # EXERCISE END
    return o
