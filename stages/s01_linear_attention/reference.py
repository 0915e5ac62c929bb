"""Stage 1 references in NumPy float64: linear attention without decay.

    S_t = S_{t-1} + v_t k_t^T        o_t = S_t q_t        (paper layout: S is d_v x d_k)

All three functions take q, k: (B, N, H, d_k) and v: (B, N, H, d_v) and return o: (B, N, H, d_v);
reference B returns it in a ChunkwiseOutput, beside what only the chunked form has: the state at
every chunk start and every chunk's scores.

- `recurrent` (A) is the recurrence token by token, in the paper layout.
- `chunkwise` (B) splits the sequence into chunks of C tokens and keeps the state transposed,
  S^T (d_k x d_v), the kernel layout. For chunk [t] with rows Q, K, V (C x d):
      A_qk = Q K^T ⊙ M                     the chunk's scores, causally masked
      O = Q S^T  +  A_qk V                 inter-chunk term + intra-chunk term
      S^T <- S^T + K^T V                   the state after the chunk, used by the next one
  with M[r, j] = 1 if j <= r (the diagonal is included: a token sees itself).
- `kernel_mirror` (C) is the TileLang kernel's control flow in NumPy: the same grid, chunk loop,
  buffers and GEMM-shaped products, so the kernel's logic can be stepped through on a CPU.
"""

from typing import NamedTuple

import numpy as np

from stages.common.checks import Float64Array, check_chunking, check_qkv, padded_length


class ChunkwiseOutput(NamedTuple):
    """What reference B returns: o, and the chunk quantities that a token-by-token loop never forms
    (in FLA's layouts: its h and Aqk)."""

    o: Float64Array  # (B, N, H, d_v)
    chunk_start_states: Float64Array  # (B, number of chunks, H, d_k, d_v): S^T as each chunk starts
    A_qk: Float64Array  # (B, N, H, C): token t's row of its chunk's A_qk, zero past the chunk's end


# --8<-- [start:recurrent]
def recurrent(q: Float64Array, k: Float64Array, v: Float64Array) -> Float64Array:
    """Reference A: the recurrence token by token. State S: (d_v, d_k), the paper layout."""
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    o = np.zeros((B, N, H, d_v))
    for b in range(B):
        for h in range(H):
            S = np.zeros((d_v, d_k))
            for t in range(N):
                S = S + np.outer(v[b, t, h], k[b, t, h])
                o[b, t, h] = S @ q[b, t, h]
    return o
# --8<-- [end:recurrent]


# --8<-- [start:chunkwise]
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
    for b in range(B):
        for h in range(H):
            S_T = np.zeros((d_k, d_v))
            for start in range(0, N, chunk_size):
                rows = slice(start, min(start + chunk_size, N))
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h]
                C = len(Q)
                A_qk = np.zeros((C, C))
                for r in range(C):
                    for j in range(r + 1):  # j <= r: a token sees itself
                        A_qk[r, j] = Q[r] @ K[j]
                inter_chunk = Q @ S_T  # what the earlier chunks left in the state
                intra_chunk = A_qk @ V  # the chunk's own rows, masked
                o[b, rows, h] = inter_chunk + intra_chunk
                chunk_start_states[b, start // chunk_size, h] = S_T
                A_qk_rows[b, rows, h, :C] = A_qk
                S_T = S_T + K.T @ V  # only after every row of the chunk has read the old state
    return ChunkwiseOutput(o, chunk_start_states, A_qk_rows)
# --8<-- [end:chunkwise]


# --8<-- [start:kernel_mirror]
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
            S_T = np.zeros((d_k, block_dv))  # the state, on chip for the whole program
            for i_c in range(q.shape[1] // C):  # the pipelined chunk loop
                rows = slice(i_c * C, (i_c + 1) * C)
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h, cols]
                scores = (Q @ K.T) * causal_mask  # GEMM, then the mask on the fragment
                acc_o = Q @ S_T  # GEMM: the inter-chunk term
                acc_o += scores @ V  # GEMM: the intra-chunk term, accumulated
                o[b, rows, h, cols] = acc_o  # the chunk's output is written ...
                S_T += K.T @ V  # ... before the state moves past the chunk
    return o[:, :N]
# --8<-- [end:kernel_mirror]


def _pad_tokens(x, length):
    """Zero-pad axis 1 (tokens) of a (B, N, H, D) array to `length`."""
    return np.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
