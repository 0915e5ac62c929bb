"""An independent oracle for stage 6's tests: the gradients of KDA by the complex step, sharing no code
with the references.

For an analytic loss f, f(x + i h e_j) = f(x) + i h df/dx_j - h^2 ... , so Im f(x + i h e_j) / h is
df/dx_j with no subtraction of nearby numbers: with h = 1e-30 it is exact to float64 rounding. Every
entry of every input is perturbed at once, each in its own copy along a leading axis P, and the
forward runs once over all copies.
"""

import numpy as np

from stages.common.compare import assert_close
from stages.common.inputs import make_inputs

STEP = 1e-30


def kda_forward(q, k, v, g, beta, initial_state):
    """KDA in the prediction-error form of the delta rule, over a leading axis P of copies:
        S^T <- Diag(a_t) S^T;   S^T <- S^T + beta_t k_t (v_t - S k_t)^T;   o_t = S q_t
    q, k, g: (P, B, N, H, d_k); v: (P, B, N, H, d_v); beta: (P, B, N, H); initial_state: S_0^T
    (P, B, H, d_k, d_v). Real or complex. Returns (o: (P, B, N, H, d_v), S_N^T: (P, B, H, d_k, d_v))."""
    S_T, outputs = initial_state, []
    for t in range(q.shape[2]):
        S_T = np.exp(g[:, :, t])[..., None] * S_T
        prediction_error = v[:, :, t] - np.einsum("pbhk,pbhkv->pbhv", k[:, :, t], S_T)
        S_T = S_T + beta[:, :, t][..., None, None] * k[:, :, t][..., :, None] * prediction_error[..., None, :]
        outputs.append(np.einsum("pbhk,pbhkv->pbhv", q[:, :, t], S_T))
    return np.stack(outputs, axis=2), S_T


def gradients(q, k, v, g, beta, do, initial_state=None, d_final_state=None):
    """{dq, dk, dv, dg, dbeta, d_initial_state}: the gradients of <do, o> + <d_final_state, S_N^T>,
    shapes as the inputs' (initial_state None: S_0 = 0, its gradient still returned)."""
    B, _, H, d_k = q.shape
    d_v = v.shape[3]
    initial_state = np.zeros((B, H, d_k, d_v)) if initial_state is None else initial_state
    inputs = dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state)
    P = sum(x.size for x in inputs.values())
    copies, first = {}, 0
    for name, x in inputs.items():
        copy = np.broadcast_to(x.astype(np.complex128), (P, *x.shape)).copy()
        flat = copy.reshape(P, -1)
        flat[np.arange(first, first + x.size), np.arange(x.size)] += 1j * STEP  # copy first + j moves entry j
        copies[name], first = copy, first + x.size
    o, final_state = kda_forward(**copies)
    loss = np.einsum("pbnhv,bnhv->p", o, do)
    if d_final_state is not None:
        loss = loss + np.einsum("pbhkv,bhkv->p", final_state, d_final_state)
    derivative = loss.imag / STEP
    result, first = {}, 0
    for name, x in inputs.items():
        result["d_initial_state" if name == "initial_state" else f"d{name}"] = derivative[first:first + x.size].reshape(x.shape)
        first += x.size
    return result


