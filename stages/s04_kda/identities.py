"""Stage 4 identities, proved with SymPy on symbols of small size.

Symbols: one chunk of C = 3 tokens, d_k = 2, d_v = 2; q, k, v are rows of Q, K (C x d_k) and
V (C x d_v); a_{t,d} > 0 is the gate of token t in key channel d, so e^{gamma_r} is the product
a_{1,d} ... a_{r,d} (no logarithm is needed: the exponent split is a statement about products);
beta_t are the write strengths; S0^T (d_k x d_v) is the state before the chunk, any value.
Kernel layout throughout unless a name says "paper": the recurrence reads
    S_t^T = (I - beta_t k_t^T k_t) Diag(a_t) S_{t-1}^T + beta_t k_t^T v_t      o_t = q_t S_t^T
with q_t, k_t, v_t row vectors.

Run `python -m stages.s04_kda.identities` to prove them all, and to refute the placements of Diag(a)
and the pairing of beta that are not identities.
"""

import sympy as sp

from stages.common.symbolic import Identity, causal_mask, matrix, print_identities

C, d_k, d_v = 3, 2, 2


def chunk_symbols():
    """Q, K, V, the gates A (C x d_k, positive), betas (C), S0^T (d_k x d_v)."""
    gates = sp.Matrix(C, d_k, lambda t, d: sp.Symbol(f"a_{t}{d}", positive=True))
    betas = [sp.Symbol(f"beta_{t}", positive=True) for t in range(C)]
    return matrix("q", C, d_k), matrix("k", C, d_k), matrix("v", C, d_v), gates, betas, matrix("s", d_k, d_v)


def _decay_from_start(gates):
    """E[r, d] = e^{gamma_r[d]} = a_{0,d} a_{1,d} ... a_{r,d}: the decay from the chunk start through r."""
    return sp.Matrix(gates.rows, gates.cols, lambda r, d: sp.Mul(*[gates[t, d] for t in range(r + 1)]))


def _decay(gates, r, s, d):
    """e^{gamma_r[d] - gamma_s[d]} = a_{s+1,d} ... a_{r,d} for s <= r, and its reciprocal for s > r:
    the gates between the two tokens, not a ratio of decays from the chunk start."""
    if s <= r:
        return sp.Mul(*[gates[t, d] for t in range(s + 1, r + 1)])
    return 1 / _decay(gates, s, r, d)


def householder(k_row, beta):
    """I - beta k^T k for a row vector k (1 x d_k): the delete term of one token, kernel layout."""
    return sp.eye(k_row.cols) - beta * k_row.T * k_row


def recurrence_form(Q, K, V, gates, betas, S0_T):
    """Outputs (C x d_v) and final state of the token-by-token recurrence, kernel layout."""
    S_T, outputs = S0_T, []
    for t in range(Q.rows):
        S_T = householder(K[t, :], betas[t]) * sp.diag(*gates[t, :]) * S_T + betas[t] * K[t, :].T * V[t, :]
        outputs.append(Q[t, :] * S_T)
    return sp.Matrix.vstack(*outputs), S_T


def _ut_transform(K, E_plus, betas):
    """diag(beta) T with T = (I + L)^{-1}, L[c, i] = beta_i M[c, i], M = strict(K+ K-^T)."""
    K_plus, K_minus = K.multiply_elementwise(E_plus), K.multiply_elementwise(E_plus.applyfunc(lambda x: 1 / x))
    M = (K_plus * K_minus.T).multiply_elementwise(causal_mask(K.rows, include_diagonal=False))
    return sp.diag(*betas) * (sp.eye(K.rows) + M * sp.diag(*betas)).inv()


def chunked_form(Q, K, V, gates, betas, S0_T):
    """Outputs and final state of the chunkwise form: exponent split, UT transform, pseudo-values."""
    E_plus = _decay_from_start(gates)
    E_minus = E_plus.applyfunc(lambda x: 1 / x)
    K_plus, K_minus, Q_plus = (X.multiply_elementwise(E) for X, E in ((K, E_plus), (K, E_minus), (Q, E_plus)))
    A_qk = (Q_plus * K_minus.T).multiply_elementwise(causal_mask(C))
    A_hat = _ut_transform(K, E_plus, betas)
    W, U = A_hat * K_plus, A_hat * V
    V_new = U - W * S0_T
    outputs = Q_plus * S0_T + A_qk * V_new
    decay_to_end = sp.Matrix(C, d_k, lambda r, d: E_plus[C - 1, d] / E_plus[r, d])
    S_T = sp.diag(*E_plus[C - 1, :]) * S0_T + K.multiply_elementwise(decay_to_end).T * V_new
    return outputs, S_T


