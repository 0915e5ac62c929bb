"""Exercise s02.kernel_mirror (fix): reference C, the kernel's control flow in NumPy.

The loops are the kernel's: grid.x over blocks of value columns, grid.y over (batch, head), then
the pipelined loop over chunks, with the state S^T (d_k x block_dv) kept for the whole program.
The decays depend on the head only and are built once per program, before the chunk loop.

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 2 page, "Reference C: the kernel's control flow".  Check: course check s02
"""

import numpy as np

from stages.common.checks import Float64Array, check_chunking, check_gate, check_qkv, padded_length
from stages.s02_scalar_decay.reference import decay_table


def kernel_mirror(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array,
                  chunk_size: int, block_dv: int) -> Float64Array:
    """Reference C: the kernel's control flow. State S^T: (d_k, block_dv) per program.

    Like the kernel's wrapper, it zero-pads N up to a multiple of chunk_size. The padding is exact:
    padded tokens come after every real one, so causality keeps them out of every real output;
    their keys and values are zero, and the extra decay they apply to the state happens after the
    last output that reads it.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate(g, B, N, H, d_k, gate="head")
    check_chunking(N, d_v, chunk_size, block_dv)
    C = chunk_size
    q, k, v = (_pad_tokens(x, padded_length(N, C)) for x in (q, k, v))
    o = np.zeros((B, q.shape[1], H, d_v))
    for i_v in range(d_v // block_dv):  # grid.x: one program per block of value columns
        cols = slice(i_v * block_dv, (i_v + 1) * block_dv)
        for i_bh in range(B * H):  # grid.y: one program per (batch, head)
            b, h = divmod(i_bh, H)
            # EXERCISE BEGIN
            # alpha is the head's constant: every decay is the same for every chunk, so the
            # program builds them once, before the chunk loop
            positions = np.arange(1, C + 1)  # r = 1..C, counted from the chunk start
            decay = decay_table(g[h], C)  # Gamma[r, j] = alpha^(r - j), zero above the diagonal
            query_decay = np.exp(g[h] * positions)  # alpha^r: from the chunk start to row r
            key_decay = np.exp(g[h] * (C - positions))  # alpha^(C - r): from row r to the chunk end
            state_decay = np.exp(g[h] * C)  # alpha^C: across the whole chunk
            S_T = np.zeros((d_k, block_dv))  # the state, on chip for the whole program
            for i_c in range(q.shape[1] // C):  # the pipelined chunk loop
                rows = slice(i_c * C, (i_c + 1) * C)
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h, cols]
                scores = (Q @ K.T) * decay  # GEMM, then the decay table (the mask included)
                acc_o = Q @ S_T  # GEMM: the inter-chunk term ...
                acc_o *= query_decay[:, None]  # ... times alpha^r, row by row (= decaying each q)
                acc_o += scores @ V  # GEMM: the intra-chunk term, accumulated
                o[b, rows, h, cols] = acc_o  # the chunk's output is written ...
                S_T += K.T @ (V * key_decay[:, None])  # ... then the state takes the chunk (GEMM) ...
                S_T *= state_decay  # ... and decays
            # EXERCISE END
    return o[:, :N]


def _pad_tokens(x, length):
    """Zero-pad axis 1 (tokens) of a (B, N, H, D) array to `length`."""
    return np.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
