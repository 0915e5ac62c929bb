"""Exercise s02.chunkwise (fix): reference B, scalar decay chunk by chunk.

For chunk [t] with rows r = 1..C, gamma_r = r log(alpha), and the state S^T (d_k x d_v, the kernel
layout) left by the chunks before it:
    A_qk[r, j] = alpha^(r - j) (Q[r] . K[j])  for j <= r
    O[r] = alpha^r Q[r] S^T + sum_{j <= r} A_qk[r, j] V[j]
    S^T <- alpha^C S^T + sum_j alpha^(C - j) K[j]^T V[j]
Besides o it returns what only the chunked form has: the state as each chunk starts and each
chunk's A_qk, a row per token.

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 2 page, "Reference B: chunk by chunk".  Check: course check s02
"""

import numpy as np

from stages.common.checks import Float64Array, check_chunking, check_gate, check_qkv, padded_length
from stages.s02_scalar_decay.reference import ChunkwiseOutput


def chunkwise(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, chunk_size: int) -> ChunkwiseOutput:
    """Reference B: chunk by chunk with plain loops for the scores. State S^T: (d_k, d_v).

    Returns o with the state at every chunk start and every chunk's scores A_qk (ChunkwiseOutput).
    The last chunk may be shorter than chunk_size: its decays run to its own last row.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate(g, B, N, H, d_k, gate="head")
    check_chunking(N, d_v, chunk_size)
    o = np.zeros((B, N, H, d_v))
    chunk_start_states = np.zeros((B, padded_length(N, chunk_size) // chunk_size, H, d_k, d_v))
    A_qk_rows = np.zeros((B, N, H, chunk_size))  # each token's row of its chunk's A_qk
    for b in range(B):
        for h in range(H):
            # EXERCISE BEGIN
            S_T = np.zeros((d_k, d_v))
            for start in range(0, N, chunk_size):
                rows = slice(start, min(start + chunk_size, N))
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h]
                C = len(Q)
                gamma = g[h] * np.arange(start + 1, start + C + 1)  # log alpha^t, t the token's position
                A_qk = np.zeros((C, C))
                for r in range(C):
                    for j in range(r + 1):  # j <= r: the decay is formed only where it is defined
                        A_qk[r, j] = np.exp(gamma[r] - gamma[j]) * (Q[r] @ K[j])  # Gamma[r, j] (q_r . k_j)
                inter_chunk = np.exp(gamma)[:, None] * (Q @ S_T)  # the state, r more steps faded
                intra_chunk = A_qk @ V  # the chunk's own rows, masked and decayed
                o[b, rows, h] = inter_chunk + intra_chunk
                chunk_start_states[b, start // chunk_size, h] = S_T
                A_qk_rows[b, rows, h, :C] = A_qk
                decay_to_chunk_end = np.exp(gamma[-1] - gamma)  # alpha^(C - r), every entry <= 1
                S_T = np.exp(gamma[-1]) * S_T + (K * decay_to_chunk_end[:, None]).T @ V
            # EXERCISE END
    return ChunkwiseOutput(o, chunk_start_states, A_qk_rows)
