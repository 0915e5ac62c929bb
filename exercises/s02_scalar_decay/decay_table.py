"""Exercise s02.decay_table (fix): the decay table Gamma of one head, in a given dtype.

    Gamma[i, j] = alpha^(i - j) for j <= i, 0 above the diagonal        (C x C)

The course builds it in float64 for the references; the kernel would like it in fp16. Whatever the
dtype, every entry must come out finite and right.

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 2 page, "Numerics".  Check: course check s02
"""

import numpy as np
from numpy.typing import DTypeLike

from stages.common.checks import check_log_gates, check_positive_integer


def decay_table(g_head: float, chunk_size: int, dtype: DTypeLike = np.float64) -> np.ndarray:
    """Gamma (C x C) of one head: Gamma[i, j] = alpha^(i - j) for j <= i, 0 above the diagonal.

    g_head = log(alpha), a scalar. Gamma depends on i - j only, so one table serves every chunk.
    """
    check_log_gates("g_head", g_head)
    check_positive_integer("chunk_size", chunk_size)
    C = chunk_size
    gamma = g_head * np.arange(1, C + 1)  # log alpha^r, r counted from the chunk start
    lower = np.tril(np.ones((C, C), dtype=bool))  # j <= i
    # EXERCISE BEGIN
    decay_from_start = np.where(lower, np.exp(gamma)[:, None], 0).astype(dtype)  # e^{gamma_i}, 0 above the diagonal
    return decay_from_start * np.exp(-gamma).astype(dtype)[None, :]  # times 1 / e^{gamma_j}
    # EXERCISE END
