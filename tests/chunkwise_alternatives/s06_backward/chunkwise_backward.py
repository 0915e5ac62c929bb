"""A second answer to exercise s06.chunkwise_backward, written apart from the course's: every (batch,
head) at once, the scores through one (rows, rows, d_k) decay tensor that is zero where no decay is
defined, the UT transform and its adjoint by np.linalg.solve, and the score gradients as einsums.

tests/course/test_chunked_answers.py runs the exercise's tests on it (it is laid out like exercises/,
a folder target): a chunked backward unlike the course's passes them. Kept out of tests/exercises/,
which the handout ships.
"""

import numpy as np

from stages.common.checks import check_chunking
from stages.s06_backward.reference import ChunkwiseGradients, check_gradient_inputs


def _t(x):
    """The last two axes swapped."""
    return np.swapaxes(x, -1, -2)


def _forward(Q, K, V, G, beta, state):
    """One chunk's forward for every (batch, head): Q, K, G (B, H, n, d_k), V (B, H, n, d_v), beta (B, H, n),
    S^T (B, H, d_k, d_v). Returns a dict of what its backward reads, and the state after the chunk."""
    n = Q.shape[2]
    gamma = np.cumsum(G, axis=2)
    lower = np.tril(np.ones((n, n), dtype=bool))
    decay = np.exp(np.where(lower[..., None], gamma[:, :, :, None, :] - gamma[:, :, None, :, :], -np.inf))
    A_qk = np.einsum("bhcd,bhid,bhcid->bhci", Q, K, decay)
    M = np.tril(np.einsum("bhcd,bhid,bhcid->bhci", K, K, decay), -1)
    system = np.eye(n) + M * beta[:, :, None, :]
    K_start, K_end = K * np.exp(gamma), K * np.exp(gamma[:, :, -1:] - gamma)
    solved_K, solved_V = np.linalg.solve(system, K_start), np.linalg.solve(system, V)  # T (K ⊙ e^gamma), T V
    W, U = beta[..., None] * solved_K, beta[..., None] * solved_V
    V_new = U - W @ state
    O = (Q * np.exp(gamma)) @ state + A_qk @ V_new
    after = np.exp(gamma[:, :, -1])[..., None] * state + _t(K_end) @ V_new
    return dict(gamma=gamma, decay=decay, A_qk=A_qk, M=M, system=system, K_start=K_start, K_end=K_end,
                solved_K=solved_K, solved_V=solved_V, W=W, V_new=V_new, state=state), O, after


