"""Exercise s03.chunk_scores (fix): the two masked score matrices of one chunk.

    L[c, i]    = beta_i e^{gamma_c - gamma_i} (k_c · k_i)     the system I + L of the UT transform
    A_qk[c, j] = e^{gamma_c - gamma_j} (q_c · k_j)            the intra-chunk term O = ... + A_qk V_new

with gamma = cumsum(g) from the chunk start. Each is one GEMM on the chunk's rows, times the decay
table, then a causal mask on the fragment, as in reference C and the kernel. Causal says "nothing
above the diagonal"; the diagonal itself is each matrix's own question: does a token's write depend
on itself, and does a token's output see its own write?

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 3 page, "One chunk as a triangular system".  Check: course check s03
"""

import numpy as np


def chunk_scores(Q, K, g, beta):
    """(L, A_qk) of one chunk, both (C, C), zero above the diagonal.

    Q, K: (C, d_k) rows of the chunk; g = log(alpha), beta: (C,).
    """
    # EXERCISE BEGIN
    gamma = np.cumsum(g)  # the log decay from the chunk start
    # the decay table, zero above the diagonal, where the exponent is positive
    Gamma = np.tril(np.exp(gamma[:, None] - gamma[None, :]))
    L = np.tril((K @ K.T) * Gamma, -1) * beta[None, :]  # GEMM, then the mask of L
    A_qk = np.tril((Q @ K.T) * Gamma)  # GEMM, then the mask of A_qk
    # EXERCISE END
    return L, A_qk
