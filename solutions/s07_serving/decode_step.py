"""Exercise s07.decode_step (fix): one decode step over a pool of states.

A server keeps every live sequence's state in a pool (P, H, d_k, d_v), S^T in the kernel layout. A
decode batch of B sequences names its states by `slots` (B,): sequence b reads its state from the
pool, advances it by one token and writes it back, and no other state of the pool may change.

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 7 page, "The state pool".  Check: course check s07
"""

import numpy as np

from stages.common.checks import Float64Array
from stages.s07_serving.reference import check_decode_inputs


def decode_step(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                state_pool: Float64Array, slots: np.ndarray) -> Float64Array:
    """One token per sequence: advance the state of sequence b (S^T, the kernel layout) by the token
    and return o: (B, H, d_v). q, k, g: (B, H, d_k); v: (B, H, d_v); beta: (B, H); state_pool
    (P, H, d_k, d_v), updated in place; slots (B,), distinct, in [0, P)."""
    B, H, d_k, d_v, _ = check_decode_inputs(q, k, v, g, beta, state_pool, slots)
    o = np.zeros((B, H, d_v))
    for b in range(B):
        for h in range(H):
            k_t, beta_t = k[b, h], beta[b, h]
            # EXERCISE BEGIN
            slot = slots[b]
            S_T = state_pool[slot, h]  # (d_k, d_v)
            decay = np.diag(np.exp(g[b, h]))  # Diag(a_t): one rate per key channel, a row of S^T
            householder = np.eye(d_k) - beta_t * np.outer(k_t, k_t)
            S_T = householder @ decay @ S_T + beta_t * np.outer(k_t, v[b, h])
            o[b, h] = S_T.T @ q[b, h]
            state_pool[slot, h] = S_T
            # EXERCISE END
    return o