# --8<-- [start:identities]
def exponent_split():
    _, K, _, gates, _, _ = chunk_symbols()
    E_plus = _decay_from_start(gates)
    direct = sp.Matrix(C, C, lambda c, i: sum(K[c, d] * _decay(gates, c, i, d) * K[i, d] for d in range(d_k)))
    K_plus = K.multiply_elementwise(E_plus)
    K_minus = K.multiply_elementwise(E_plus.applyfunc(lambda x: 1 / x))
    return Identity(
        "exponent split",
        "M[c, i] = (k_c ⊙ e^{gamma_c - gamma_i}) . k_i for every c, i equals (K+ K-^T)[c, i] with "
        "K+ = K ⊙ e^{gamma}, K- = K ⊙ e^{-gamma}: one GEMM instead of C^2 weighted dot products.",
        K_plus * K_minus.T,
        direct,
    )


def dplr_form():
    k, alpha, beta = matrix("k", 1, d_k), _channel_gates(False), sp.Symbol("beta", positive=True)
    D, a, b = sp.diag(*alpha), beta * k, k.multiply_elementwise(alpha)
    return Identity(
        "DPLR form",
        "(I - beta k k^T) Diag(alpha) = D - a b^T with D = Diag(alpha), a = beta k, b = k ⊙ alpha: "
        "KDA's transition is a diagonal-plus-low-rank matrix whose two vectors are both tied to k.",
        householder(k, beta) * D,
        D - a.T * b,
    )


def diag_placement_transposes():
    S_paper, k, alpha, beta = matrix("s", d_v, d_k), matrix("k", 1, d_k), _channel_gates(False), sp.Symbol("beta")
    return Identity(
        "Diag placement, paper vs kernel layout",
        "(S Diag(a) (I - beta k k^T))^T = (I - beta k k^T) Diag(a) S^T: the paper layout's Diag(a) "
        "between S and the Householder factor is the kernel layout's Diag(a) between the factor and S^T.",
        (S_paper * sp.diag(*alpha) * householder(k, beta)).T,
        householder(k, beta) * sp.diag(*alpha) * S_paper.T,
    )


def householder_product_equals_wy_form():
    _, K, _, gates, betas, _ = chunk_symbols()
    transitions = sp.eye(d_k)
    for t in range(C):
        transitions = householder(K[t, :], betas[t]) * sp.diag(*gates[t, :]) * transitions
    E_plus = _decay_from_start(gates)
    W = _ut_transform(K, E_plus, betas) * K.multiply_elementwise(E_plus)
    decay_to_end = sp.Matrix(C, d_k, lambda r, d: E_plus[C - 1, d] / E_plus[r, d])
    return Identity(
        "per-channel WY form",
        "The chunk's product of transitions (I - beta_t k_t^T k_t) Diag(a_t), last token leftmost, "
        "equals Diag(e^{gamma_C}) - (K ⊙ e^{gamma_C - gamma})^T W with W = diag(beta) T (K ⊙ e^{gamma}): "
        "C rank-one updates of a diagonal matrix, packed into one product.",
        transitions,
        sp.diag(*E_plus[C - 1, :]) - K.multiply_elementwise(decay_to_end).T * W,
    )


def chunk_output_equals_recurrence():
    Q, K, V, gates, betas, S0_T = chunk_symbols()
    return Identity(
        "chunked output = recurrence",
        "(Q ⊙ e^{gamma}) S0^T + A_qk V_new with V_new = U - W S0^T, W = diag(beta) T (K ⊙ e^{gamma}), "
        "U = diag(beta) T V, T = (I + L)^{-1}, L[c, i] = beta_i M[c, i], equals q_t S_t^T of the recurrence.",
        chunked_form(Q, K, V, gates, betas, S0_T)[0],
        recurrence_form(Q, K, V, gates, betas, S0_T)[0],
    )


