"""Stage 3 identities, proved with SymPy on symbols of small size.

Symbols: one chunk of C = 3 tokens, d_k = 2, d_v = 2; q, k, v are rows of Q (C x d_k), K (C x d_k),
V (C x d_v); a_r = alpha_r = e^{g_r} > 0 are the gates and b_r = beta_r the write strengths; S0^T
(d_k x d_v) is the state the chunk starts from, any value, so that proving one chunk proves every
chunk of a sequence. Kernel layout throughout (S^T), so the recurrence reads, with row vectors,
    S_t^T = a_t (I - b_t k_t^T k_t) S_{t-1}^T + b_t k_t^T v_t        o_t = q_t S_t^T.
The decays e^{gamma_r} = a_0 ... a_r and e^{gamma_c - gamma_i} = a_{i+1} ... a_c are written as the
products they are, so that every identity but the last is one between polynomials.

Run `python -m stages.s03_gated_deltanet.identities` to prove them all.
"""

from functools import reduce

import sympy as sp

from stages.common.symbolic import Identity, matrix, print_identities

C, d_k, d_v = 3, 2, 2


def _symbols():
    gates = sp.symbols(f"a0:{C}", positive=True)
    betas = sp.symbols(f"b0:{C}", real=True)
    return matrix("q", C, d_k), matrix("k", C, d_k), matrix("v", C, d_v), gates, betas, matrix("s", d_k, d_v)


def _decay(gates, start, end):
    """e^{gamma_end - gamma_start} = a_{start+1} ... a_end (1 when end == start)."""
    return reduce(lambda x, y: x * y, gates[start + 1:end + 1], sp.Integer(1))


def _recurrence(Q, K, V, gates, betas, S0_T):
    """Outputs (C x d_v), final state, and the writes u_t (C x d_v) of the token-by-token recurrence,
    where u_t = b_t (v_t - a_t k_t S_{t-1}^T) is what token t adds: S_t^T = a_t S_{t-1}^T + k_t^T u_t."""
    S_T, outputs, writes = S0_T, [], []
    for t in range(Q.rows):
        decayed = gates[t] * S_T
        write = betas[t] * (V[t, :] - K[t, :] * decayed)
        S_T = decayed + K[t, :].T * write
        outputs.append(Q[t, :] * S_T)
        writes.append(write)
    return sp.Matrix.vstack(*outputs), S_T, sp.Matrix.vstack(*writes)


def _ut_transform(K, gates, betas):
    """W = diag(beta) T (K ⊙ e^{gamma}) and diag(beta) T, with T = (I + L)^{-1}, L[c, i] = b_i M[c, i]."""
    rows = K.rows
    M = sp.Matrix(rows, rows, lambda c, i: _decay(gates, i, c) * (K[c, :] * K[i, :].T)[0] if i < c else 0)
    T = (sp.eye(rows) + M * sp.diag(*betas)).inv()
    A_hat = sp.diag(*betas) * T
    K_decayed = sp.diag(*[_decay(gates, -1, r) for r in range(rows)]) * K
    return A_hat * K_decayed, A_hat


def _chunked(Q, K, V, gates, betas, S0_T):
    """Outputs and final state of one chunk in the WY form of reference B."""
    W, A_hat = _ut_transform(K, gates, betas)
    V_new = A_hat * V - W * S0_T
    rows = Q.rows
    A_qk = sp.Matrix(rows, rows, lambda c, j: _decay(gates, j, c) * (Q[c, :] * K[j, :].T)[0] if j <= c else 0)
    Q_decayed = sp.diag(*[_decay(gates, -1, r) for r in range(rows)]) * Q
    K_to_end = sp.diag(*[_decay(gates, r, rows - 1) for r in range(rows)]) * K
    outputs = Q_decayed * S0_T + A_qk * V_new
    S_T = _decay(gates, -1, rows - 1) * S0_T + K_to_end.T * V_new
    return outputs, S_T


# --8<-- [start:identities]
def householder_product_equals_wy_form():
    _, K, _, gates, betas, _ = _symbols()
    product = sp.eye(d_k)
    for t in range(C):  # the token that comes last multiplies from the left
        product = gates[t] * (sp.eye(d_k) - betas[t] * K[t, :].T * K[t, :]) * product
    W, _ = _ut_transform(K, gates, betas)
    K_to_end = sp.diag(*[_decay(gates, r, C - 1) for r in range(C)]) * K
    return Identity(
        "product of the factors = WY form",
        "a_C (I - b_C k_C^T k_C) ... a_1 (I - b_1 k_1^T k_1) = e^{gamma_C} I - (K ⊙ e^{gamma_C - gamma})^T W: "
        "C rank-one updates of the identity are one rank-C update.",
        product,
        _decay(gates, -1, C - 1) * sp.eye(d_k) - K_to_end.T * W,
    )


