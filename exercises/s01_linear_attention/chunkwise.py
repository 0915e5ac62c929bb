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
    raise NotImplementedError("s01.chunkwise: fill this region; see the docstring and the page")
    # EXERCISE END
    return ChunkwiseOutput(o, chunk_start_states, A_qk_rows)
