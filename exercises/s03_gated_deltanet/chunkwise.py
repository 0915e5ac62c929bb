"""Exercise s03.chunkwise (fill): reference B, Gated DeltaNet chunk by chunk with the UT transform.

For chunk [t] with rows Q, K, V, write strengths beta, gamma[r] = g[0] + ... + g[r] (the log decay
from the chunk start) and the state S^T (d_k x d_v, the kernel layout) left by the chunks before it:
    M[c, i]    = e^{gamma_c - gamma_i} (k_c · k_i)  for i < c
    T          = (I + L)^{-1},  L[c, i] = beta_i M[c, i]
    W, U       = diag(beta) T (K ⊙ e^{gamma}),  diag(beta) T V
    V_new      = U - W S^T
    A_qk[c, j] = e^{gamma_c - gamma_j} (q_c · k_j)  for j <= c
    O          = (Q ⊙ e^{gamma}) S^T + A_qk V_new
    S^T       <- e^{gamma_C} S^T + (K ⊙ e^{gamma_C - gamma})^T V_new

Fill the region: plain loops where the math has sums; np.linalg.inv is fine for T. Besides o,
record what only the chunked form has: the state as each chunk starts (chunk_start_states) and each
chunk's A_qk, W and U, a row per token. The last chunk may be shorter.
Read: stage 3 page, "Reference B: chunk by chunk".  Check: course check s03
"""

import numpy as np

from stages.common.checks import (Float64Array, check_chunking, check_gate_and_beta, check_qkv,
                                  padded_length)
from stages.s03_gated_deltanet.reference import ChunkwiseOutput


def chunkwise(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
              chunk_size: int) -> ChunkwiseOutput:
    """Reference B: chunk by chunk, plain loops for M and A_qk, the UT transform by inversion.
    State S^T: (d_k, d_v).

    Returns o with the state at every chunk start, every chunk's A_qk, W and U (ChunkwiseOutput).
    The last chunk may be shorter than chunk_size: nothing in the math needs equal chunks.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="token")
    check_chunking(N, d_v, chunk_size)
    o = np.zeros((B, N, H, d_v))
    chunk_start_states = np.zeros((B, padded_length(N, chunk_size) // chunk_size, H, d_k, d_v))
    A_qk_rows = np.zeros((B, N, H, chunk_size))  # each token's row of its chunk's A_qk
    W_rows, U_rows = np.zeros((B, N, H, d_k)), np.zeros((B, N, H, d_v))
    # EXERCISE BEGIN
    raise NotImplementedError("s03.chunkwise: fill this region; see the docstring and the page")
    # EXERCISE END
    return ChunkwiseOutput(o, chunk_start_states, A_qk_rows, W_rows, U_rows)
