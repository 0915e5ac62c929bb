"""A second answer to exercise s01.chunkwise, written apart from the course's: every (batch, head) at
once, each chunk as whole-matrix products, the causal mask by np.tril.

tests/course/test_chunked_answers.py runs the exercise's tests on it (it is laid out like exercises/,
a folder target): a chunked form unlike the course's passes them. Kept out of tests/exercises/, which
the handout ships.
"""

import numpy as np

from stages.common.checks import check_chunking, check_qkv
from stages.s01_linear_attention.reference import ChunkwiseOutput


def chunkwise(q, k, v, chunk_size):
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_chunking(N, d_v, chunk_size)
    starts = list(range(0, N, chunk_size))
    o = np.empty((B, N, H, d_v))
    states = np.empty((B, len(starts), H, d_k, d_v))
    scores = np.zeros((B, N, H, chunk_size))
    state = np.zeros((B, H, d_k, d_v))
    for i, t0 in enumerate(starts):
        t1 = min(t0 + chunk_size, N)
        Q, K, V = (x[:, t0:t1].transpose(0, 2, 1, 3) for x in (q, k, v))  # (B, H, rows, d)
        A = np.tril(Q @ K.transpose(0, 1, 3, 2))
        states[:, i] = state
        o[:, t0:t1] = (Q @ state + A @ V).transpose(0, 2, 1, 3)
        scores[:, t0:t1, :, :t1 - t0] = A.transpose(0, 2, 1, 3)
        state = state + K.transpose(0, 1, 3, 2) @ V
    return ChunkwiseOutput(o, states, scores)
