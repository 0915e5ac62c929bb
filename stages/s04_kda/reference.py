"""Stage 4 references in NumPy float64: Kimi Delta Attention (KDA), a per-channel gate.

    S_t = S_{t-1} Diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T        o_t = S_t q_t
                                                             (paper layout: S is d_v x d_k)

q, k: (B, N, H, d_k); v: (B, N, H, d_v); g = log(a): (B, N, H, d_k), one gate per key channel;
beta: (B, N, H), the write strength in [0, 1]. Every function returns o: (B, N, H, d_v); reference B
returns it in a ChunkwiseOutput, beside what only the chunked form has: the state at every chunk
start, every chunk's scores A_qk and its WY factors W and U.

- `recurrent` (A) is the recurrence token by token, in the paper layout.
- `chunkwise` (B) keeps the state transposed, S^T (d_k x d_v), the kernel layout. For chunk [t]
  with rows Q, K, V, gates G and gamma[r] = G[0] + ... + G[r] (a vector of d_k log decays):
      M[c, i]   = (k_c ⊙ e^{gamma_c - gamma_i}) · k_i  for i < c    the decay grows inside the product
      T         = (I + L)^{-1},  L[c, i] = beta_i M[c, i]            the UT transform
      W, U      = diag(beta) T (K ⊙ e^{gamma}),  diag(beta) T V      the WY factors
      V_new     = U - W S^T                                           the pseudo-values
      A_qk[c, j] = (q_c ⊙ e^{gamma_c - gamma_j}) · k_j  for j <= c
      O         = (Q ⊙ e^{gamma}) S^T + A_qk V_new
      S^T      <- Diag(e^{gamma_C}) S^T + (K ⊙ e^{gamma_C - gamma})^T V_new
- `kernel_mirror` (C) is the TileLang kernel's control flow in NumPy: the exponent split
  e^{gamma_c - gamma_i} = e^{gamma_c} e^{-gamma_i} turns M and A_qk into GEMMs, one forward
  substitution solves for [K ⊙ e^{gamma} | V] at once with beta applied after it, and the state is
  decayed row by row. With `sub_chunk_size`, gamma restarts at every sub-chunk so that e^{-gamma}
  stays bounded (see the Numerics section of the page).
"""

from typing import NamedTuple

import numpy as np

from stages.common.checks import Float64Array, check_chunking, check_divisor, check_gate_and_beta, check_qkv, padded_length


class ChunkwiseOutput(NamedTuple):
    """What reference B returns: o, and the chunk quantities that a token-by-token loop never forms
    (in FLA's layouts: its h, Aqk, w and u)."""

    o: Float64Array  # (B, N, H, d_v)
    chunk_start_states: Float64Array  # (B, number of chunks, H, d_k, d_v): S^T as each chunk starts
    A_qk: Float64Array  # (B, N, H, C): token t's row of its chunk's A_qk, zero past the chunk's end
    W: Float64Array  # (B, N, H, d_k): token t's row of its chunk's W
    U: Float64Array  # (B, N, H, d_v): token t's row of its chunk's U


# --8<-- [start:recurrent]
def recurrent(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array) -> Float64Array:
    """Reference A: the recurrence token by token. State S: (d_v, d_k), the paper layout."""
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="channel")
    o = np.zeros((B, N, H, d_v))
    for b in range(B):
        for h in range(H):
            S = np.zeros((d_v, d_k))
            for t in range(N):
                k_t, beta_t = k[b, t, h], beta[b, t, h]
                decay = np.diag(np.exp(g[b, t, h]))  # Diag(a_t): one rate per key channel
                householder = np.eye(d_k) - beta_t * np.outer(k_t, k_t)
                # Diag(a_t) sits between S_{t-1} and the Householder factor
                S = S @ decay @ householder + beta_t * np.outer(v[b, t, h], k_t)
                o[b, t, h] = S @ q[b, t, h]
    return o
# --8<-- [end:recurrent]


