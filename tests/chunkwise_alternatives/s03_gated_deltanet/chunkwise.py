"""A second answer to exercise s03.chunkwise, written apart from the course's: every (batch, head) at
once, the token's gate repeated over the key channels and the scores as one einsum over a
(rows, rows, d_k) decay tensor that is zero where no decay is defined (np.where before the exponent),
the UT transform by np.linalg.solve, beta applied after it.

tests/course/test_chunked_answers.py runs the exercise's tests on it (it is laid out like exercises/,
a folder target): a chunked form unlike the course's passes them. Kept out of tests/exercises/, which
the handout ships.
"""

import numpy as np

from stages.common.checks import check_chunking, check_gate_and_beta, check_qkv
from stages.s03_gated_deltanet.reference import ChunkwiseOutput


def chunk_step(Q, K, V, G, beta, state):
    """One chunk for every (batch, head): Q, K, G (B, H, n, d_k), V (B, H, n, d_v), beta (B, H, n), the
    state S^T (B, H, d_k, d_v) as the chunk starts. Returns (O, A_qk, W, U, the state after the chunk)."""
    n = Q.shape[2]
    gamma = np.cumsum(G, axis=2)
    lower = np.tril(np.ones((n, n), dtype=bool))
    gap = gamma[:, :, :, None, :] - gamma[:, :, None, :, :]  # (B, H, c, i, d_k)
    decay = np.exp(np.where(lower[None, None, :, :, None], gap, -np.inf))
    A_qk = np.einsum("bhcd,bhid,bhcid->bhci", Q, K, decay)
    M = np.tril(np.einsum("bhcd,bhid,bhcid->bhci", K, K, decay), -1)
    system = np.eye(n) + M * beta[:, :, None, :]  # I + L, L[c, i] = beta_i M[c, i]
    W = beta[..., None] * np.linalg.solve(system, K * np.exp(gamma))
    U = beta[..., None] * np.linalg.solve(system, V)
    V_new = U - W @ state
    O = (Q * np.exp(gamma)) @ state + A_qk @ V_new
    to_end = np.exp(gamma[:, :, -1:, :] - gamma)
    after = np.exp(gamma[:, :, -1, :])[..., None] * state + (K * to_end).transpose(0, 1, 3, 2) @ V_new
    return O, A_qk, W, U, after


def chunkwise(q, k, v, g, beta, chunk_size):
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="token")
    check_chunking(N, d_v, chunk_size)
    starts = list(range(0, N, chunk_size))
    o, W, U = np.empty((B, N, H, d_v)), np.empty((B, N, H, d_k)), np.empty((B, N, H, d_v))
    states = np.empty((B, len(starts), H, d_k, d_v))
    scores = np.zeros((B, N, H, chunk_size))
    state = np.zeros((B, H, d_k, d_v))
    for i, t0 in enumerate(starts):
        t1 = min(t0 + chunk_size, N)
        Q, K, V, G = (x[:, t0:t1].transpose(0, 2, 1, 3) for x in (q, k, v, np.repeat(g[..., None], d_k, axis=3)))
        states[:, i] = state
        O, A_qk, W_c, U_c, state = chunk_step(Q, K, V, G, beta[:, t0:t1].transpose(0, 2, 1), state)
        o[:, t0:t1], W[:, t0:t1], U[:, t0:t1] = (x.transpose(0, 2, 1, 3) for x in (O, W_c, U_c))
        scores[:, t0:t1, :, :t1 - t0] = A_qk.transpose(0, 2, 1, 3)
    return ChunkwiseOutput(o, states, scores, W, U)
