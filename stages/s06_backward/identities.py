"""Stage 6 identities, proved with SymPy on symbols of small size: the gradients the backward uses.

A gradient identity reads: for the scalar loss <dY, Y> = sum of dY ⊙ Y, where Y = F(X) is one
forward step and dY a matrix of free symbols standing for dLoss/dY (whatever comes after the step),
the derivative of the loss with respect to every entry of X, taken by `sp.diff` (the definition),
equals the backward formula. An entry of X that holds a constant (the zero upper triangle and the
diagonal of a strictly lower L) has no derivative: its row of the gradient is zero. Every entry is
compared, at the sizes below, as an identity between expressions in the symbols.

Symbols: s, k, v, q for states, keys, values, queries; g_d for log gates (a_d = e^{g_d}); beta_c
write strengths; m_{ci} the key-key scores A^kk (M in the references); d<name> the gradient that
reaches <name>. Reference A's step is in the paper layout (S is d_v x d_k), the chunk step in the
kernel layout (S^T is d_k x d_v), as in stages/s06_backward/reference.py.

Sizes: the inverse on C = 4, the UT transform on C = 3, the cumulative sum on C = 4, reference A's
step with d_k = 3, d_v = 2, the chunk step on C = 2 with d_k = d_v = 2, the scores on C = 3 with
d_k = 2.

Run `python -m stages.s06_backward.identities` to prove them all, and to refute the common mistakes.
"""

import sympy as sp

from stages.common.symbolic import Identity, causal_mask, matrix, print_identities

C_INVERSE, C_UT, C_CUMSUM = 4, 3, 4
d_k_STEP, d_v_STEP = 3, 2
C_CHUNK, d_k_CHUNK, d_v_CHUNK = 2, 2, 2
C_SCORES, d_k_SCORES = 3, 2


def _inner(dY, Y):
    """<dY, Y>: the sum of dY ⊙ Y, the loss whose gradient is the backward of the step that made Y."""
    return sum(dY.multiply_elementwise(Y))


def _gradient(loss, X):
    """d loss / d X[i, j] for every entry of X, by differentiation; zero where X holds a constant."""
    return X.applyfunc(lambda x: sp.diff(loss, x) if isinstance(x, sp.Symbol) else sp.Integer(0))


def _flat(*matrices):
    """The entries of several matrices in one row: one identity for gradients of different shapes."""
    return sp.Matrix([[entry for M in matrices for entry in M]])


def _strictly_lower(size, name):
    """A size x size matrix of symbols below the diagonal, zeros on and above it."""
    return matrix(name, size, size).multiply_elementwise(causal_mask(size, include_diagonal=False))


def _strict(A):
    """A's strictly lower triangle: i < c."""
    return A.multiply_elementwise(causal_mask(A.rows, include_diagonal=False))


def _row_sums(A):
    return sp.Matrix([sum(A[c, :]) for c in range(A.rows)])


def _column_sums(A):
    return sp.Matrix([sum(A[:, i]) for i in range(A.cols)])


def _ut_symbols():
    """M (strictly lower), the betas as diag(beta), T = (I + M diag(beta))^{-1}, dA_hat, and the
    backward's dL = strict(-T^T dT T^T) with dT = diag(beta) dA_hat."""
    M = _strictly_lower(C_UT, "m")
    betas = sp.diag(*sp.symbols(f"beta0:{C_UT}", positive=True))
    T = (sp.eye(C_UT) + M * betas).inv()
    dA_hat = matrix("dahat", C_UT, C_UT)
    dL = _strict(-T.T * (betas * dA_hat) * T.T)
    return M, betas, T, dA_hat, dL


def _step_symbols(d_k, d_v):
    """Reference A's step, paper layout: S_{t-1} (d_v x d_k), k (d_k x 1), v (d_v x 1), the log gates
    g (d_k), beta, and dS_t."""
    return (matrix("s", d_v, d_k), matrix("k", d_k, 1), matrix("v", d_v, 1), list(sp.symbols(f"g0:{d_k}", real=True)),
            sp.Symbol("beta", positive=True), matrix("ds", d_v, d_k))


