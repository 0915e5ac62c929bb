"""What only a chunked form has, for the tests of the chunkwise exercises of stages 1-4.

Outputs alone cannot tell reference B from reference A wrapped in a few lines: both give the same o.
So reference B returns, beside o, quantities of the chunked algorithm (ChunkwiseOutput in
stages/<stage>/reference.py): the state as each chunk starts, each chunk's scores A_qk and, with a
delete term (stages 3 and 4), its WY factors W and U, each a row per token. A token-by-token loop has
the states and forms nothing of the others. Each is checked here against its definition, computed
token by token or entry by entry, with no code of the references:

- chunk_start_states[b, i, h]: S^T of the token recurrence just before chunk i's first token;
- A_qk[b, t, h, j] = sum_d q_t[d] k_s[d] e^{gamma_t[d] - gamma_s[d]} for the chunk's row j = s - start
  with s <= t, zero for s > t and past the chunk's end (gamma: the log gates summed along the chunk);
- U: the delta rule's corrections beta_t (v_t - k_t S^T) over the chunk's tokens from S^T = 0, and
  W: minus the same from S^T = I with v = 0, since the chunk's pseudo-values V_new = U - W S^T are
  affine in its start state S^T.

The gates of every stage enter as one log gate per key channel (B, N, H, d_k): none in stage 1, a
head's in stage 2, a token's in stage 3.
"""

import numpy as np

from stages.common.compare import assert_close

STATE_AXES = ("batch", "chunk", "head", "key channel", "value channel")
SCORE_AXES = ("batch", "token", "head", "key column of the chunk")


def log_gates_per_channel(x, d_k):
    """x.g of any stage as (B, N, H, d_k): zeros without a gate, a head's or a token's repeated over channels."""
    B, N, H, _ = x.q.shape
    if x.g is None:
        return np.zeros((B, N, H, d_k))
    if x.g.ndim == 1:  # stage 2: one per head
        return np.broadcast_to(x.g[None, None, :, None], (B, N, H, d_k)).copy()
    if x.g.ndim == 3:  # stage 3: one per token and head
        return np.repeat(x.g[..., None], d_k, axis=3)
    return x.g.copy()


def _run_tokens(k, v, log_gates, beta, S_T):
    """The recurrence over the rows of one (batch, head): k, log_gates (n, d_k), v (n, d_v), beta (n,)
    or None (linear attention: the write v_t k_t^T, nothing deleted). Returns (S^T after the last row,
    the rows' corrections: beta_t (v_t - k_t S^T) with the delete term, v_t without)."""
    corrections = np.zeros(v.shape)
    for t in range(len(k)):
        S_T = np.exp(log_gates[t])[:, None] * S_T
        corrections[t] = v[t] if beta is None else beta[t] * (v[t] - k[t] @ S_T)
        S_T = S_T + np.outer(k[t], corrections[t])
    return S_T, corrections


def expected_chunk_start_states(x, chunk_size):
    """(B, number of chunks, H, d_k, d_v): S^T as each chunk starts, by the token recurrence."""
    B, N, H, d_k = x.k.shape
    d_v = x.v.shape[3]
    log_gates = log_gates_per_channel(x, d_k)
    starts = range(0, N, chunk_size)
    states = np.zeros((B, len(starts), H, d_k, d_v))
    for b in range(B):
        for h in range(H):
            S_T = np.zeros((d_k, d_v))
            for i, start in enumerate(starts):
                states[b, i, h] = S_T
                rows = slice(start, min(start + chunk_size, N))
                beta = None if x.beta is None else x.beta[b, rows, h]
                S_T, _ = _run_tokens(x.k[b, rows, h], x.v[b, rows, h], log_gates[b, rows, h], beta, S_T)
    return states


def expected_scores(x, chunk_size):
    """(B, N, H, chunk_size): each token's row of its chunk's A_qk, entry by entry."""
    B, N, H, d_k = x.q.shape
    log_gates = log_gates_per_channel(x, d_k)
    scores = np.zeros((B, N, H, chunk_size))
    for t in range(N):
        start = t - t % chunk_size
        for s in range(start, t + 1):
            log_decay = log_gates[:, s + 1:t + 1].sum(axis=1)  # (B, H, d_k): gamma_t - gamma_s, never positive
            scores[:, t, :, s - start] = np.sum(x.q[:, t] * x.k[:, s] * np.exp(log_decay), axis=-1)
    return scores


def expected_wy_factors(x, chunk_size):
    """(W: (B, N, H, d_k), U: (B, N, H, d_v)): each token's rows of its chunk's WY factors, from the
    delta rule's corrections over the chunk (module docstring)."""
    B, N, H, d_k = x.k.shape
    log_gates = log_gates_per_channel(x, d_k)
    W, U = np.zeros((B, N, H, d_k)), np.zeros(x.v.shape)
    for b in range(B):
        for h in range(H):
            for start in range(0, N, chunk_size):
                rows = slice(start, min(start + chunk_size, N))
                K, G, beta = x.k[b, rows, h], log_gates[b, rows, h], x.beta[b, rows, h]
                _, U[b, rows, h] = _run_tokens(K, x.v[b, rows, h], G, beta, np.zeros((d_k, x.v.shape[3])))
                _, minus_W = _run_tokens(K, np.zeros(K.shape), G, beta, np.eye(d_k))
                W[b, rows, h] = -minus_W
    return W, U


def assert_chunk_quantities(result, x, chunk_size):
    """The chunk quantities of `result` (a ChunkwiseOutput: its W and U checked when the stage has a
    delete term, x.beta not None) equal their definitions, computed token by token."""
    __tracebackhide__ = True
    fields = ("o", "chunk_start_states", "A_qk") + (("W", "U") if x.beta is not None else ())
    missing = [name for name in fields if not hasattr(result, name)]
    assert not missing, (f"chunkwise returned a {type(result).__name__}, without {', '.join(missing)}: it returns "
                         f"a ChunkwiseOutput ({', '.join(fields)}), what only the chunked form has beside o")
    hint = " (a token-by-token loop never forms it: reference B is the chunked algorithm)"
    assert_close(result.chunk_start_states, expected_chunk_start_states(x, chunk_size), rel_l2=1e-12,
                 name="chunk_start_states, S^T as each chunk starts", axes=STATE_AXES)
    assert_close(result.A_qk, expected_scores(x, chunk_size), rel_l2=1e-12,
                 name="A_qk, each token's row of its chunk's scores" + hint, axes=SCORE_AXES, chunk_size=chunk_size)
    if x.beta is not None:
        W, U = expected_wy_factors(x, chunk_size)
        assert_close(result.W, W, rel_l2=1e-12, name="W, each token's row of its chunk's W" + hint,
                     chunk_size=chunk_size)
        assert_close(result.U, U, rel_l2=1e-12, name="U, each token's row of its chunk's U" + hint,
                     chunk_size=chunk_size)
