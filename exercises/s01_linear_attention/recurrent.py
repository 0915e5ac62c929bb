"""Exercise s01.recurrent (fix): reference A, linear attention token by token.

    S_t = S_{t-1} + v_t k_t^T        o_t = S_t q_t        (paper layout: S is d_v x d_k)

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 1 page, "Reference A: token by token".  Check: course check s01
"""

import numpy as np

from stages.common.checks import Float64Array, check_qkv


def recurrent(q: Float64Array, k: Float64Array, v: Float64Array) -> Float64Array:
    """Reference A: the recurrence token by token. State S: (d_v, d_k), the paper layout."""
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    o = np.zeros((B, N, H, d_v))
    for b in range(B):
        for h in range(H):
            S = np.zeros((d_v, d_k))
            for t in range(N):
                # EXERCISE BEGIN
                o[b, t, h] = S @ q[b, t, h]
                S = S + np.outer(v[b, t, h], k[b, t, h])
                # EXERCISE END
    return o