def _beta_derivatives(M, betas, T, dA_hat):
    """d<dA_hat, diag(beta) T>/dbeta_c for each c, by differentiation (C x 1)."""
    loss = _inner(dA_hat, betas * T)
    return sp.Matrix([sp.diff(loss, betas[c, c]) for c in range(betas.rows)])


def _cumsum_gradient():
    """dgamma (C x 1 symbols) and the gradient of <dgamma, gamma> with respect to g, gamma_r = g_0 + ... + g_r."""
    g, dgamma = matrix("g", C_CUMSUM, 1), matrix("dgamma", C_CUMSUM, 1)
    gamma = sp.Matrix([sum(g[:r + 1]) for r in range(C_CUMSUM)])
    return dgamma, _gradient(_inner(dgamma, gamma), g)


def _step(S, k, v, g, beta):
    """X_t = S_{t-1} Diag(a_t), P_t = I - beta k k^T, S_t = X_t P_t + beta v k^T."""
    X = S * sp.diag(*[sp.exp(g_d) for g_d in g])
    P = sp.eye(k.rows) - beta * k * k.T
    return X, P, X * P + beta * v * k.T


def _chunk_symbols():
    """The chunk step's operands (kernel layout): S^T (d_k x d_v), W (C x d_k), U (C x d_v),
    Q ⊙ e^gamma, K ⊙ e^{gamma_C - gamma} (C x d_k), A_qk (lower, diagonal included), e^{gamma_C}
    (d_k), and the gradients reaching O (C x d_v) and the next state S'^T (d_k x d_v)."""
    C, d_k, d_v = C_CHUNK, d_k_CHUNK, d_v_CHUNK
    return dict(S_T=matrix("s", d_k, d_v), W=matrix("w", C, d_k), U=matrix("u", C, d_v), Q_decayed=matrix("qd", C, d_k),
                K_to_end=matrix("kd", C, d_k), A_qk=matrix("aqk", C, C).multiply_elementwise(causal_mask(C)),
                chunk_decay=matrix("e", d_k, 1), dO=matrix("do", C, d_v), dS_next_T=matrix("dsn", d_k, d_v))


def _chunk_loss(x):
    """<dO, O> + <dS'^T, S'^T> with V_new = U - W S^T, O = (Q ⊙ e^gamma) S^T + A_qk V_new,
    S'^T = Diag(e^{gamma_C}) S^T + (K ⊙ e^{gamma_C - gamma})^T V_new."""
    V_new = x["U"] - x["W"] * x["S_T"]
    O = x["Q_decayed"] * x["S_T"] + x["A_qk"] * V_new
    S_next_T = sp.diag(*x["chunk_decay"]) * x["S_T"] + x["K_to_end"].T * V_new
    return _inner(x["dO"], O) + _inner(x["dS_next_T"], S_next_T), V_new


# --8<-- [start:identities]
def inverse_gradient():
    L = _strictly_lower(C_INVERSE, "l")
    T = (sp.eye(C_INVERSE) + L).inv()
    dT = matrix("dt", C_INVERSE, C_INVERSE)
    return Identity(
        "gradient of the inverse",
        "T = (I + L)^{-1}, L strictly lower: dL = -T^T dT T^T on the strict lower triangle and 0 on and "
        "above the diagonal (d(T) = -T d(L) T, and <dT, -T E T> = <-T^T dT T^T, E>; L's diagonal and upper "
        "triangle are constants).",
        _gradient(_inner(dT, T), L),
        _strict(-T.T * dT * T.T),
    )


def scores_gradient():
    M, betas, T, dA_hat, dL = _ut_symbols()
    return Identity(
        "gradient to the scores",
        "A_hat = diag(beta) (I + M diag(beta))^{-1}: dM = dL diag(beta), L = M diag(beta) scaling column i "
        "of M by beta_i.",
        _gradient(_inner(dA_hat, betas * T), M),
        dL * betas,
    )


