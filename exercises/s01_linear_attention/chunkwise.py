"""Exercise s01.chunkwise (fill): reference B, linear attention chunk by chunk.

For chunk [t] with rows Q, K, V and the state S^T (d_k x d_v, the kernel layout) left by the
chunks before it:
    O = Q S^T + (Q K^T ⊙ M) V,   M[r, j] = 1 for j <= r        then   S^T <- S^T + K^T V

Fill the region: plain loops where the math has sums. The last chunk may be shorter.
Read: stage 1 page, "Reference B: chunk by chunk".  Check: course check s01
"""

import numpy as np

from stages.common.checks import Float64Array, check_chunking, check_qkv


def chunkwise(q: Float64Array, k: Float64Array, v: Float64Array, chunk_size: int) -> Float64Array:
    """Reference B: chunk by chunk with plain loops for the sums. State S^T: (d_k, d_v).

    The last chunk may be shorter than chunk_size: nothing in the math needs equal chunks.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_chunking(N, d_v, chunk_size)
    o = np.zeros((B, N, H, d_v))
    # EXERCISE BEGIN
    raise NotImplementedError("s01.chunkwise: fill this region; see the docstring and the page")
    # EXERCISE END
    return o
