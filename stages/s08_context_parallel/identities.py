"""Stage 8 identities, proved with SymPy on symbols of small size: splitting the recurrence over ranks.

Symbols and layout are stage 4's (stages/s04_kda/identities.py, whose chunk form this module reuses):
kernel layout, q_t, k_t, v_t row vectors, a_{t,d} > 0 the gate of token t in key channel d, beta_t the
write strengths, and

    S_t^T = F_t S_{t-1}^T + beta_t k_t^T v_t,   F_t = (I - beta_t k_t^T k_t) Diag(a_t),   o_t = q_t S_t^T.

A rank's tokens are those of stage 4's chunk (C = 3, d_k = d_v = 2) unless said otherwise; s^T (d_k x
d_v) is the state the rank starts from, S_in^T, any value; A = F_C ... F_1 is the rank's map. The
gradient identity reads as stage 6's do: for the loss <dO, O> + <dS_out^T, S_out^T>, the derivative by
`sp.diff` with respect to every entry of S_in^T equals the formula.

Run `python -m stages.s08_context_parallel.identities` to prove them all, and to refute the mistakes.
"""

import sympy as sp

from stages.common.symbolic import Identity, matrix, print_identities
from stages.s04_kda import identities as stage4

C, d_k, d_v = stage4.C, stage4.d_k, stage4.d_v


def _rank_map(K, gates, betas, tokens):
    """F_t ... F_1 over the given token indices: the later token on the left."""
    A = sp.eye(d_k)
    for t in tokens:
        A = stage4.householder(K[t, :], betas[t]) * sp.diag(*gates[t, :]) * A
    return A


def _zero():
    return sp.zeros(d_k, d_v)


# --8<-- [start:identities]
def rank_is_an_affine_map():
    Q, K, V, gates, betas, S_in = stage4.chunk_symbols()
    return Identity(
        "a rank is an affine map",
        "The state after a rank's tokens from S_in^T is A S_in^T + (the state after them from zero), "
        "A = F_C ... F_1: the incoming state enters through one d_k x d_k map.",
        stage4.recurrence_form(Q, K, V, gates, betas, S_in)[1],
        _rank_map(K, gates, betas, range(C)) * S_in + stage4.recurrence_form(Q, K, V, gates, betas, _zero())[1],
    )


def output_correction():
    Q, K, V, gates, betas, S_in = stage4.chunk_symbols()
    carried = sp.Matrix.vstack(*[Q[t, :] * _rank_map(K, gates, betas, range(t + 1)) * S_in for t in range(C)])
    return Identity(
        "the output correction",
        "o_t from S_in^T minus o_t from zero is q_t (F_t ... F_1) S_in^T: the incoming state carried to "
        "token t, read by q_t.",
        stage4.recurrence_form(Q, K, V, gates, betas, S_in)[0] - stage4.recurrence_form(Q, K, V, gates, betas, _zero())[0],
        carried,
    )


def correction_in_chunk_form():
    Q, K, _, gates, betas, S_in = stage4.chunk_symbols()
    carried = sp.Matrix.vstack(*[Q[t, :] * _rank_map(K, gates, betas, range(t + 1)) * S_in for t in range(C)])
    return Identity(
        "the correction in chunk form",
        "Stage 5's chunk step with the values removed (U = 0), (Q ⊙ e^{gamma}) S_in^T + A_qk (-W S_in^T), "
        "is the carried state read by each query: the correction needs the rank's per-token tensors, "
        "no d_k x d_k map.",
        stage4.chunked_form(Q, K, sp.zeros(C, d_v), gates, betas, S_in)[0],
        carried,
    )


def ranks_compose():
    Q, K, V, gates, betas, S_in = stage4.chunk_symbols()
    earlier, later = range(2), range(2, C)
    A_e, A_l = _rank_map(K, gates, betas, earlier), _rank_map(K, gates, betas, later)
    Z_e = stage4.recurrence_form(Q[:2, :], K[:2, :], V[:2, :], gates[:2, :], betas[:2], _zero())[1]
    Z_l = stage4.recurrence_form(Q[2:, :], K[2:, :], V[2:, :], gates[2:, :], betas[2:], _zero())[1]
    return Identity(
        "two ranks compose into one",
        "Tokens 1-2 on one rank and token 3 on the next: the composed map (A_l A_e, A_l Z_e + Z_l) carries "
        "S_in^T to the state one rank holding all three tokens reaches.",
        (A_l * A_e) * S_in + (A_l * Z_e + Z_l),
        stage4.recurrence_form(Q, K, V, gates, betas, S_in)[1],
    )


def composition_is_associative():
    maps = [(matrix(f"a{r}", d_k, d_k), matrix(f"z{r}", d_k, d_v)) for r in range(3)]
    return Identity(
        "composition is associative",
        "Composing three ranks' maps in either grouping gives the same map: a scan may group the ranks "
        "as its rounds do.",
        _flat(*_compose(_compose(maps[0], maps[1]), maps[2])),
        _flat(*_compose(maps[0], _compose(maps[1], maps[2]))),
    )


