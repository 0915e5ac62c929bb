"""Exercise s06.intra_gradients (fix): reference C's intra-chunk backward kernel, in NumPy.

One program per (chunk, batch x head). The chunk loops before it have handed over dW = -dV_new S and
dV_new (= dU), and the prepare kernel the chunk's scores A_kk (M) and T = (I + L)^{-1},
L = M diag(beta) (here formed again from stage 5's functions: the same numbers in float64); the program
takes the UT transform back:
    A_hat = diag(beta) T,  W = A_hat (K ⊙ e^{gamma}),  U = A_hat V,
then the scores, through `score_gradients`, and last the cumulative gate gamma.

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 6 page, "The UT transform backwards".  Check: course check s06
"""

import numpy as np

from stages.common.checks import Float64Array
from stages.s05_fast_kda.reference import SUB_BLOCK, block_inverse, intra_chunk_scores
from stages.s06_backward.reference import StateProducts, score_gradients


def intra_gradients(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                    do: Float64Array, v_new: Float64Array, dv_new: Float64Array, products: StateProducts,
                    chunk_size: int, sub_block: int = SUB_BLOCK) -> tuple[Float64Array, ...]:
    """The intra-chunk kernel's control flow: one program per (chunk, batch x head).

    Every input is padded to N_padded tokens, a multiple of chunk_size: q, k, g (B, N_padded, H, d_k),
    v, do, v_new, dv_new (B, N_padded, H, d_v), beta (B, N_padded, H); products from
    `state_products`. Returns dq, dk (B, N_padded, H, d_k), dv (B, N_padded, H, d_v),
    dg (B, N_padded, H, d_k) and dbeta (B, N_padded, H). The kernel keeps dL, dM and dA_qk
    transposed, so that a column slab of them is a slab of rows.
    """
    B, N_padded, H, d_k = q.shape
    C = chunk_size
    dq, dk, dg = (np.zeros((B, N_padded, H, d_k)) for _ in range(3))
    dv, dbeta = np.zeros(v.shape), np.zeros((B, N_padded, H))
    for i_c in range(N_padded // C):  # grid.x
        rows = slice(i_c * C, (i_c + 1) * C)
        for i_bh in range(B * H):  # grid.y
            b, h = divmod(i_bh, H)
            Q, K, V, beta_c = q[b, rows, h], k[b, rows, h], v[b, rows, h], beta[b, rows, h]
            gamma = np.cumsum(g[b, rows, h], axis=0)
            A_kk, _ = intra_chunk_scores(Q, K, gamma, sub_block)  # the kernel reads the prepare kernel's
            T = block_inverse(A_kk * beta_c[None, :], sub_block)
            A_hat = beta_c[:, None] * T
            decay_from_start, decay_to_end = np.exp(gamma), np.exp(gamma[-1] - gamma)
            dW, dV_new = products.dw[b, rows, h], dv_new[b, rows, h]

            # EXERCISE BEGIN
            dA_hat = dW @ (K * decay_from_start).T + dV_new @ V.T  # GEMMs
            dv[b, rows, h] = A_hat.T @ dV_new  # GEMM
            dK_decayed = A_hat.T @ dW  # GEMM: d(K e^gamma)
            # dL^T = -T dT^T T with dT = diag(beta) dA_hat, so dT^T T = dA_hat^T A_hat: no dT is formed
            dL_T = np.triu(-(T @ (dA_hat.T @ A_hat)), 1)  # two GEMMs; strict upper: dL strict lower
            dbeta[b, rows, h] = np.sum(dA_hat * T, axis=1) + np.sum(dL_T * A_kk.T, axis=1)
            dM_T = dL_T * beta_c[:, None]  # dM = dL diag(beta), transposed
            dA_qk_T = np.triu(v_new[b, rows, h] @ do[b, rows, h].T)  # GEMM; j <= c: upper with the diagonal

            dQ_scores, dK_rows, dK_columns, dgamma = score_gradients(Q, K, gamma, dA_qk_T, dM_T, sub_block)
            dQ_decayed = products.dq_decayed[b, rows, h] * decay_from_start
            dK_decayed *= decay_from_start
            dK_to_end = products.dk_to_chunk_end[b, rows, h] * decay_to_end
            dq[b, rows, h] = dQ_decayed + dQ_scores
            dk[b, rows, h] = dK_decayed + dK_rows + dK_columns + dK_to_end
            dgamma += Q * dQ_decayed + K * (dK_decayed - dK_to_end)  # e^{+gamma} twice, e^{-gamma} once
            # gamma_C enters e^{gamma_C - gamma} of every row and the state's decay; it lies in the
            # last row, which every dg[s] sums: added to all rows at once
            d_gamma_last = np.sum(K * dK_to_end, axis=0) + products.d_gamma_last[b, i_c, h]
            dg[b, rows, h] = np.cumsum(dgamma[::-1], axis=0)[::-1] + d_gamma_last
            # EXERCISE END
    return dq, dk, dv, dg, dbeta
