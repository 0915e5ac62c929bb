"""Exercise s01.chunkwise (fill): reference B, linear attention chunk by chunk.

For chunk [t] with rows Q, K, V and the state S^T (d_k x d_v, the kernel layout) left by the
chunks before it:
    A_qk = Q K^T ⊙ M,   M[r, j] = 1 for j <= r
    O = Q S^T + A_qk V        then   S^T <- S^T + K^T V

Fill the region: plain loops for A_qk. Besides o, record what only the chunked form has: the state
as each chunk starts (chunk_start_states) and each chunk's A_qk, a row per token (A_qk_rows). The
last chunk may be shorter.
Read: stage 1 page, "Reference B: chunk by chunk".  Check: course check s01
"""

import numpy as np

from stages.common.checks import Float64Array, check_chunking, check_qkv, padded_length
from stages.s01_linear_attention.reference import ChunkwiseOutput


def chunkwise(q: Float64Array, k: Float64Array, v: Float64Array, chunk_size: int) -> ChunkwiseOutput:
    """Reference B: chunk by chunk with plain loops for the scores. State S^T: (d_k, d_v).

    Returns o with the state at every chunk start and every chunk's scores A_qk (ChunkwiseOutput).
    The last chunk may be shorter than chunk_size: nothing in the math needs equal chunks.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_chunking(N, d_v, chunk_size)
    o = np.zeros((B, N, H, d_v))
    chunk_start_states = np.zeros((B, padded_length(N, chunk_size) // chunk_size, H, d_k, d_v))
    A_qk_rows = np.zeros((B, N, H, chunk_size))  # each token's row of its chunk's A_qk
    # EXERCISE BEGIN
    for b in range(B):
        for h in range(H):
            S_T = np.zeros((d_k, d_v))
            for start in range(0, N, chunk_size):
                rows = slice(start, min(start + chunk_size, N))
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h]
                C = len(Q)
                A_qk = np.zeros((C, C))
                for r in range(C):
                    for j in range(r + 1):  # j <= r: a token sees itself
                        A_qk[r, j] = Q[r] @ K[j]
                inter_chunk = Q @ S_T  # what the earlier chunks left in the state
                intra_chunk = A_qk @ V  # the chunk's own rows, masked
                o[b, rows, h] = inter_chunk + intra_chunk
                chunk_start_states[b, start // chunk_size, h] = S_T
                A_qk_rows[b, rows, h, :C] = A_qk
                S_T = S_T + K.T @ V  # only after every row of the chunk has read the old state
    # EXERCISE END
    return ChunkwiseOutput(o, chunk_start_states, A_qk_rows)
