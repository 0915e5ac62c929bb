"""Exercise s03.kernel_mirror (fix): reference C, the kernel's control flow in NumPy.

The loops are the kernel's: grid.x over blocks of value columns, grid.y over (batch, head), then
the pipelined loop over chunks, with the state S^T (d_k x block_dv) kept for the whole program. Per
chunk: the decay table Gamma, L and A_qk from two GEMMs, one forward substitution for
[K ⊙ e^{gamma} | V], the pseudo-values V_new = U - W S^T, the output, then the state.

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 3 page, "Reference C: the kernel's control flow".  Check: course check s03
"""

import numpy as np

from stages.common.checks import Float64Array, check_chunking, check_gate_and_beta, check_qkv, padded_length


def kernel_mirror(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                  chunk_size: int, block_dv: int) -> Float64Array:
    """Reference C: the kernel's control flow. State S^T: (d_k, block_dv) per program.

    Like the kernel's wrapper, it zero-pads N up to a multiple of chunk_size. The padding is exact:
    a padded token has k = v = 0, beta = 0 and g = 0 (no decay), so it leaves the state as it was,
    and its output row is cut off at the end.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="token")
    check_chunking(N, d_v, chunk_size, block_dv)
    C = chunk_size
    q, k, v = (_pad_tokens(x, padded_length(N, C)) for x in (q, k, v))
    g, beta = (_pad_tokens(x[..., None], padded_length(N, C))[..., 0] for x in (g, beta))
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
                gamma = np.cumsum(g[b, rows, h])  # in shared memory, one prefix sum per row
                # the decay table, zero above the diagonal where no decay is defined
                Gamma = np.tril(np.exp(gamma[:, None] - gamma[None, :]))
                L = np.tril((K @ K.T) * Gamma, -1) * beta_c[None, :]  # GEMM; strict: i < c
                A_qk = np.tril((Q @ K.T) * Gamma)  # GEMM; inclusive: j <= c
                # one forward substitution (I + L) X = [K ⊙ e^{gamma} | V], row by row
                X = np.concatenate([K * np.exp(gamma)[:, None], V], axis=1)
                for r in range(1, C):
                    X[r] -= L[r, :r] @ X[:r]
                X *= beta_c[:, None]  # beta after the solve: diag(beta) T
                W, U = X[:, :d_k], X[:, d_k:]
                V_new = U - W @ S_T  # GEMM
                acc_o = (Q * np.exp(gamma)[:, None]) @ S_T  # GEMM: the inter-chunk term
                acc_o += A_qk @ V_new  # GEMM: the intra-chunk term, accumulated
                o[b, rows, h, cols] = acc_o  # the chunk's output is written ...
                S_T *= np.exp(gamma[-1])  # ... then the state decays, one scalar ...
                S_T += (K * np.exp(gamma[-1] - gamma)[:, None]).T @ V_new  # ... then takes the chunk (GEMM)
            # EXERCISE END
    return o[:, :N]


def _pad_tokens(x, length):
    """Zero-pad axis 1 (tokens) of a (B, N, H, D) array to `length`."""
    return np.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
