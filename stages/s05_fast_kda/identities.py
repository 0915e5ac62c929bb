"""Stage 5 identities, proved with SymPy on symbols of small size.

Symbols: a_{t,d} > 0 is the gate of token t in key channel d, so e^{gamma_r} - e^{gamma_s} ratios
are products of gates (no logarithm is needed); q, k, v are rows of Q, K (N x d_k) and V (N x d_v);
beta_t the write strengths; S0^T (d_k x d_v) the state before the sequence, any value. Kernel
layout throughout: the recurrence reads
    S_t^T = (I - beta_t k_t^T k_t) Diag(a_t) S_{t-1}^T + beta_t k_t^T v_t      o_t = q_t S_t^T

Sizes: the block inverse on C = 4 rows in sub-blocks of 2; the anchored scores on one chunk of
C = 4 tokens in sub-blocks of 2 with d_k = 2; the split forward on N = 4 tokens in two chunks of
C = 2 with d_k = 2, d_v = 1.

Run `python -m stages.s05_fast_kda.identities` to prove them all.
"""

import sympy as sp

from stages.common.symbolic import Identity, causal_mask, matrix, print_identities

C, SUB, d_k = 4, 2, 2  # the chunk of the block inverse and of the anchored scores
N_SPLIT, C_SPLIT, d_v_SPLIT = 4, 2, 1  # the split forward


def _gates(rows, cols):
    return sp.Matrix(rows, cols, lambda t, d: sp.Symbol(f"a_{t}{d}", positive=True))


def _decay(gates, r, s, d):
    """e^{gamma_r[d] - gamma_s[d]} = a_{s+1,d} ... a_{r,d} for s <= r, and its reciprocal for s > r."""
    if s <= r:
        return sp.Mul(*[gates[t, d] for t in range(s + 1, r + 1)])
    return 1 / _decay(gates, s, r, d)


def _block_inverse(L, block):
    """(I + L)^{-1} by the algorithm of reference.block_inverse: forward substitution in the diagonal
    blocks, then T[P, :P] = -T[P, P] (L[P, :P] T[:P, :P]) block row by block row."""
    size = L.rows
    T = sp.zeros(size, size)
    for r in range(block):
        for s0 in range(0, size, block):
            i = s0 + r
            for c in range(s0, s0 + block):
                T[i, c] = (1 if c == i else 0) - sum(L[i, j] * T[j, c] for j in range(s0, i))
    for p0 in range(block, size, block):
        rows, above = slice(p0, p0 + block), slice(0, p0)
        T[rows, above] = -T[rows, rows] * (L[rows, above] * T[above, above])
    return T


