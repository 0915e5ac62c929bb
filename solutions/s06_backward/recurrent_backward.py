"""Exercise s06.recurrent_backward (fix): reference A's backward, the reverse-time recurrence of dS.

    S_t = S_{t-1} Diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T        o_t = S_t q_t
                                                             (paper layout: S is d_v x d_k)

The forward runs token by token and keeps every S_t; the backward walks from t = N down to 1
carrying dS_t = dLoss/dS_t, and takes each part of the step back in turn: the output's read of S_t,
the write beta_t v_t k_t^T, the Householder factor, the decay Diag(a_t).

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 6 page, "Reference A: token by token".  Check: course check s06
"""

import numpy as np

from stages.common.checks import Float64Array
from stages.s06_backward.reference import Gradients, check_gradient_inputs  # what the gradients come in; the input checks


def recurrent_backward(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                       do: Float64Array, initial_state: Float64Array | None = None,
                       d_final_state: Float64Array | None = None) -> Gradients:
    """Reference A: the reverse-time recurrence of dS, token by token. State S: (d_v, d_k), the paper layout.

    q, k: (B, N, H, d_k); v, do: (B, N, H, d_v); g = log(a): (B, N, H, d_k); beta: (B, N, H);
    initial_state and d_final_state: S_0^T and dLoss/dS_N^T, (B, H, d_k, d_v) or None for zeros.
    Returns Gradients: dq, dk, dv, dg, dbeta, d_initial_state, then the forward's o and final state.
    """
    B, N, H, d_k, d_v = check_gradient_inputs(q, k, v, g, beta, do, initial_state, d_final_state)
    dq, dk, dg = (np.zeros((B, N, H, d_k)) for _ in range(3))
    dv, o = np.zeros((B, N, H, d_v)), np.zeros((B, N, H, d_v))
    dbeta = np.zeros((B, N, H))
    d_initial_state, final_state = np.zeros((B, H, d_k, d_v)), np.zeros((B, H, d_k, d_v))
    for b in range(B):
        for h in range(H):
            S = np.zeros((d_v, d_k)) if initial_state is None else initial_state[b, h].T.copy()
            states = [S]  # states[t] = S_t
            for t in range(N):  # forward: stage 4's reference A
                k_t, beta_t = k[b, t, h], beta[b, t, h]
                householder = np.eye(d_k) - beta_t * np.outer(k_t, k_t)
                S = S @ np.diag(np.exp(g[b, t, h])) @ householder + beta_t * np.outer(v[b, t, h], k_t)
                o[b, t, h] = S @ q[b, t, h]
                states.append(S)
            final_state[b, h] = S.T
            dS = np.zeros((d_v, d_k)) if d_final_state is None else d_final_state[b, h].T.copy()
            # EXERCISE BEGIN
            for t in reversed(range(N)):  # backward: states[t + 1] = S_t in the math's 1-based time
                q_t, k_t, v_t, beta_t = q[b, t, h], k[b, t, h], v[b, t, h], beta[b, t, h]
                a_t = np.exp(g[b, t, h])
                X = states[t] * a_t[None, :]  # S_{t-1} Diag(a_t): column j scaled by a_t[j]
                dS = dS + np.outer(do[b, t, h], q_t)
                dq[b, t, h] = states[t + 1].T @ do[b, t, h]
                error = v_t - X @ k_t  # what the write adds beyond what the delete removes
                dS_k = dS @ k_t
                dv[b, t, h] = beta_t * dS_k
                dbeta[b, t, h] = error @ dS_k
                dk[b, t, h] = beta_t * (dS.T @ error - X.T @ dS_k)
                dX = dS - beta_t * np.outer(dS_k, k_t)  # dS_t P_t, with no d_k x d_k matrix formed
                dg[b, t, h] = np.sum(X * dX, axis=0)
                dS = dX * a_t[None, :]  # dX_t D_t
            # EXERCISE END
            d_initial_state[b, h] = dS.T
    return Gradients(dq, dk, dv, dg, dbeta, d_initial_state, o, final_state)