def incoming_state_gradient():
    Q, K, V, gates, betas, S_in = stage4.chunk_symbols()
    dO, dS_out = matrix("do", C, d_v), matrix("dsout", d_k, d_v)
    O, S_out = stage4.recurrence_form(Q, K, V, gates, betas, S_in)
    loss = sum(dO.multiply_elementwise(O)) + sum(dS_out.multiply_elementwise(S_out))
    through_outputs = sum((_rank_map(K, gates, betas, range(t + 1)).T * Q[t, :].T * dO[t, :] for t in range(C)),
                          _zero())
    return Identity(
        "the incoming state's gradient",
        "dL/dS_in^T = A^T dS_out^T + sum_t (F_t ... F_1)^T q_t^T do_t: the gradient of the state handed on, "
        "passed back through A^T, plus the gradient through the rank's own outputs.",
        S_in.applyfunc(lambda s: sp.diff(loss, s)),
        _rank_map(K, gates, betas, range(C)).T * dS_out + through_outputs,
    )
# --8<-- [end:identities]


def _compose(earlier, later):
    (A_e, Z_e), (A_l, Z_l) = earlier, later
    return A_l * A_e, A_l * Z_e + Z_l


def _flat(*matrices):
    return sp.Matrix([[entry for M in matrices for entry in M]])


# --8<-- [start:refuted]
def handed_on_without_the_map(identity_map=False):
    """S_in^T + Z: the incoming state added, not carried. a = 1 and beta = 0 (A = I) hide it."""
    Q, K, V, gates, betas, S_in = stage4.chunk_symbols()
    return _where(Identity(
        "handed on without the map",
        "S_in^T + Z differs from the state after the rank unless A = I (every a = 1, every beta = 0).",
        S_in + stage4.recurrence_form(Q, K, V, gates, betas, _zero())[1],
        stage4.recurrence_form(Q, K, V, gates, betas, S_in)[1],
    ), (gates, 1), (sp.Matrix(betas), 0), hidden=identity_map)


def map_of_the_paper_layout(symmetric=False):
    """A^T S_in^T + Z: the paper layout's map in the kernel layout. One token with one gate for every
    channel (a symmetric F) hides it."""
    Q, K, V, gates, betas, S_in = stage4.chunk_symbols()
    tokens = 1 if symmetric else C
    Q, K, V, gates, betas = Q[:tokens, :], K[:tokens, :], V[:tokens, :], gates[:tokens, :], betas[:tokens]
    if symmetric:
        gates = sp.Matrix(1, d_k, lambda _, d: sp.Symbol("a", positive=True))
    return Identity(
        "the map of the paper layout",
        "A^T S_in^T + Z differs from the state after the rank unless A is symmetric (one token, one gate "
        "for every channel).",
        _rank_map(K, gates, betas, range(tokens)).T * S_in + stage4.recurrence_form(Q, K, V, gates, betas, _zero())[1],
        stage4.recurrence_form(Q, K, V, gates, betas, S_in)[1],
    )


def correction_without_the_carry(unchanged=False):
    """q_t S_in^T: the incoming state read as it came, not carried to t. a = 1, beta = 0 hide it."""
    Q, K, V, gates, betas, S_in = stage4.chunk_symbols()
    return _where(Identity(
        "correction without the carry",
        "q_t S_in^T differs from what S_in^T adds to o_t unless the tokens leave the state as it was.",
        Q * S_in,
        stage4.recurrence_form(Q, K, V, gates, betas, S_in)[0] - stage4.recurrence_form(Q, K, V, gates, betas, _zero())[0],
    ), (gates, 1), (sp.Matrix(betas), 0), hidden=unchanged)


def maps_composed_in_the_wrong_order(commuting=False):
    """(A_e A_l, A_e Z_l + Z_e): the later rank's map applied first. beta = 0 (diagonal maps) and no
    values hide it."""
    Q, K, V, gates, betas, S_in = stage4.chunk_symbols()
    if commuting:
        betas, V = [0] * C, sp.zeros(C, d_v)
    A_e, A_l = _rank_map(K, gates, betas, range(2)), _rank_map(K, gates, betas, range(2, C))
    Z_e = stage4.recurrence_form(Q[:2, :], K[:2, :], V[:2, :], gates[:2, :], betas[:2], _zero())[1]
    Z_l = stage4.recurrence_form(Q[2:, :], K[2:, :], V[2:, :], gates[2:, :], betas[2:], _zero())[1]
    return Identity(
        "maps composed in the wrong order",
        "(A_e A_l) S_in^T + A_e Z_l + Z_e differs from the state after both ranks unless the maps commute "
        "and nothing is written (beta = 0).",
        (A_e * A_l) * S_in + (A_e * Z_l + Z_e),
        stage4.recurrence_form(Q, K, V, gates, betas, S_in)[1],
    )


def _where(identity, *substitutions, hidden):
    """The identity on the inputs where a mistake hides: each (symbols, value) pair substituted."""
    if not hidden:
        return identity
    point = {symbol: value for symbols, value in substitutions for symbol in symbols if isinstance(symbol, sp.Symbol)}
    return Identity(identity.name, identity.statement, identity.lhs.subs(point), identity.rhs.subs(point))
# --8<-- [end:refuted]


IDENTITIES = [rank_is_an_affine_map, output_correction, correction_in_chunk_form, ranks_compose,
              composition_is_associative, incoming_state_gradient]
# the common mistakes; those that take an argument hide when it is True
REFUTED = [handed_on_without_the_map, map_of_the_paper_layout, correction_without_the_carry,
           maps_composed_in_the_wrong_order]


def main():
    print_identities(IDENTITIES, REFUTED)


if __name__ == "__main__":
    main()
