"""Exercise s03.chunk_system (fix): the triangular system I + L of one chunk's UT transform.

    L[c, i] = beta_i e^{gamma_c - gamma_i} k_c · k_i  for i < c,   gamma = cumsum(g)

The keys are L2-normalized first, as the model does before the kernel: that keeps I + L well
conditioned (see the Numerics section of the page).

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 3 page, "Numerics".  Check: course check s03
"""

import numpy as np

from stages.common.inputs import l2_normalize


def chunk_system(k, g, beta, key_norm=1.0):
    """I + L of one chunk, (C, C): L[c, i] = beta_i e^{gamma_c - gamma_i} k_c · k_i for i < c.

    k: (C, d_k) keys of any norm; g = log(alpha), beta: (C,). Every key is L2-normalized first, as
    the model does before the kernel, then scaled to key_norm (1: the kernel's normal case).
    """
    # EXERCISE BEGIN
    keys = key_norm * l2_normalize(k)
    gamma = np.cumsum(g)
    # above the diagonal the exponent is positive, and tril drops it
    M = np.tril((keys @ keys.T) * np.exp(gamma[:, None] - gamma[None, :]), -1)
    return np.eye(len(g)) + M * beta[None, :]
    # EXERCISE END
