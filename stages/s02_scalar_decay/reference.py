"""Stage 2 references in NumPy float64: linear attention with a constant decay per head.

    S_t = alpha S_{t-1} + v_t k_t^T        o_t = S_t q_t        (paper layout: S is d_v x d_k)

All three functions take q, k: (B, N, H, d_k), v: (B, N, H, d_v) and g = log(alpha): (H,), one
decay per head, and return o: (B, N, H, d_v); reference B returns it in a ChunkwiseOutput, beside
what only the chunked form has: the state at every chunk start and every chunk's scores.

- `recurrent` (A) is the recurrence token by token, in the paper layout.
- `chunkwise` (B) splits the sequence into chunks of C tokens and keeps the state transposed,
  S^T (d_k x d_v), the kernel layout. With rows r = 1..C counted from the chunk start and
  gamma_r = r g = log(alpha^r), the cumulative decay restarted at every chunk:
      A_qk[r, j] = Gamma[r, j] (Q[r] . K[j])  for j <= r
      O[r] = alpha^r Q[r] S^T  +  sum_{j <= r} A_qk[r, j] V[j]
      S^T <- alpha^C S^T + sum_j alpha^(C - j) K[j]^T V[j]
  with the decay table Gamma[r, j] = e^{gamma_r - gamma_j} = alpha^(r - j) (the ratio form).
  Decay enters in three places: the query (alpha^r), the key (alpha^(C - r)) and the state (alpha^C).
- `kernel_mirror` (C) is the TileLang kernel's control flow in NumPy: the same grid, chunk loop,
  buffers and GEMM-shaped products, so the kernel's logic can be stepped through on a CPU.
- `decay_table` builds Gamma for one head, in the ratio form, in any dtype.
"""

from typing import NamedTuple

import numpy as np
from numpy.typing import DTypeLike

from stages.common.checks import (Float64Array, check_chunking, check_gate, check_log_gates, check_positive_integer, check_qkv,
                                  padded_length)


class ChunkwiseOutput(NamedTuple):
    """What reference B returns: o, and the chunk quantities that a token-by-token loop never forms
    (in FLA's layouts: its h and Aqk)."""

    o: Float64Array  # (B, N, H, d_v)
    chunk_start_states: Float64Array  # (B, number of chunks, H, d_k, d_v): S^T as each chunk starts
    A_qk: Float64Array  # (B, N, H, C): token t's row of its chunk's A_qk, zero past the chunk's end


# --8<-- [start:recurrent]
def recurrent(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array) -> Float64Array:
    """Reference A: the recurrence token by token. State S: (d_v, d_k), the paper layout."""
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate(g, B, N, H, d_k, gate="head")
    o = np.zeros((B, N, H, d_v))
    for b in range(B):
        for h in range(H):
            alpha = np.exp(g[h])  # one decay per head, the same at every token
            S = np.zeros((d_v, d_k))
            for t in range(N):
                S = alpha * S + np.outer(v[b, t, h], k[b, t, h])  # the old state fades, the new token does not
                o[b, t, h] = S @ q[b, t, h]
    return o
# --8<-- [end:recurrent]


# --8<-- [start:chunkwise]
def chunkwise(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, chunk_size: int) -> ChunkwiseOutput:
    """Reference B: chunk by chunk with plain loops for the scores. State S^T: (d_k, d_v).

    Returns o with the state at every chunk start and every chunk's scores A_qk (ChunkwiseOutput).
    The last chunk may be shorter than chunk_size: its decays run to its own last row.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate(g, B, N, H, d_k, gate="head")
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
                gamma = g[h] * np.arange(1, C + 1)  # log alpha^r, r counted from the chunk start
                A_qk = np.zeros((C, C))
                for r in range(C):
                    for j in range(r + 1):  # j <= r: the decay is formed only where it is defined
                        A_qk[r, j] = np.exp(gamma[r] - gamma[j]) * (Q[r] @ K[j])  # Gamma[r, j] (q_r . k_j)
                inter_chunk = np.exp(gamma)[:, None] * (Q @ S_T)  # the state, r more steps faded
                intra_chunk = A_qk @ V  # the chunk's own rows, masked and decayed
                o[b, rows, h] = inter_chunk + intra_chunk
                chunk_start_states[b, start // chunk_size, h] = S_T
                A_qk_rows[b, rows, h, :C] = A_qk
                decay_to_chunk_end = np.exp(gamma[-1] - gamma)  # alpha^(C - r), every entry <= 1
                S_T = np.exp(gamma[-1]) * S_T + (K * decay_to_chunk_end[:, None]).T @ V
    return ChunkwiseOutput(o, chunk_start_states, A_qk_rows)
# --8<-- [end:chunkwise]


# --8<-- [start:kernel_mirror]
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
                S_T *= state_decay  # ... then the state decays ...
                S_T += K.T @ (V * key_decay[:, None])  # ... then takes the chunk (GEMM)
    return o[:, :N]
# --8<-- [end:kernel_mirror]


# --8<-- [start:decay_table]
def decay_table(g_head: float, chunk_size: int, dtype: DTypeLike = np.float64) -> np.ndarray:
    """Gamma (C x C) of one head: Gamma[i, j] = alpha^(i - j) for j <= i, 0 above the diagonal.

    g_head = log(alpha), a scalar. The ratio form: the exponent gamma_i - gamma_j = (i - j) g_head
    is formed first, so every entry is e^{<= 0}, at most 1, and fits any dtype. Gamma depends on
    i - j only, so one table serves every chunk.
    """
    check_log_gates("g_head", g_head)
    check_positive_integer("chunk_size", chunk_size)
    C = chunk_size
    gamma = g_head * np.arange(1, C + 1)  # log alpha^r, r counted from the chunk start
    lower = np.tril(np.ones((C, C), dtype=bool))  # j <= i
    exponent = np.where(lower, gamma[:, None] - gamma[None, :], -np.inf)  # <= 0; -inf above the diagonal
    return np.exp(exponent).astype(dtype)  # e^{gamma_i - gamma_j}: 1 on the diagonal, 0 above it
# --8<-- [end:decay_table]


def _pad_tokens(x, length):
    """Zero-pad axis 1 (tokens) of a (B, N, H, D) array to `length`."""
    return np.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
