"""Exercise s02.chunkwise (fix): reference B, scalar decay chunk by chunk.

For chunk [t] with rows r = 1..C, gamma_r = r log(alpha), and the state S^T (d_k x d_v, the kernel
layout) left by the chunks before it:
    O[r] = alpha^r Q[r] S^T + sum_{j <= r} alpha^(r - j) (Q[r] . K[j]) V[j]
    S^T <- alpha^C S^T + sum_j alpha^(C - j) K[j]^T V[j]

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 2 page, "Reference B: chunk by chunk".  Check: course check s02
"""

import numpy as np

from stages.common.checks import Float64Array, check_chunking, check_gate, check_qkv


def chunkwise(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, chunk_size: int) -> Float64Array:
    """Reference B: chunk by chunk with plain loops for the sums. State S^T: (d_k, d_v).

    The last chunk may be shorter than chunk_size: its decays run to its own last row.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate(g, B, N, H, d_k, gate="head")
    check_chunking(N, d_v, chunk_size)
    o = np.zeros((B, N, H, d_v))
    for b in range(B):
        for h in range(H):
            # EXERCISE BEGIN
            S_T = np.zeros((d_k, d_v))
            for start in range(0, N, chunk_size):
                rows = slice(start, min(start + chunk_size, N))
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h]
                gamma = g[h] * np.arange(1, len(Q) + 1)  # log alpha^r, r counted from the chunk start
                for r in range(len(Q)):
                    inter_chunk = np.exp(gamma[r]) * (Q[r] @ S_T)  # the state, r more steps faded
                    intra_chunk = sum(np.exp(gamma[r] - gamma[j]) * (Q[r] @ K[j]) * V[j]  # Gamma[r, j]
                                      for j in range(r + 1))  # j <= r
                    o[b, start + r, h] = inter_chunk + intra_chunk
                decay_to_chunk_end = np.exp(gamma[-1] - gamma)  # alpha^(C - r), every entry <= 1
                S_T = np.exp(gamma[-1]) * S_T + (K * decay_to_chunk_end[:, None]).T @ V
            # EXERCISE END
    return o
