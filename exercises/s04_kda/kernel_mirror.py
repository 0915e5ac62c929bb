"""Exercise s04.kernel_mirror (fix): reference C, the KDA kernel's control flow in NumPy.

The loops are the kernel's: grid.x over blocks of value columns, grid.y over (batch, head), then
the pipelined loop over chunks, with the state S^T (d_k x block_dv) kept for the whole program.
Per chunk: the exponent split makes M and A_qk two GEMMs, one forward substitution solves
(I + L) X = [K ⊙ e^{gamma} | V] for W = diag(beta) T (K ⊙ e^{gamma}) and U = diag(beta) T V, and the
state decays row by row.

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 4 page, "Reference C: the kernel's control flow".  Check: course check s04
"""

import numpy as np

from stages.common.checks import Float64Array, check_chunking, check_divisor, check_gate_and_beta, check_qkv, padded_length


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
            # EXERCISE BEGIN
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
                X *= beta_c[:, None]  # the write strengths
                for r in range(1, C):
                    X[r] -= L[r, :r] @ X[:r]
                W, U = X[:, :d_k], X[:, d_k:]
                V_new = U - W @ S_T  # GEMM
                acc_o = (Q * np.exp(gamma)) @ S_T  # GEMM: the inter-chunk term
                acc_o += A_qk @ V_new  # GEMM: the intra-chunk term, accumulated
                o[b, rows, h, cols] = acc_o  # the chunk's output is written ...
                S_T *= np.exp(gamma[-1])[:, None]  # ... then the state decays, row by row ...
                S_T += (K * np.exp(gamma[-1] - gamma)).T @ V_new  # ... then takes the chunk (GEMM)
            # EXERCISE END
    return o[:, :N]


def _pad_tokens(x, length):
    """Zero-pad axis 1 (tokens) of a (B, N, H, D) array to `length`."""
    return np.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
