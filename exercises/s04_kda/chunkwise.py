"""Exercise s04.chunkwise (fill): reference B, KDA chunk by chunk.

For chunk [t] with rows Q, K, V, write strengths beta, gates G and gamma[r] = G[0] + ... + G[r]
(a vector of d_k log decays), and the state S^T (d_k x d_v, the kernel layout) left by the chunks
before it:
    M[c, i]    = (k_c ⊙ e^{gamma_c - gamma_i}) · k_i  for i < c      (plain loops)
    T          = (I + L)^{-1},  L[c, i] = beta_i M[c, i]
    W, U       = diag(beta) T (K ⊙ e^{gamma}),  diag(beta) T V
    V_new      = U - W S^T
    A_qk[c, j] = (q_c ⊙ e^{gamma_c - gamma_j}) · k_j  for j <= c     (plain loops)
    O          = (Q ⊙ e^{gamma}) S^T + A_qk V_new
    S^T       <- Diag(e^{gamma_C}) S^T + (K ⊙ e^{gamma_C - gamma})^T V_new

Fill the region. The last chunk may be shorter.
Read: stage 4 page, "Reference B: chunk by chunk".  Check: course check s04
"""

import numpy as np

from stages.common.checks import Float64Array, check_chunking, check_gate_and_beta, check_qkv


def chunkwise(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
              chunk_size: int) -> Float64Array:
    """Reference B: chunk by chunk, plain loops for M and A_qk, the UT transform by inversion.
    State S^T: (d_k, d_v).

    The last chunk may be shorter than chunk_size: nothing in the math needs equal chunks.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="channel")
    check_chunking(N, d_v, chunk_size)
    o = np.zeros((B, N, H, d_v))
    # EXERCISE BEGIN
    raise NotImplementedError("s04.chunkwise: fill this region; see the docstring and the page")
    # EXERCISE END
    return o
