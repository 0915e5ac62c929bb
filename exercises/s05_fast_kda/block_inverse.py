"""Exercise s05.block_inverse (fill): (I + L)^{-1} of a strictly lower triangular L, by sub-blocks.

Invert the diagonal sub-blocks by forward substitution (row r of every diagonal block at once), then
merge block row P from the finished rows above it:
    T[P, :P] = -T[P, P] (L[P, :P] T[:P, :P])          from block row P of (I + L) T = I.

Fill the region; np.linalg.inv is not the answer (the kernel has no such call).
Read: stage 5 page, "The inverse by blocks".  Check: course check s05
"""

import numpy as np

from stages.common.checks import Float64Array, check_divisor, check_shaped


def block_inverse(L: Float64Array, block: int) -> Float64Array:
    """(I + L)^{-1} for L strictly lower triangular (C x C), by sub-blocks of `block` rows.

    The diagonal blocks are inverted by forward substitution, all at once (one lane per (block,
    column)); then each block row P takes the rows above it with two products:
        T[P, :P] = -T[P, P] (L[P, :P] T[:P, :P])       from (I + L) T = I, block row P.
    """
    C = len(L)
    check_shaped("L", L, (C, C), f"(C, C) = {(C, C)}")
    check_divisor("block", block, "C", C)
    T = np.zeros((C, C))
    # EXERCISE BEGIN
    raise NotImplementedError("s05.block_inverse: fill this region; see the docstring and the page")
    # EXERCISE END
    return T