def beta_gradient():
    M, betas, T, dA_hat, dL = _ut_symbols()
    return Identity(
        "beta's two gradients",
        "A_hat = diag(beta) T with T = (I + M diag(beta))^{-1}: dbeta = rowsum(dA_hat ⊙ T) + "
        "colsum(dL ⊙ M), by rows after the solve and by columns inside it.",
        _beta_derivatives(M, betas, T, dA_hat),
        _row_sums(dA_hat.multiply_elementwise(T)) + _column_sums(dL.multiply_elementwise(M)),
    )


def cumsum_adjoint():
    dgamma, cumsum_gradient = _cumsum_gradient()
    return Identity(
        "reverse cumsum = adjoint of cumsum",
        "gamma_r = g_0 + ... + g_r (a lower triangle of ones): dg_s = dgamma_s + dgamma_{s+1} + ... + "
        "dgamma_{C-1}, the upper triangle of ones, a reverse cumulative sum that includes s.",
        cumsum_gradient,
        sp.Matrix([sum(dgamma[s:]) for s in range(C_CUMSUM)]),
    )


def decay_adjoint():
    S, _, _, g, _, dX = _step_symbols(d_k_STEP, d_v_STEP)
    X = S * sp.diag(*[sp.exp(g_d) for g_d in g])
    loss = _inner(dX, X)
    return Identity(
        "the decay's adjoint",
        "X = S Diag(a), a = e^g: dS = dX Diag(a) (columns scaled, as in the forward), and "
        "dg_j = sum_i X[i, j] dX[i, j] (dLoss/da_j times a_j).",
        _flat(_gradient(loss, S), sp.Matrix([[sp.diff(loss, g_d) for g_d in g]])),
        _flat(dX * sp.diag(*[sp.exp(g_d) for g_d in g]), _column_sums(X.multiply_elementwise(dX)).T),
    )


def recurrent_step_gradient():
    S, k, v, g, beta, dS = _step_symbols(d_k_STEP, d_v_STEP)
    X, P, S_next = _step(S, k, v, g, beta)
    loss, error, dS_k = _inner(dS, S_next), v - X * k, dS * k
    return Identity(
        "reverse-time step",
        "S_t = S_{t-1} Diag(a)(I - beta k k^T) + beta v k^T: dS_{t-1} = dS_t P Diag(a), dv = beta dS_t k, "
        "dbeta = (v - X k)^T dS_t k, dk = beta [dS_t^T (v - X k) - X^T dS_t k], dg = colsum(X ⊙ dS_t P): "
        "reference A's backward step.",
        _flat(_gradient(loss, S), _gradient(loss, v), sp.Matrix([sp.diff(loss, beta)]), _gradient(loss, k),
              sp.Matrix([[sp.diff(loss, g_d) for g_d in g]])),
        _flat(dS * P * sp.diag(*[sp.exp(g_d) for g_d in g]), beta * dS_k, error.T * dS_k,
              beta * (dS.T * error - X.T * dS_k), _column_sums(X.multiply_elementwise(dS * P)).T),
    )


def chunk_step_gradient():
    x = _chunk_symbols()
    loss, V_new = _chunk_loss(x)
    dV_new = x["K_to_end"] * x["dS_next_T"] + x["A_qk"].T * x["dO"]
    return Identity(
        "the chunk step's gradients",
        "V_new = U - W S^T, O = (Q ⊙ e^gamma) S^T + A_qk V_new, S'^T = Diag(e^{gamma_C}) S^T + "
        "(K ⊙ e^{gamma_C - gamma})^T V_new: with dV_new = (K ⊙ e^{gamma_C - gamma}) dS'^T + A_qk^T dO, "
        "dS^T = Diag(e^{gamma_C}) dS'^T + (Q ⊙ e^gamma)^T dO - W^T dV_new, dU = dV_new, dW = -dV_new S, "
        "dA_qk = lower(dO V_new^T), d(Q ⊙ e^gamma) = dO S, d(K ⊙ e^{gamma_C - gamma}) = V_new dS'^T, "
        "d(e^{gamma_C}) = rowsum(S^T ⊙ dS'^T).",
        _flat(*(_gradient(loss, x[name]) for name in
                ("S_T", "U", "W", "A_qk", "Q_decayed", "K_to_end", "chunk_decay"))),
        _flat(sp.diag(*x["chunk_decay"]) * x["dS_next_T"] + x["Q_decayed"].T * x["dO"] - x["W"].T * dV_new,
              dV_new, -dV_new * x["S_T"].T, (x["dO"] * V_new.T).multiply_elementwise(causal_mask(C_CHUNK)),
              x["dO"] * x["S_T"].T, V_new * x["dS_next_T"].T, _row_sums(x["S_T"].multiply_elementwise(x["dS_next_T"]))),
    )


