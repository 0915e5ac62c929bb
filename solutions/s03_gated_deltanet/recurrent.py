"""Exercise s03.recurrent (fix): reference A, Gated DeltaNet token by token.

    S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T        o_t = S_t q_t
                                                             (paper layout: S is d_v x d_k)

g = log(alpha) and beta have shape (B, N, H): one gate and one write strength per token and head.

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 3 page, "Reference A: token by token".  Check: course check s03
"""

import numpy as np

from stages.common.checks import Float64Array, check_gate_and_beta, check_qkv


def recurrent(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array) -> Float64Array:
    """Reference A: the recurrence token by token. State S: (d_v, d_k), the paper layout."""
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="token")
    o = np.zeros((B, N, H, d_v))
    for b in range(B):
        for h in range(H):
            S = np.zeros((d_v, d_k))
            for t in range(N):
                # EXERCISE BEGIN
                k_t, beta_t = k[b, t, h], beta[b, t, h]
                alpha_t = np.exp(g[b, t, h])  # one decay for the whole state
                householder = np.eye(d_k) - beta_t * np.outer(k_t, k_t)
                S = alpha_t * S @ householder + beta_t * np.outer(v[b, t, h], k_t)
                o[b, t, h] = S @ q[b, t, h]
                # EXERCISE END
    return o
