"""Exercise s01.kernel_mirror (fix): reference C, the kernel's control flow in NumPy.

The loops are the kernel's: grid.x over blocks of value columns, grid.y over (batch, head), then
the pipelined loop over chunks; the state S^T (d_k x block_dv) lives on chip.

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 1 page, "Reference C: the kernel's control flow".  Check: course check s01
"""

import numpy as np

from stages.common.checks import Float64Array, check_chunking, check_qkv, padded_length


def kernel_mirror(q: Float64Array, k: Float64Array, v: Float64Array, chunk_size: int, block_dv: int) -> Float64Array:
    """Reference C: the kernel's control flow. State S^T: (d_k, block_dv) per program.

    Like the kernel's wrapper, it zero-pads N up to a multiple of chunk_size. The padding is exact:
    padded keys and values are zero, so they add K^T V = 0 to the state, and padded queries only
    produce rows that are cut off at the end.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_chunking(N, d_v, chunk_size, block_dv)
    C = chunk_size
    q, k, v = (_pad_tokens(x, padded_length(N, C)) for x in (q, k, v))
    o = np.zeros((B, q.shape[1], H, d_v))
    causal_mask = np.tril(np.ones((C, C)))  # inclusive: M[r, j] = 1 for j <= r
    for i_v in range(d_v // block_dv):  # grid.x: one program per block of value columns
        cols = slice(i_v * block_dv, (i_v + 1) * block_dv)
        for i_bh in range(B * H):  # grid.y: one program per (batch, head)
            b, h = divmod(i_bh, H)
            # EXERCISE BEGIN
            S_T = np.zeros((d_k, block_dv))  # the state, in registers
            for i_c in range(q.shape[1] // C):  # the pipelined chunk loop
                rows = slice(i_c * C, (i_c + 1) * C)
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h, cols]
                scores = (Q @ K.T) * causal_mask  # GEMM, then the mask on the fragment
                acc_o = Q @ S_T  # GEMM: the inter-chunk term
                acc_o += scores @ V  # GEMM: the intra-chunk term, accumulated
                o[b, rows, h, cols] = acc_o  # the chunk's output is written ...
                S_T += K.T @ V  # ... before the state moves past the chunk
            # EXERCISE END
    return o[:, :N]


def _pad_tokens(x, length):
    """Zero-pad axis 1 (tokens) of a (B, N, H, D) array to `length`."""
    return np.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
