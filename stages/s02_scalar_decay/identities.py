"""Stage 2 identities, proved with SymPy on symbols of small size.

Symbols: a sequence of N = 4 tokens split into chunks of C = 2, d_k = 2, d_v = 3; q, k, v are rows
of the matrices Q (N x d_k), K (N x d_k), V (N x d_v); S0^T (d_k x d_v) is the state before the
sequence, any value; alpha > 0 is the head's decay, a symbol. Kernel layout throughout (S^T), so
the recurrence reads
    S_t^T = alpha S_{t-1}^T + k_t^T v_t        o_t = q_t S_t^T        (q_t, k_t, v_t row vectors).

Run `python -m stages.s02_scalar_decay.identities` to prove them all.
"""

import sympy as sp

from stages.common.symbolic import Identity, matrix, print_identities

N, C, d_k, d_v = 4, 2, 2, 3
alpha = sp.Symbol("alpha", positive=True)


def _symbols():
    return matrix("q", N, d_k), matrix("k", N, d_k), matrix("v", N, d_v), matrix("s", d_k, d_v)


def _recurrence(Q, K, V, S0_T):
    """Outputs (N x d_v) and the final state of the token-by-token recurrence."""
    S_T, outputs = S0_T, []
    for t in range(Q.rows):
        S_T = alpha * S_T + K[t, :].T * V[t, :]
        outputs.append(Q[t, :] * S_T)
    return sp.Matrix.vstack(*outputs), S_T


def _decay_table(size):
    """Gamma[r, j] = alpha^(r - j) for j <= r, else 0: the ratio form, positions from the chunk start."""
    return sp.Matrix(size, size, lambda r, j: alpha ** (r - j) if j <= r else 0)


def _chunked(Q, K, V, S0_T, chunk_size, state_decay_first=True):
    """Outputs and final state of the decayed chunked form, rows r = 1..C from the chunk start:
        O   = Diag(alpha^r) Q S^T + (Q K^T ⊙ Gamma) V
        S^T = alpha^C S^T + K^T Diag(alpha^(C - r)) V
    state_decay_first=False decays the state after adding the chunk instead (a known bug)."""
    S_T, outputs = S0_T, []
    query_decay = sp.diag(*[alpha ** r for r in range(1, chunk_size + 1)])
    key_decay = sp.diag(*[alpha ** (chunk_size - r) for r in range(1, chunk_size + 1)])
    for start in range(0, Q.rows, chunk_size):
        Qc, Kc, Vc = (X[start:start + chunk_size, :] for X in (Q, K, V))
        outputs.append(query_decay * Qc * S_T + (Qc * Kc.T).multiply_elementwise(_decay_table(chunk_size)) * Vc)
        if state_decay_first:
            S_T = alpha ** chunk_size * S_T + Kc.T * key_decay * Vc
        else:
            S_T = alpha ** chunk_size * (S_T + Kc.T * key_decay * Vc)
    return sp.Matrix.vstack(*outputs), S_T


def _cumulative_products(length):
    """alpha_1 alpha_2 ... alpha_t for t = 1..length, every alpha_t = alpha: counted from the sequence start."""
    products, running = [], sp.Integer(1)
    for _ in range(length):
        running = running * alpha
        products.append(running)
    return products


# --8<-- [start:identities]
def chunk_output_equals_recurrence():
    Q, K, V, S0_T = _symbols()
    return Identity(
        "decayed chunked output = recurrence",
        "For every token, alpha^r Q S^T (inter-chunk) + (Q K^T ⊙ Gamma) V (intra-chunk) equals "
        "q_t S_t^T of the decayed recurrence.",
        _chunked(Q, K, V, S0_T, C)[0],
        _recurrence(Q, K, V, S0_T)[0],
    )


def chunk_state_update_equals_recurrence():
    Q, K, V, S0_T = _symbols()
    return Identity(
        "decayed state across a chunk",
        "After a chunk, alpha^C S^T + K^T Diag(alpha^(C - r)) V equals the state the recurrence "
        "reaches token by token.",
        _chunked(Q, K, V, S0_T, C)[1],
        _recurrence(Q, K, V, S0_T)[1],
    )


def decay_table_depends_on_offset_only():
    start = sp.Symbol("s", integer=True, nonnegative=True)  # where the chunk starts in the sequence
    size = 3
    from_sequence_start = sp.Matrix(
        size, size, lambda i, j: alpha ** (start + i + 1) / alpha ** (start + j + 1) if j <= i else 0)
    return Identity(
        "Gamma depends on i - j only",
        "The ratio of cumulative products alpha^(s+i) / alpha^(s+j), for a chunk that starts at any "
        "token s, is alpha^(i - j): one table serves every chunk.",
        from_sequence_start,
        _decay_table(size),
    )


def chunk_reset_equals_global_cumulative_product():
    Q, K, V, S0_T = _symbols()
    products = _cumulative_products(N)  # P_t = alpha^t, never restarted
    global_form = sp.Matrix.vstack(*[
        products[t] * Q[t, :] * S0_T
        + sum(((products[t] / products[j]) * (Q[t, :] * K[j, :].T)[0, 0] * V[j, :] for j in range(t + 1)),
              sp.zeros(1, d_v))
        for t in range(N)
    ])
    return Identity(
        "per-chunk reset = global cumulative product",
        "The chunked form, whose cumulative decay restarts at every chunk, gives "
        "o_t = P_t q_t S0^T + sum_{j <= t} (P_t / P_j) (q_t . k_j) v_j with P_t = alpha^t counted "
        "from the sequence start.",
        _chunked(Q, K, V, S0_T, C)[0],
        global_form,
    )


def output_independent_of_block_dv():
    Q, K, V, S0_T = _symbols()
    blocks = [slice(0, 1), slice(1, 3)]  # d_v = 3 split as 1 + 2 columns, one program per block
    per_block = [_chunked(Q, K, V[:, cols], S0_T[:, cols], C)[0] for cols in blocks]
    return Identity(
        "independent of block_dv",
        "Splitting the value columns into blocks, each with its own slice of the state, and "
        "placing the blocks side by side gives the unsplit output: decay acts on rows only.",
        sp.Matrix.hstack(*per_block),
        _chunked(Q, K, V, S0_T, C)[0],
    )
# --8<-- [end:identities]


IDENTITIES = [chunk_output_equals_recurrence, chunk_state_update_equals_recurrence,
              decay_table_depends_on_offset_only, chunk_reset_equals_global_cumulative_product,
              output_independent_of_block_dv]


def main():
    print_identities(IDENTITIES)


if __name__ == "__main__":
    main()