def _anchored_scores(Q, K, gates, block):
    """A_kk (strict) and A_qk (inclusive) from anchored factors, as reference.intra_chunk_scores
    builds them: diagonal blocks anchored at their middle row, off-diagonal slabs at the first row
    below them. Entry (c, i) is the sum over d of row factor times column factor."""
    size = K.rows
    A_kk, A_qk = sp.zeros(size, size), sp.zeros(size, size)
    for c in range(size):
        for i in range(c + 1):
            if c // block == i // block:
                anchor = (c // block) * block + block // 2
            else:
                anchor = (i // block + 1) * block  # the first row below i's slab
            factors = [_decay(gates, c, anchor, d) * _decay(gates, anchor, i, d) for d in range(K.cols)]
            A_qk[c, i] = sum(Q[c, d] * factors[d] * K[i, d] for d in range(K.cols))
            if i < c:
                A_kk[c, i] = sum(K[c, d] * factors[d] * K[i, d] for d in range(K.cols))
    return A_kk, A_qk


def _defined_scores(Q, K, gates):
    """A_kk[c, i] = (k_c ⊙ e^{gamma_c - gamma_i}) . k_i for i < c, A_qk the same with q_c for i <= c."""
    size = K.rows
    A_kk = sp.Matrix(size, size, lambda c, i: sum(
        K[c, d] * _decay(gates, c, i, d) * K[i, d] for d in range(K.cols)) if i < c else 0)
    A_qk = sp.Matrix(size, size, lambda c, i: sum(
        Q[c, d] * _decay(gates, c, i, d) * K[i, d] for d in range(K.cols)) if i <= c else 0)
    return A_kk, A_qk


def _recurrence(Q, K, V, gates, betas, S0_T):
    """Outputs (N x d_v) and final state of the token-by-token recurrence, kernel layout."""
    S_T, outputs = S0_T, []
    for t in range(Q.rows):
        householder = sp.eye(K.cols) - betas[t] * K[t, :].T * K[t, :]
        S_T = householder * sp.diag(*gates[t, :]) * S_T + betas[t] * K[t, :].T * V[t, :]
        outputs.append(Q[t, :] * S_T)
    return sp.Matrix.vstack(*outputs), S_T


def _prepare_chunk(Q, K, V, gates, betas):
    """The prepare kernel's tensors of one chunk, from the chunk's own symbols only (no state)."""
    size, channels = K.rows, K.cols
    A_kk, A_qk = _defined_scores(Q, K, gates)
    T = (sp.eye(size) + A_kk * sp.diag(*betas)).inv()
    A_hat = sp.diag(*betas) * T
    from_start = sp.Matrix(size, channels, lambda r, d: _decay(gates, r, -1, d))  # e^{gamma_r}
    to_end = sp.Matrix(size, channels, lambda r, d: _decay(gates, size - 1, r, d))  # e^{gamma_C - gamma_r}
    return dict(w=A_hat * K.multiply_elementwise(from_start), u=A_hat * V, q_decayed=Q.multiply_elementwise(from_start),
                k_to_chunk_end=K.multiply_elementwise(to_end), a_qk=A_qk,
                chunk_decay=[_decay(gates, size - 1, -1, d) for d in range(channels)])


def _split_forward(Q, K, V, gates, betas, S0_T, chunk_size):
    """Every chunk prepared on its own, then the recurrence over the prepared tensors."""
    starts = range(0, Q.rows, chunk_size)
    prepared = [_prepare_chunk(*(X[s:s + chunk_size, :] for X in (Q, K, V, gates)), betas[s:s + chunk_size])
                for s in starts]
    S_T, outputs = S0_T, []
    for chunk in prepared:
        V_new = chunk["u"] - chunk["w"] * S_T
        outputs.append(chunk["q_decayed"] * S_T + chunk["a_qk"] * V_new)
        S_T = sp.diag(*chunk["chunk_decay"]) * S_T + chunk["k_to_chunk_end"].T * V_new
    return sp.Matrix.vstack(*outputs), S_T


def _split_symbols():
    betas = [sp.Symbol(f"beta_{t}", positive=True) for t in range(N_SPLIT)]
    return (matrix("q", N_SPLIT, d_k), matrix("k", N_SPLIT, d_k), matrix("v", N_SPLIT, d_v_SPLIT),
            _gates(N_SPLIT, d_k), betas, matrix("s", d_k, d_v_SPLIT))


# --8<-- [start:identities]
def block_inverse_equals_inverse():
    L = matrix("l", C, C).multiply_elementwise(causal_mask(C, include_diagonal=False))
    return Identity(
        "block inverse",
        "For L strictly lower triangular, inverting the diagonal sub-blocks by forward substitution "
        "and merging T[P, :P] = -T[P, P] (L[P, :P] T[:P, :P]) gives (I + L)^{-1}.",
        _block_inverse(L, SUB),
        (sp.eye(C) + L).inv(),
    )


def anchored_scores_equal_definition():
    gates = _gates(C, d_k)
    Q, K = matrix("q", C, d_k), matrix("k", C, d_k)
    A_kk, A_qk = _anchored_scores(Q, K, gates, SUB)
    defined_kk, defined_qk = _defined_scores(Q, K, gates)
    return Identity(
        "anchored scores",
        "e^{gamma_c - gamma_i} = e^{gamma_c - gamma_a} e^{gamma_a - gamma_i} for any anchor a: A_kk and "
        "A_qk built from anchored row and column factors equal their definitions entry by entry.",
        sp.Matrix.hstack(A_kk, A_qk),
        sp.Matrix.hstack(defined_kk, defined_qk),
    )


def off_diagonal_factors_are_products_of_gates():
    gates = _gates(C, 1)
    anchor = SUB  # the first row below the first slab: rows SUB.., columns 0..SUB-1
    rows, cols = range(anchor, C), range(0, SUB)
    from_start = [_decay(gates, r, -1, 0) for r in range(C)]  # e^{gamma_r}, the unanchored table
    return Identity(
        "off-diagonal factors <= 1",
        "Below a slab, e^{gamma_r - gamma_a} = a_{a+1} ... a_r and e^{gamma_a - gamma_i} = a_{i+1} ... a_a: "
        "both factors are products of gates, so neither exceeds 1 (the chunk-start split "
        "e^{gamma_r} e^{-gamma_i} has a factor 1 / (a_1 ... a_i) instead).",
        sp.Matrix([[from_start[r] / from_start[anchor] for r in rows] + [from_start[anchor] / from_start[i] for i in cols]]),
        sp.Matrix([[sp.Mul(*[gates[t, 0] for t in range(anchor + 1, r + 1)]) for r in rows]
                   + [sp.Mul(*[gates[t, 0] for t in range(i + 1, anchor + 1)]) for i in cols]]),
    )


def split_forward_equals_recurrence():
    Q, K, V, gates, betas, S0_T = _split_symbols()
    return Identity(
        "split forward = recurrence",
        "Preparing every chunk from its own tokens alone (W, U, Q e^{gamma}, K e^{gamma_C - gamma}, A_qk, "
        "e^{gamma_C}) and then running V_new = U - W S^T, O = Q e^{gamma} S^T + A_qk V_new, "
        "S^T <- Diag(e^{gamma_C}) S^T + (K e^{gamma_C - gamma})^T V_new gives the recurrence's outputs.",
        _split_forward(Q, K, V, gates, betas, S0_T, C_SPLIT)[0],
        _recurrence(Q, K, V, gates, betas, S0_T)[0],
    )


def split_final_state_equals_recurrence():
    Q, K, V, gates, betas, S0_T = _split_symbols()
    return Identity(
        "split forward, final state",
        "The state after the last chunk of the split forward equals the recurrence's state after the "
        "last token: the recurrence kernel can hand it to the next call.",
        _split_forward(Q, K, V, gates, betas, S0_T, C_SPLIT)[1],
        _recurrence(Q, K, V, gates, betas, S0_T)[1],
    )
# --8<-- [end:identities]


IDENTITIES = [block_inverse_equals_inverse, anchored_scores_equal_definition, off_diagonal_factors_are_products_of_gates,
              split_forward_equals_recurrence, split_final_state_equals_recurrence]


def main():
    print_identities(IDENTITIES)


if __name__ == "__main__":
    main()