def _backward(Q, K, V, beta, dO, d_after, f):
    """One chunk's gradients from dO (B, H, n, d_v) and dLoss/dS'^T (B, H, d_k, d_v). Returns
    (dQ, dK, dV, dG, dbeta, dS^T, dA_qk, dM)."""
    gamma, state = f["gamma"], f["state"]
    dV_new = _t(f["A_qk"]) @ dO + f["K_end"] @ d_after
    dA_qk = np.tril(dO @ _t(f["V_new"]))
    d_state = np.exp(gamma[:, :, -1])[..., None] * d_after + _t(Q * np.exp(gamma)) @ dO - _t(f["W"]) @ dV_new
    dQ_start, dK_end = dO @ _t(state), f["V_new"] @ _t(d_after)
    dgamma = dQ_start * Q * np.exp(gamma) - dK_end * f["K_end"]
    dgamma[:, :, -1] += (dK_end * f["K_end"]).sum(axis=2) + np.exp(gamma[:, :, -1]) * (state * d_after).sum(axis=-1)
    dQ, dK = dQ_start * np.exp(gamma), dK_end * np.exp(gamma[:, :, -1:] - gamma)
    # W = beta ⊙ T (K ⊙ e^gamma) and U = beta ⊙ T V, with dW = -dV_new S and dU = dV_new
    dW, dU = -dV_new @ _t(state), dV_new
    dbeta = (dW * f["solved_K"]).sum(-1) + (dU * f["solved_V"]).sum(-1)
    adjoint_K = np.linalg.solve(_t(f["system"]), beta[..., None] * dW)  # T^T (beta ⊙ dW)
    adjoint_V = np.linalg.solve(_t(f["system"]), beta[..., None] * dU)
    dV = adjoint_V
    dK += adjoint_K * np.exp(gamma)  # through K ⊙ e^gamma
    dgamma += adjoint_K * f["K_start"]
    # T = (I + L)^{-1}: dL = -T^T dT T^T, dT = (beta ⊙ dX) X_in^T; only L's strict lower triangle is free
    dL = -(adjoint_K @ _t(f["solved_K"]) + adjoint_V @ _t(f["solved_V"]))
    dL = np.tril(dL, -1)
    dM = dL * beta[:, :, None, :]
    dbeta += (dL * f["M"]).sum(axis=2)
    # the scores, sums over d of x_c[d] k_i[d] e^{gamma_c[d] - gamma_i[d]}
    decay = f["decay"]
    for d_scores, X in ((dA_qk, Q), (dM, K)):
        weighted = d_scores[..., None] * decay  # (B, H, c, i, d_k)
        d_row = np.einsum("bhcid,bhid->bhcd", weighted, K)
        d_col = np.einsum("bhcid,bhcd->bhid", weighted, X)
        if X is Q:
            dQ += d_row
        else:
            dK += d_row
        dK += d_col
        dgamma += d_row * X - d_col * K
    dG = np.flip(np.cumsum(np.flip(dgamma, axis=2), axis=2), axis=2)
    return dQ, dK, dV, dG, dbeta, d_state, dA_qk, dM


def chunkwise_backward(q, k, v, g, beta, do, chunk_size, initial_state=None, d_final_state=None):
    B, N, H, d_k, d_v = check_gradient_inputs(q, k, v, g, beta, do, initial_state, d_final_state)
    check_chunking(N, d_v, chunk_size)
    per_head = [x.transpose(0, 2, 1, 3) for x in (q, k, v, g, do)]  # (B, H, N, d)
    beta_h = beta.transpose(0, 2, 1)
    state = np.zeros((B, H, d_k, d_v)) if initial_state is None else initial_state.copy()
    chunks, kept, o = [], [], np.empty((B, H, N, d_v))
    for t0 in range(0, N, chunk_size):
        rows = slice(t0, min(t0 + chunk_size, N))
        f, o[:, :, rows], state = _forward(*(x[:, :, rows] for x in per_head[:4]), beta_h[:, :, rows], state)
        chunks.append(rows)
        kept.append(f)
    final_state = state
    grads = {name: np.zeros((B, H, N, d)) for name, d in (("dq", d_k), ("dk", d_k), ("dv", d_v), ("dg", d_k))}
    dbeta = np.zeros((B, H, N))
    scores = {name: np.zeros((B, H, N, chunk_size)) for name in ("dA_qk", "dM")}
    d_state = np.zeros((B, H, d_k, d_v)) if d_final_state is None else d_final_state.copy()
    for rows, f in reversed(list(zip(chunks, kept))):
        Q, K, V, _, dO = (x[:, :, rows] for x in per_head)
        dQ, dK, dV, dG, dbeta_c, d_state, dA_qk, dM = _backward(Q, K, V, beta_h[:, :, rows], dO, d_state, f)
        for name, value in zip(("dq", "dk", "dv", "dg"), (dQ, dK, dV, dG)):
            grads[name][:, :, rows] = value
        dbeta[:, :, rows] = dbeta_c
        n = rows.stop - rows.start
        scores["dA_qk"][:, :, rows, :n], scores["dM"][:, :, rows, :n] = dA_qk, dM
    tokens_first = {name: value.transpose(0, 2, 1, 3) for name, value in {**grads, **scores}.items()}
    return ChunkwiseGradients(tokens_first["dq"], tokens_first["dk"], tokens_first["dv"], tokens_first["dg"],
                              dbeta.transpose(0, 2, 1), d_state, o.transpose(0, 2, 1, 3), final_state,
                              tokens_first["dA_qk"], tokens_first["dM"])