def chunk_state_update_equals_recurrence():
    Q, K, V, gates, betas, S0_T = chunk_symbols()
    return Identity(
        "state across a chunk",
        "Diag(e^{gamma_C}) S0^T + (K ⊙ e^{gamma_C - gamma})^T V_new equals the state the recurrence "
        "reaches after the chunk.",
        chunked_form(Q, K, V, gates, betas, S0_T)[1],
        recurrence_form(Q, K, V, gates, betas, S0_T)[1],
    )


def beta_pairings_agree():
    M = matrix("m", C, C).multiply_elementwise(causal_mask(C, include_diagonal=False))
    betas = sp.diag(*[sp.Symbol(f"beta_{t}", positive=True) for t in range(C)])
    return Identity(
        "the two beta pairings",
        "diag(beta) (I + M diag(beta))^{-1} = (I + diag(beta) M)^{-1} diag(beta): L[c, i] = beta_i M[c, i] "
        "pairs with beta applied after T, L[c, i] = beta_c M[c, i] with beta applied before it.",
        betas * (sp.eye(C) + M * betas).inv(),
        (sp.eye(C) + betas * M).inv() * betas,
    )
# --8<-- [end:identities]


# --8<-- [start:refuted]
def diag_after_householder(equal_channels=False):
    """The decay moved past the Householder factor: S (I - beta k k^T) Diag(a), paper layout."""
    S_paper, k, beta = matrix("s", d_v, d_k), matrix("k", 1, d_k), sp.Symbol("beta")
    alpha = _channel_gates(equal_channels)
    return Identity(
        "Diag(a) after the Householder factor",
        "S (I - beta k k^T) Diag(a) differs from S Diag(a) (I - beta k k^T) unless all alpha_d are equal.",
        S_paper * householder(k, beta) * sp.diag(*alpha),
        S_paper * sp.diag(*alpha) * householder(k, beta),
    )


def diag_before_state(equal_channels=False):
    """The decay applied on the value side: Diag(a) S, paper layout (it runs only when d_v = d_k)."""
    S_paper, k, beta = matrix("s", d_k, d_k), matrix("k", 1, d_k), sp.Symbol("beta")
    alpha = _channel_gates(equal_channels)
    return Identity(
        "Diag(a) before S",
        "Diag(a) S (I - beta k k^T) decays the rows of S (value channels), not its columns (key "
        "channels); with d_v = d_k it runs, and differs unless all alpha_d are equal.",
        sp.diag(*alpha) * S_paper * householder(k, beta),
        S_paper * sp.diag(*alpha) * householder(k, beta),
    )


def mixed_beta_pairing(equal_betas=False):
    """L[c, i] = beta_i M[c, i] with beta applied before T: the mixed pairing."""
    M = matrix("m", C, C).multiply_elementwise(causal_mask(C, include_diagonal=False))
    betas = sp.diag(*[sp.Symbol("beta" if equal_betas else f"beta_{t}", positive=True) for t in range(C)])
    return Identity(
        "beta pairings mixed",
        "(I + M diag(beta))^{-1} diag(beta) differs from diag(beta) (I + M diag(beta))^{-1} unless all "
        "beta_t are equal.",
        (sp.eye(C) + M * betas).inv() * betas,
        betas * (sp.eye(C) + M * betas).inv(),
    )


def _channel_gates(equal):
    """(1 x d_k) gates alpha_d, or one alpha for every channel."""
    return sp.Matrix(1, d_k, lambda _, d: sp.Symbol("alpha" if equal else f"alpha_{d}", positive=True))
# --8<-- [end:refuted]


IDENTITIES = [exponent_split, dplr_form, diag_placement_transposes, householder_product_equals_wy_form,
              chunk_output_equals_recurrence, chunk_state_update_equals_recurrence, beta_pairings_agree]
REFUTED = [diag_after_householder, diag_before_state, mixed_beta_pairing]


def main():
    print_identities(IDENTITIES, REFUTED)


if __name__ == "__main__":
    main()