# --8<-- [start:chunkwise]
def chunkwise(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
              chunk_size: int) -> ChunkwiseOutput:
    """Reference B: chunk by chunk, plain loops for M and A_qk, the UT transform by inversion.
    State S^T: (d_k, d_v).

    Returns o with the state at every chunk start, every chunk's A_qk, W and U (ChunkwiseOutput).
    The last chunk may be shorter than chunk_size: nothing in the math needs equal chunks.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="channel")
    check_chunking(N, d_v, chunk_size)
    o = np.zeros((B, N, H, d_v))
    chunk_start_states = np.zeros((B, padded_length(N, chunk_size) // chunk_size, H, d_k, d_v))
    A_qk_rows = np.zeros((B, N, H, chunk_size))  # each token's row of its chunk's A_qk
    W_rows, U_rows = np.zeros((B, N, H, d_k)), np.zeros((B, N, H, d_v))
    for b in range(B):
        for h in range(H):
            S_T = np.zeros((d_k, d_v))
            for start in range(0, N, chunk_size):
                rows = slice(start, min(start + chunk_size, N))
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h]
                beta_c = beta[b, rows, h]
                C = len(Q)
                gamma = np.cumsum(g[b, rows, h], axis=0)  # (C, d_k): log decay from the chunk start
                M = np.zeros((C, C))
                for c in range(C):
                    for i in range(c):  # i < c: strictly lower triangular
                        M[c, i] = (K[c] * np.exp(gamma[c] - gamma[i])) @ K[i]
                L = M * beta_c[None, :]  # L[c, i] = beta_i M[c, i] ...
                T = np.linalg.inv(np.eye(C) + L)
                A_hat = beta_c[:, None] * T  # ... pairs with diag(beta) T
                W = A_hat @ (K * np.exp(gamma))
                U = A_hat @ V
                V_new = U - W @ S_T
                A_qk = np.zeros((C, C))
                for c in range(C):
                    for j in range(c + 1):  # j <= c: a token sees itself, undecayed
                        A_qk[c, j] = (Q[c] * np.exp(gamma[c] - gamma[j])) @ K[j]
                o[b, rows, h] = (Q * np.exp(gamma)) @ S_T + A_qk @ V_new
                chunk_start_states[b, start // chunk_size, h] = S_T
                A_qk_rows[b, rows, h, :C], W_rows[b, rows, h], U_rows[b, rows, h] = A_qk, W, U
                decay_to_chunk_end = np.exp(gamma[-1] - gamma)  # (C, d_k), every entry <= 1
                S_T = np.exp(gamma[-1])[:, None] * S_T + (K * decay_to_chunk_end).T @ V_new
    return ChunkwiseOutput(o, chunk_start_states, A_qk_rows, W_rows, U_rows)
# --8<-- [end:chunkwise]


# --8<-- [start:kernel_mirror]
def kernel_mirror(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                  chunk_size: int, block_dv: int, sub_chunk_size: int | None = None) -> Float64Array:
    """Reference C: the kernel's control flow. State S^T: (d_k, block_dv) per program.

    Like the kernel's wrapper, it zero-pads N up to a multiple of chunk_size. The padding is exact:
    a padded token has k = v = 0, beta = 0 and g = 0 (no decay), so it leaves the state as it was,
    and its output row is cut off at the end.
    sub_chunk_size (a divisor of chunk_size; default chunk_size, the kernel's case) restarts the
    cumulative decay of the key operand at every sub-chunk.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="channel")
    check_chunking(N, d_v, chunk_size, block_dv)
    C = chunk_size
    sub = C if sub_chunk_size is None else sub_chunk_size
    check_divisor("sub_chunk_size", sub, "chunk_size", C)
    q, k, v, g = (_pad_tokens(x, padded_length(N, C)) for x in (q, k, v, g))
    beta = _pad_tokens(beta[..., None], padded_length(N, C))[..., 0]
    o = np.zeros((B, q.shape[1], H, d_v))
    for i_v in range(d_v // block_dv):  # grid.x: one program per block of value columns
        cols = slice(i_v * block_dv, (i_v + 1) * block_dv)
        for i_bh in range(B * H):  # grid.y: one program per (batch, head)
            b, h = divmod(i_bh, H)
            S_T = np.zeros((d_k, block_dv))  # the state, on chip for the whole program
            for i_c in range(q.shape[1] // C):  # the pipelined chunk loop
                rows = slice(i_c * C, (i_c + 1) * C)
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h, cols]
                beta_c = beta[b, rows, h]
                gamma = np.cumsum(g[b, rows, h], axis=0)  # in shared memory: channels in parallel, rows in order
                # the exponent split e^{gamma_c - gamma_i} = e^{gamma_c - origin} e^{origin - gamma_i},
                # one block of key columns (a sub-chunk) at a time; origin = the decay before it
                M, A_qk = np.zeros((C, C)), np.zeros((C, C))
                for s0 in range(0, C, sub):
                    keys, later = slice(s0, s0 + sub), slice(s0, C)
                    origin = gamma[s0 - 1] if s0 > 0 else np.zeros(d_k)
                    K_minus = K[keys] * np.exp(origin - gamma[keys])  # >= 1: the fp16 risk
                    K_plus = K[later] * np.exp(gamma[later] - origin)  # <= 1
                    Q_plus = Q[later] * np.exp(gamma[later] - origin)
                    M[later, keys] = K_plus @ K_minus.T  # GEMM
                    A_qk[later, keys] = Q_plus @ K_minus.T  # GEMM
                L = np.tril(M, -1) * beta_c[None, :]  # strict: i < c; L[c, i] = beta_i M[c, i]
                A_qk = np.tril(A_qk)  # inclusive: j <= c
                # one forward substitution (I + L) X = [K ⊙ e^{gamma} | V], row by row
                X = np.concatenate([K * np.exp(gamma), V], axis=1)
                for r in range(1, C):
                    X[r] -= L[r, :r] @ X[:r]
                X *= beta_c[:, None]  # beta after the solve: diag(beta) T
                W, U = X[:, :d_k], X[:, d_k:]
                V_new = U - W @ S_T  # GEMM
                acc_o = (Q * np.exp(gamma)) @ S_T  # GEMM: the inter-chunk term
                acc_o += A_qk @ V_new  # GEMM: the intra-chunk term, accumulated
                o[b, rows, h, cols] = acc_o  # the chunk's output is written ...
                S_T *= np.exp(gamma[-1])[:, None]  # ... then the state decays, row by row ...
                S_T += (K * np.exp(gamma[-1] - gamma)).T @ V_new  # ... then takes the chunk (GEMM)
    return o[:, :N]
# --8<-- [end:kernel_mirror]


def _pad_tokens(x, length):
    """Zero-pad axis 1 (tokens) of a (B, N, H, D) array to `length`."""
    return np.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
