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
    for b in range(B):
        for h in range(H):
            S_T = np.zeros((d_k, d_v))
            for start in range(0, N, chunk_size):
                rows = slice(start, min(start + chunk_size, N))
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h]
                for r in range(len(Q)):
                    inter_chunk = Q[r] @ S_T  # what the earlier chunks left in the state
                    intra_chunk = sum((Q[r] @ K[j]) * V[j] for j in range(r + 1))  # j <= r
                    o[b, start + r, h] = inter_chunk + intra_chunk
                S_T = S_T + K.T @ V  # only after every row of the chunk has read the old state
    # EXERCISE END
    return o