def scores_gate_gradient():
    C, d_k = C_SCORES, d_k_SCORES
    K, gamma, dM = matrix("k", C, d_k), matrix("gamma", C, d_k), matrix("dm", C, C)
    terms = [sp.Matrix(C, C, lambda c, i, d=d: K[c, d] * K[i, d] * sp.exp(gamma[c, d] - gamma[i, d]) if i < c else 0)
             for d in range(d_k)]  # channel d's share of M[c, i]
    M = sum(terms, sp.zeros(C, C))
    weighted = [dM.multiply_elementwise(term) for term in terms]
    return Identity(
        "the scores' gate gradient",
        "M[c, i] = sum_d k_c[d] k_i[d] e^{gamma_c[d] - gamma_i[d]} (i < c): dgamma[r, d] = (row r's sum) - "
        "(column r's sum) of dM ⊙ (channel d's share of M): +gamma_c in the exponent for the row, "
        "-gamma_i for the column.",
        _gradient(_inner(dM, M), gamma),
        sp.Matrix.hstack(*(_row_sums(w) - _column_sums(w) for w in weighted)),
    )
# --8<-- [end:identities]


# --8<-- [start:refuted]
def inverse_gradient_untransposed(orthogonal_keys=False):
    """The transposes forgotten: -T dT T. Orthogonal keys (L = 0, T = I) hide it."""
    L = _strictly_lower(C_INVERSE, "l")
    T, dT = (sp.eye(C_INVERSE) + L).inv(), matrix("dt", C_INVERSE, C_INVERSE)
    return _where(Identity(
        "inverse gradient without transposes",
        "strict(-T dT T) differs from the gradient strict(-T^T dT T^T) unless T = I (L = 0).",
        _strict(-T * dT * T),
        _gradient(_inner(dT, T), L),
    ), L, 0, orthogonal_keys)


def inverse_gradient_unrestricted():
    """-T^T dT T^T kept whole: the diagonal and upper triangle of L are not inputs."""
    L = _strictly_lower(C_INVERSE, "l")
    T, dT = (sp.eye(C_INVERSE) + L).inv(), matrix("dt", C_INVERSE, C_INVERSE)
    return Identity(
        "inverse gradient on the whole matrix",
        "-T^T dT T^T on every entry differs from the gradient, which is zero on and above the diagonal.",
        -T.T * dT * T.T,
        _gradient(_inner(dT, T), L),
    )


def beta_gradient_rows_only(zero_scores=False):
    """One side of diag(beta) forgotten: only A_hat = diag(beta) T's rows. M = 0 hides it."""
    M, betas, T, dA_hat, _ = _ut_symbols()
    return _where(Identity(
        "beta's gradient by rows only",
        "rowsum(dA_hat ⊙ T) alone differs from beta's gradient unless M = 0 (one token per chunk, or "
        "orthogonal keys).",
        _row_sums(dA_hat.multiply_elementwise(T)),
        _beta_derivatives(M, betas, T, dA_hat),
    ), M, 0, zero_scores)


def beta_gradient_columns_as_rows(zero_scores=False):
    """beta inside the solve summed by rows, as if L[c, i] = beta_c M[c, i]. M = 0 hides it."""
    M, betas, T, dA_hat, dL = _ut_symbols()
    return _where(Identity(
        "beta inside the solve taken by rows",
        "rowsum(dA_hat ⊙ T) + rowsum(dL ⊙ M) differs from beta's gradient unless M = 0.",
        _row_sums(dA_hat.multiply_elementwise(T)) + _row_sums(dL.multiply_elementwise(M)),
        _beta_derivatives(M, betas, T, dA_hat),
    ), M, 0, zero_scores)


