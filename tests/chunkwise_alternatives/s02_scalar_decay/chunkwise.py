"""A second answer to exercise s02.chunkwise, written apart from the course's: every (batch, head) at
once, the decay table built from the log gates with np.where (no exponent above the diagonal), each
chunk as whole-matrix products.

tests/course/test_chunked_answers.py runs the exercise's tests on it (it is laid out like exercises/,
a folder target): a chunked form unlike the course's passes them. Kept out of tests/exercises/, which
the handout ships.
"""

import numpy as np

from stages.common.checks import check_chunking, check_gate, check_qkv
from stages.s02_scalar_decay.reference import ChunkwiseOutput


def chunkwise(q, k, v, g, chunk_size):
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate(g, B, N, H, d_k, gate="head")
    check_chunking(N, d_v, chunk_size)
    starts = list(range(0, N, chunk_size))
    o = np.empty((B, N, H, d_v))
    states = np.empty((B, len(starts), H, d_k, d_v))
    scores = np.zeros((B, N, H, chunk_size))
    state = np.zeros((B, H, d_k, d_v))
    for i, t0 in enumerate(starts):
        t1 = min(t0 + chunk_size, N)
        n = t1 - t0
        Q, K, V = (x[:, t0:t1].transpose(0, 2, 1, 3) for x in (q, k, v))  # (B, H, n, d)
        log_decay = g[:, None] * np.arange(1, n + 1)[None, :]  # (H, n): log alpha^r from the chunk start
        causal = np.tril(np.ones((n, n), dtype=bool))
        gap = np.where(causal, log_decay[:, :, None] - log_decay[:, None, :], -np.inf)  # (H, n, n)
        A = (Q @ K.transpose(0, 1, 3, 2)) * np.exp(gap)
        states[:, i] = state
        inter = np.exp(log_decay)[None, :, :, None] * (Q @ state)
        o[:, t0:t1] = (inter + A @ V).transpose(0, 2, 1, 3)
        scores[:, t0:t1, :, :n] = A.transpose(0, 2, 1, 3)
        to_end = np.exp(log_decay[:, -1:] - log_decay)  # (H, n)
        state = np.exp(log_decay[:, -1])[None, :, None, None] * state \
            + (K * to_end[None, :, :, None]).transpose(0, 1, 3, 2) @ V
    return ChunkwiseOutput(o, states, scores)