def ut_transform_solves_the_chunk_system():
    _, K, V, gates, betas, S0_T = _symbols()
    writes = _recurrence(matrix("q", C, d_k), K, V, gates, betas, S0_T)[2]
    W, A_hat = _ut_transform(K, gates, betas)
    return Identity(
        "T = (I + L)^{-1} solves the chunk's system",
        "The writes u_t = b_t (v_t - a_t k_t S_{t-1}^T) that the recurrence makes one after another are "
        "U - W S0^T = diag(beta) T (V - (K ⊙ e^{gamma}) S0^T), all at once.",
        writes,
        A_hat * V - W * S0_T,
    )


def chunk_output_equals_recurrence():
    Q, K, V, gates, betas, S0_T = _symbols()
    return Identity(
        "chunked output = recurrence",
        "(Q ⊙ e^{gamma}) S0^T + A_qk (U - W S0^T) equals q_t S_t^T of the recurrence for every token.",
        _chunked(Q, K, V, gates, betas, S0_T)[0],
        _recurrence(Q, K, V, gates, betas, S0_T)[0],
    )


def chunk_state_update_equals_recurrence():
    Q, K, V, gates, betas, S0_T = _symbols()
    return Identity(
        "state across a chunk",
        "e^{gamma_C} S0^T + (K ⊙ e^{gamma_C - gamma})^T (U - W S0^T) equals the state the recurrence "
        "reaches token by token.",
        _chunked(Q, K, V, gates, betas, S0_T)[1],
        _recurrence(Q, K, V, gates, betas, S0_T)[1],
    )


def beta_pairings_agree():
    betas = sp.symbols(f"b0:{C}", real=True)
    M = sp.Matrix(C, C, lambda c, i: sp.Symbol(f"m_{c}{i}", real=True) if i < c else 0)
    beta = sp.diag(*betas)
    return Identity(
        "the two beta pairings agree",
        "diag(beta) (I + L)^{-1} with L[c, i] = beta_i M[c, i] equals (I + L')^{-1} diag(beta) with "
        "L'[c, i] = beta_c M[c, i].",
        beta * (sp.eye(C) + M * beta).inv(),
        (sp.eye(C) + beta * M).inv() * beta,
    )


def mixed_beta_pairing():
    """Not an identity: the course proves that it fails (see the test of this stage)."""
    betas = sp.symbols(f"b0:{C}", real=True)
    M = sp.Matrix(C, C, lambda c, i: sp.Symbol(f"m_{c}{i}", real=True) if i < c else 0)
    beta = sp.diag(*betas)
    return Identity(
        "mixing the pairings is wrong",
        "diag(beta) (I + L')^{-1} with L'[c, i] = beta_c M[c, i] differs from diag(beta) (I + L)^{-1} "
        "with L[c, i] = beta_i M[c, i] unless every beta is equal.",
        beta * (sp.eye(C) + beta * M).inv(),
        beta * (sp.eye(C) + M * beta).inv(),
    )


def scalar_decay_factors_out():
    K = matrix("k", C, d_k)
    g = sp.symbols(f"g0:{C}", real=True)
    gamma = [sum(g[:r + 1]) for r in range(C)]
    K_plus = sp.diag(*[sp.exp(x) for x in gamma]) * K
    K_minus = sp.diag(*[sp.exp(-x) for x in gamma]) * K
    # from the gates between the two tokens, not from gamma: e^{g_{i+1} + ... + g_c}, or its reciprocal for i > c
    Gamma = sp.Matrix(C, C, lambda c, i: sp.exp(sum(g[i + 1:c + 1]) - sum(g[c + 1:i + 1])))
    return Identity(
        "the scalar decay factors out of K K^T",
        "(K ⊙ e^{gamma}) (K ⊙ e^{-gamma})^T = (K K^T) ⊙ Gamma with Gamma[c, i] = e^{gamma_c - gamma_i}: "
        "one decay per token pair, one C x C table, and no e^{-gamma} in the kernel.",
        K_plus * K_minus.T,
        (K * K.T).multiply_elementwise(Gamma),
    )
# --8<-- [end:identities]


IDENTITIES = [householder_product_equals_wy_form, ut_transform_solves_the_chunk_system,
              chunk_output_equals_recurrence, chunk_state_update_equals_recurrence, beta_pairings_agree,
              scalar_decay_factors_out]
REFUTED = [mixed_beta_pairing]


def main():
    print_identities(IDENTITIES, REFUTED)


if __name__ == "__main__":
    main()