def cumsum_adjoint_exclusive():
    """The reverse cumulative sum without its own term."""
    dgamma, cumsum_gradient = _cumsum_gradient()
    return Identity(
        "exclusive reverse cumsum",
        "dg_s = dgamma_{s+1} + ... + dgamma_{C-1} differs from the adjoint of the cumulative sum, which "
        "includes dgamma_s.",
        sp.Matrix([sum(dgamma[s + 1:], sp.Integer(0)) for s in range(C_CUMSUM)]),
        cumsum_gradient,
    )


def gate_gradient_without_gate(unit_gates=False):
    """dg from S instead of X = S Diag(a): the factor a of dLoss/dg = a dLoss/da forgotten. g = 0 hides it."""
    S, _, _, g, _, dX = _step_symbols(d_k_STEP, d_v_STEP)
    loss = _inner(dX, S * sp.diag(*[sp.exp(g_d) for g_d in g]))
    return _where(Identity(
        "gate gradient without the gate",
        "colsum(S ⊙ dX) differs from dg = colsum(X ⊙ dX), X = S Diag(a), unless every a = 1 (g = 0).",
        _column_sums(S.multiply_elementwise(dX)).T,
        sp.Matrix([[sp.diff(loss, g_d) for g_d in g]]),
    ), sp.Matrix(g), 0, unit_gates)


def step_adjoints_swapped(equal_gates=False):
    """dS_{t-1} = dS_t Diag(a) P: the decay's adjoint before the Householder factor's. Equal gates hide it."""
    S, k, v, g, beta, dS = _step_symbols(d_k_STEP, d_v_STEP)
    _, P, S_next = _step(S, k, v, g, beta)
    return _where(Identity(
        "decay and Householder adjoints swapped",
        "dS_t Diag(a) P differs from dS_{t-1} = dS_t P Diag(a) unless every channel has the same gate.",
        dS * sp.diag(*[sp.exp(g_d) for g_d in g]) * P,
        _gradient(_inner(dS, S_next), S),
    ), sp.Matrix(g), sp.Symbol("g", real=True), equal_gates)


def chunk_state_gradient_without_pseudo_values(no_write=False):
    """dS^T without its path through V_new = U - W S^T. W = 0 (beta = 0) hides it."""
    x = _chunk_symbols()
    loss, _ = _chunk_loss(x)
    return _where(Identity(
        "state gradient without V_new",
        "Diag(e^{gamma_C}) dS'^T + (Q ⊙ e^gamma)^T dO differs from the state's gradient unless W = 0 "
        "(beta = 0 in the whole chunk).",
        sp.diag(*x["chunk_decay"]) * x["dS_next_T"] + x["Q_decayed"].T * x["dO"],
        _gradient(loss, x["S_T"]),
    ), x["W"], 0, no_write)


def _where(identity, symbols, value, hidden):
    """The identity on the inputs where a mistake hides: every symbol of `symbols` set to `value`."""
    if not hidden:
        return identity
    point = {symbol: value for symbol in symbols if isinstance(symbol, sp.Symbol)}
    return Identity(identity.name, identity.statement, identity.lhs.subs(point), identity.rhs.subs(point))
# --8<-- [end:refuted]


IDENTITIES = [inverse_gradient, scores_gradient, beta_gradient, cumsum_adjoint, decay_adjoint,
              recurrent_step_gradient, chunk_step_gradient, scores_gate_gradient]
# the common mistakes; those that take an argument hide when it is True
REFUTED = [inverse_gradient_untransposed, inverse_gradient_unrestricted, beta_gradient_rows_only,
           beta_gradient_columns_as_rows, cumsum_adjoint_exclusive, gate_gradient_without_gate,
           step_adjoints_swapped, chunk_state_gradient_without_pseudo_values]


def main():
    print_identities(IDENTITIES, REFUTED)


if __name__ == "__main__":
    main()
