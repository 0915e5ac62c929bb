"""Exercise s02.recurrent (fill): reference A, linear attention with scalar decay, token by token.

    S_t = alpha S_{t-1} + v_t k_t^T        o_t = S_t q_t        (paper layout: S is d_v x d_k)

with alpha = e^{g[h]}, one constant per head. Fill the region.
Read: stage 2 page, "Reference A: token by token".  Check: course check s02
"""

import numpy as np

from stages.common.checks import Float64Array, check_gate, check_qkv


def recurrent(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array) -> Float64Array:
    """Reference A: the recurrence token by token. State S: (d_v, d_k), the paper layout."""
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate(g, B, N, H, d_k, gate="head")
    o = np.zeros((B, N, H, d_v))
    for b in range(B):
        for h in range(H):
            # EXERCISE BEGIN
            raise NotImplementedError("s02.recurrent: fill this region; see the docstring and the page")
            # EXERCISE END
    return o
