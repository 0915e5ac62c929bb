"""Stage 1 identities, proved with SymPy on symbols of small size.

Symbols: a sequence of N = 4 tokens split into chunks of C = 2, d_k = 2, d_v = 3; q, k, v are rows
of the matrices Q (N x d_k), K (N x d_k), V (N x d_v); S0^T (d_k x d_v) is the state before the
sequence, any value. Kernel layout throughout (S^T), so the recurrence reads
    S_t^T = S_{t-1}^T + k_t^T v_t        o_t = q_t S_t^T        (q_t, k_t, v_t row vectors).

Run `python -m stages.s01_linear_attention.identities` to prove them all.
"""

import sympy as sp

from stages.common.symbolic import Identity, causal_mask, matrix, print_identities

N, C, d_k, d_v = 4, 2, 2, 3


def _symbols():
    return matrix("q", N, d_k), matrix("k", N, d_k), matrix("v", N, d_v), matrix("s", d_k, d_v)


def _recurrence(Q, K, V, S0_T):
    """Outputs (N x d_v) and the final state of the token-by-token recurrence."""
    S_T, outputs = S0_T, []
    for t in range(Q.rows):
        S_T = S_T + K[t, :].T * V[t, :]
        outputs.append(Q[t, :] * S_T)
    return sp.Matrix.vstack(*outputs), S_T


def _chunked(Q, K, V, S0_T, chunk_size):
    """Outputs and final state of the chunked form: O = Q S^T + (Q K^T ⊙ M) V, S^T += K^T V."""
    S_T, outputs = S0_T, []
    mask = causal_mask(chunk_size)
    for start in range(0, Q.rows, chunk_size):
        Qc, Kc, Vc = (X[start:start + chunk_size, :] for X in (Q, K, V))
        outputs.append(Qc * S_T + (Qc * Kc.T).multiply_elementwise(mask) * Vc)
        S_T = S_T + Kc.T * Vc
    return sp.Matrix.vstack(*outputs), S_T


# --8<-- [start:identities]
def chunk_output_equals_recurrence():
    Q, K, V, S0_T = _symbols()
    return Identity(
        "chunked output = recurrence",
        "For every token, Q S^T (inter-chunk) + (Q K^T ⊙ M) V (intra-chunk, M inclusive) equals "
        "q_t S_t^T of the recurrence.",
        _chunked(Q, K, V, S0_T, C)[0],
        _recurrence(Q, K, V, S0_T)[0],
    )


def chunk_state_update_equals_recurrence():
    Q, K, V, S0_T = _symbols()
    return Identity(
        "state across a chunk",
        "After a chunk, S^T + K^T V equals the state the recurrence reaches token by token.",
        _chunked(Q, K, V, S0_T, C)[1],
        _recurrence(Q, K, V, S0_T)[1],
    )


def output_independent_of_block_dv():
    Q, K, V, S0_T = _symbols()
    blocks = [slice(0, 1), slice(1, 3)]  # d_v = 3 split as 1 + 2 columns, one program per block
    per_block = [_chunked(Q, K, V[:, cols], S0_T[:, cols], C)[0] for cols in blocks]
    return Identity(
        "independent of block_dv",
        "Splitting the value columns into blocks, each with its own slice of the state, and "
        "placing the blocks side by side gives the unsplit output.",
        sp.Matrix.hstack(*per_block),
        _chunked(Q, K, V, S0_T, C)[0],
    )
# --8<-- [end:identities]


IDENTITIES = [chunk_output_equals_recurrence, chunk_state_update_equals_recurrence, output_independent_of_block_dv]


def main():
    print_identities(IDENTITIES)


if __name__ == "__main__":
    main()
