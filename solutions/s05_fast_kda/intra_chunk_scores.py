"""Exercise s05.intra_chunk_scores (fix): A_kk and A_qk of one chunk from anchored GEMM operands.

e^{gamma_c - gamma_i} = e^{gamma_c - gamma_a} e^{gamma_a - gamma_i}: the prepare kernel puts one factor
in each GEMM operand and casts the operands to fp16 or bf16. The anchor a decides how large a factor
can get, and an fp16 operand holds at most 65504.

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 5 page, "Anchored exponents".  Check: course check s05
"""

import numpy as np
from numpy.typing import DTypeLike

from stages.common.checks import Float64Array, check_array, check_divisor, check_shaped


def intra_chunk_scores(Q: Float64Array, K: Float64Array, gamma: Float64Array, sub_block: int,
                       operand_dtype: DTypeLike = np.float64) -> tuple[Float64Array, Float64Array]:
    """A_kk (C x C, strictly lower) and A_qk (C x C, lower with the diagonal) of one chunk, as GEMMs.

    Q, K: (C, d_k) rows of the chunk; gamma: (C, d_k) cumulative log gates from the chunk start.
    e^{gamma_c - gamma_i} = e^{gamma_c - gamma_a} e^{gamma_a - gamma_i} for any anchor row a: each
    factor goes into one GEMM operand, and the anchor is chosen so that neither factor is large.
    """
    check_array("K", K, 2, "(C, d_k)")
    check_shaped("Q", Q, K.shape, f"K's (C, d_k) = {K.shape}")
    check_shaped("gamma", gamma, K.shape, f"K's (C, d_k) = {K.shape}")
    C = len(K)
    check_divisor("sub_block", sub_block, "C", C)

    def operand(x):  # the cast to the GEMM's input type
        return x.astype(operand_dtype).astype(np.float64)

    # EXERCISE BEGIN
    # diagonal sub-blocks: one C x C GEMM, each row and column anchored at the middle row of its
    # sub-block, so that no factor exceeds a_min^{-sub_block/2}; only the block diagonal is kept
    sub_index = np.arange(C) // sub_block
    middle = gamma[sub_index * sub_block + sub_block // 2]  # (C, d_k): each row's anchor
    Q_row, K_row = operand(Q * np.exp(gamma - middle)), operand(K * np.exp(gamma - middle))
    K_col = operand(K * np.exp(middle - gamma))
    same_block = sub_index[:, None] == sub_index[None, :]
    A_kk = np.where(same_block, K_row @ K_col.T, 0.0)  # GEMM
    A_qk = np.where(same_block, Q_row @ K_col.T, 0.0)  # GEMM
    # off-diagonal: one column slab of sub_block keys at a time against the rows below it, one
    # anchor per slab
    for s0 in range(sub_block, C, sub_block):
        slab, below = slice(s0 - sub_block, s0), slice(s0, C)
        anchor = gamma[s0]
        K_col = operand(K[slab] * np.exp(anchor - gamma[slab]))
        Q_row, K_row = np.zeros_like(Q), np.zeros_like(K)  # rows above the anchor stay zero
        Q_row[below] = operand(Q[below] * np.exp(gamma[below] - anchor))
        K_row[below] = operand(K[below] * np.exp(gamma[below] - anchor))
        A_kk[:, slab] += K_row @ K_col.T  # GEMM, C x sub_block
        A_qk[:, slab] += Q_row @ K_col.T  # GEMM, C x sub_block
    # EXERCISE END
    return np.tril(A_kk, -1), np.tril(A_qk)