def backward_inputs(B, N, H, d_k, d_v, seed, gate_range=(0.5, 0.999)):
    """Inputs where no gradient term hides: gates down to gate_range[0], beta in [0, 1] with a quarter
    of its entries set to exactly 0 and 1, a random do, S_0 and dLoss/dS_N. Returns
    (inputs from make_inputs, do, initial_state, d_final_state)."""
    x = make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=gate_range, beta_range=(0.0, 1.0), seed=seed)
    rng = np.random.default_rng(seed + 1000)
    flat = x.beta.reshape(-1)
    picked = rng.choice(flat.size, size=max(2, flat.size // 4), replace=False)
    flat[picked[::2]], flat[picked[1::2]] = 0.0, 1.0
    return x, rng.standard_normal((B, N, H, d_v)), rng.standard_normal((B, H, d_k, d_v)), \
        rng.standard_normal((B, H, d_k, d_v))


AXES = {"d_initial_state": ("batch", "head", "key channel", "value channel"),
        "dbeta": ("batch", "token", "head")}


def assert_gradients_close(actual, expected, names, chunk_size=None, rel_l2=1e-12):
    """Each gradient of `names` (actual: {name: array}) within rel_l2 of the oracle's, naming the one
    that is not and where."""
    __tracebackhide__ = True
    for name in names:
        assert_close(actual[name], expected[name], rel_l2=rel_l2, name=name, chunk_size=chunk_size,
                     axes=AXES.get(name, ("batch", "token", "head", "channel")))


def _state_gradient(q, k, v, g, beta, do, state, d_final_state):
    """dLoss/dS^T (B, H, d_k, d_v) for the state S^T = `state` before the tokens of q ... do (the rest of
    the sequence: it may have no token), loss = <do, o> + <d_final_state, S_N^T>, by the complex step."""
    B, H, d_k, d_v = state.shape
    final = np.zeros(state.shape) if d_final_state is None else d_final_state
    if q.shape[1] == 0:
        return final.copy()
    P = state.size
    copies = np.broadcast_to(state.astype(np.complex128), (P, *state.shape)).copy()
    copies.reshape(P, -1)[np.arange(P), np.arange(P)] += 1j * STEP
    inputs = [np.broadcast_to(x, (P, *x.shape)) for x in (q, k, v, g, beta)]
    o, final_state = kda_forward(*inputs, copies)
    loss = np.einsum("pbnhv,bnhv->p", o, do) + np.einsum("pbhkv,bhkv->p", final_state, final)
    return (loss.imag / STEP).reshape(state.shape)


def _state_after(q, k, v, g, beta, initial_state, tokens):
    """S^T (B, H, d_k, d_v) after the first `tokens` tokens, from initial_state."""
    if tokens == 0:
        return initial_state
    return kda_forward(*(x[None, :, :tokens] for x in (q, k, v, g, beta)), initial_state[None])[1][0]


def score_gradients(q, k, v, g, beta, do, chunk_size, initial_state=None, d_final_state=None):
    """{dA_qk, dM}: (B, N, H, chunk_size) each, token t's row of dLoss/dA_qk and dLoss/dM of its chunk
    (zero past the chunk's end, above A_qk's diagonal and on and above M's), by the complex step through
    one chunk's forward written from its two score matrices, stage 4's reference B:
        T = (I + M diag(beta))^{-1},   V_new = diag(beta) T (V - (K ⊙ e^{gamma}) S^T),
        O = (Q ⊙ e^{gamma}) S^T + A_qk V_new,   S'^T = Diag(e^{gamma_C}) S^T + (K ⊙ e^{gamma_C - gamma})^T V_new,
    with loss = <dO, O> + <dS'^T, S'^T>: S^T the state as the chunk starts (kda_forward over the tokens
    before it) and dS'^T the gradient reaching the state after it (the complex step over the tokens after it)."""
    B, N, H, d_k = q.shape
    d_v = v.shape[3]
    initial_state = np.zeros((B, H, d_k, d_v)) if initial_state is None else initial_state
    result = {"dA_qk": np.zeros((B, N, H, chunk_size)), "dM": np.zeros((B, N, H, chunk_size))}
    for start in range(0, N, chunk_size):
        end = min(start + chunk_size, N)
        S_T, S_end_T = (_state_after(q, k, v, g, beta, initial_state, tokens) for tokens in (start, end))
        dS_end_T = _state_gradient(*(x[:, end:] for x in (q, k, v, g, beta, do)), S_end_T, d_final_state)
        C = end - start
        lower, strict = np.tril_indices(C), np.tril_indices(C, -1)
        for b in range(B):
            for h in range(H):
                Q, K, V, dO = (x[b, start:end, h] for x in (q, k, v, do))
                beta_c, gamma = beta[b, start:end, h], np.cumsum(g[b, start:end, h], axis=0)
                M = np.zeros((C, C))
                A_qk = np.zeros((C, C))
                for c in range(C):
                    for i in range(c + 1):
                        decay = np.exp(gamma[c] - gamma[i])
                        A_qk[c, i] = (Q[c] * decay) @ K[i]
                        M[c, i] = (K[c] * decay) @ K[i] if i < c else 0.0
                P = len(lower[0]) + len(strict[0])
                A_copies = np.broadcast_to(A_qk.astype(np.complex128), (P, C, C)).copy()
                M_copies = np.broadcast_to(M.astype(np.complex128), (P, C, C)).copy()
                n_lower = len(lower[0])
                A_copies[np.arange(n_lower), lower[0], lower[1]] += 1j * STEP
                M_copies[n_lower + np.arange(len(strict[0])), strict[0], strict[1]] += 1j * STEP
                T = np.linalg.inv(np.eye(C) + M_copies * beta_c[None, None, :])
                V_new = beta_c[None, :, None] * (T @ (V - (K * np.exp(gamma)) @ S_T[b, h]))
                O = (Q * np.exp(gamma)) @ S_T[b, h] + A_copies @ V_new
                S_after = np.exp(gamma[-1])[:, None] * S_T[b, h] + (K * np.exp(gamma[-1] - gamma)).T @ V_new
                loss = np.einsum("pcv,cv->p", O, dO) + np.einsum("pkv,kv->p", S_after, dS_end_T[b, h])
                derivative = loss.imag / STEP
                dA_qk, dM = np.zeros((C, C)), np.zeros((C, C))
                dA_qk[lower] = derivative[:n_lower]
                dM[strict] = derivative[n_lower:]
                result["dA_qk"][b, start:end, h, :C] = dA_qk
                result["dM"][b, start:end, h, :C] = dM
    return result
