"""Stage 6 references in NumPy float64: the gradients of KDA, token by token and chunk by chunk.

    S_t = S_{t-1} Diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T        o_t = S_t q_t
                                                             (paper layout: S is d_v x d_k)

The forward pass is stage 4's, with an initial state S_0 and the final state S_N as an output.
Given do = dLoss/do (B, N, H, d_v) and, optionally, dLoss/dS_N, each function returns the gradients
of the loss with respect to q, k (B, N, H, d_k), v (B, N, H, d_v), the log gates g = log a
(B, N, H, d_k), beta (B, N, H) and S_0. Both states, and their gradients, are passed as S^T in the
kernel layout, (B, H, d_k, d_v), the layout of stage 5's `initial_state` and FLA's.

- `recurrent_backward` (A) runs the recurrence forward, keeping every S_t, then walks back in time
  carrying dS_t = dLoss/dS_t (paper layout, d_v x d_k).
- `chunkwise_backward` (B) runs stage 4's reference B forward, keeping the state at every chunk
  start (S^T, the kernel layout), then walks back over the chunks carrying dS^T, and inside a chunk
  takes every forward step of reference B backwards: the state update, the output, V_new, the WY
  factors, the UT transform, the scores M and A_qk, and last the cumulative gate gamma. Beside the
  gradients it returns those of every chunk's scores A_qk and M (ChunkwiseGradients), which only a
  chunked backward forms.
- `kernel_mirror_backward` (C) is the backward kernels' control flow (stages/kda/backward.py),
  split as stage 5's forward is: stage 5's `prepare` again, then `chunk_states` (the forward's state
  loop, writing S^T at every chunk start and V_new), `state_gradients` (the reverse chunk loop
  carrying dS^T), `state_products` (everything of a chunk that sums over d_v: the GEMMs with S and
  dS) and `intra_gradients` (one chunk's gradients through the UT transform and the scores).
"""

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from stages.common.checks import (Float64Array, check_chunking, check_gate_and_beta, check_output_gradient, check_qkv,
                                  check_state, padded_length)
from stages.s05_fast_kda.reference import SUB_BLOCK, ChunkTensors, block_inverse, intra_chunk_scores, prepare


class Gradients(NamedTuple):
    """What a backward reference returns: the gradients, then the forward's o and final state."""

    dq: Float64Array  # (B, N, H, d_k)
    dk: Float64Array  # (B, N, H, d_k)
    dv: Float64Array  # (B, N, H, d_v)
    dg: Float64Array  # (B, N, H, d_k)
    dbeta: Float64Array  # (B, N, H)
    d_initial_state: Float64Array  # (B, H, d_k, d_v), S^T layout
    o: Float64Array  # (B, N, H, d_v), the forward's output
    final_state: Float64Array  # (B, H, d_k, d_v), S_N^T


def check_gradient_inputs(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                          do: Float64Array, initial_state: Float64Array | None,
                          d_final_state: Float64Array | None) -> tuple[int, int, int, int, int]:
    """The inputs of a backward reference, as the forward's (stages.common.checks: float64 arrays, finite,
    g <= 0, beta in [0, 1]) and do (B, N, H, d_v), initial_state and d_final_state (B, H, d_k, d_v) or
    None. Returns (B, N, H, d_k, d_v)."""
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="channel")
    check_output_gradient(do, B, N, H, d_v)
    check_state("initial_state", initial_state, B, H, d_k, d_v)
    check_state("d_final_state", d_final_state, B, H, d_k, d_v)
    return B, N, H, d_k, d_v


# --8<-- [start:recurrent_backward]
def recurrent_backward(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                       do: Float64Array, initial_state: Float64Array | None = None,
                       d_final_state: Float64Array | None = None) -> Gradients:
    """Reference A: the reverse-time recurrence of dS, token by token. State S: (d_v, d_k), the paper layout.

    Write the step in three parts, X_t = S_{t-1} D_t (D_t = Diag(a_t), a_t = e^{g_t}),
    P_t = I - beta_t k_t k_t^T (symmetric), S_t = X_t P_t + beta_t v_t k_t^T, and o_t = S_t q_t.
    Start from dS_N = (d_final_state^T, or 0) and, for t = N, ..., 1:

        dS_t   += do_t q_t^T                              o_t = S_t q_t reads S_t
        dq_t    = S_t^T do_t                              ... and q_t
        dv_t    = beta_t dS_t k_t                         the write beta_t v_t k_t^T
        dbeta_t = (v_t - X_t k_t)^T dS_t k_t              the write, and the delete -beta_t X_t k_t k_t^T
        dk_t    = beta_t [dS_t^T (v_t - X_t k_t) - X_t^T dS_t k_t]
                                                          k_t on both sides of the rank-one terms
        dX_t    = dS_t P_t                                through the Householder factor
        dg_t[j] = sum_i X_t[i, j] dX_t[i, j]              dLoss/da_t ⊙ a_t: column j of X_t is a_t[j] S_{t-1}[:, j]
        dS_{t-1} = dX_t D_t                               through the decay

    and d_initial_state = dS_0^T. The forward keeps every S_t (a reference can afford N + 1 states;
    P_t is singular when beta_t ||k_t||^2 = 1, so S_{t-1} cannot be recovered from S_t).
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
            d_initial_state[b, h] = dS.T
    return Gradients(dq, dk, dv, dg, dbeta, d_initial_state, o, final_state)
# --8<-- [end:recurrent_backward]


class ChunkwiseGradients(NamedTuple):
    """What reference B's backward returns: the fields of Gradients, then the gradients of every
    chunk's two score matrices, which a token-by-token backward never forms (FLA's dAqk and dAkk), a
    row per token: token t's row of its chunk's matrix, zero past the chunk's end."""

    dq: Float64Array  # (B, N, H, d_k)
    dk: Float64Array  # (B, N, H, d_k)
    dv: Float64Array  # (B, N, H, d_v)
    dg: Float64Array  # (B, N, H, d_k)
    dbeta: Float64Array  # (B, N, H)
    d_initial_state: Float64Array  # (B, H, d_k, d_v), S^T layout
    o: Float64Array  # (B, N, H, d_v), the forward's output
    final_state: Float64Array  # (B, H, d_k, d_v), S_N^T
    dA_qk: Float64Array  # (B, N, H, C): dLoss/dA_qk, lower with the diagonal
    dM: Float64Array  # (B, N, H, C): dLoss/dM, strictly lower


class _Chunk(NamedTuple):
    """Reference B's forward tensors of one chunk (stage 4's names), recomputed by the backward."""

    gamma: Float64Array  # (C, d_k), cumulative log decay from the chunk start
    M: Float64Array  # (C, C), strictly lower
    T: Float64Array  # (C, C), (I + L)^{-1}
    A_hat: Float64Array  # (C, C), diag(beta) T
    W: Float64Array  # (C, d_k)
    U: Float64Array  # (C, d_v)
    A_qk: Float64Array  # (C, C), lower, diagonal included


def chunk_forward(Q, K, V, G, beta_c):
    """Everything of one chunk that does not read the state, as stage 4's reference B computes it."""
    C = len(Q)
    gamma = np.cumsum(G, axis=0)
    M, A_qk = np.zeros((C, C)), np.zeros((C, C))
    for c in range(C):
        for i in range(c + 1):
            decay = np.exp(gamma[c] - gamma[i])
            M[c, i] = (K[c] * decay) @ K[i] if i < c else 0.0  # strict: i < c
            A_qk[c, i] = (Q[c] * decay) @ K[i]  # inclusive: j <= c
    T = np.linalg.inv(np.eye(C) + M * beta_c[None, :])  # L[c, i] = beta_i M[c, i] ...
    A_hat = beta_c[:, None] * T  # ... pairs with diag(beta) T
    return _Chunk(gamma, M, T, A_hat, A_hat @ (K * np.exp(gamma)), A_hat @ V, A_qk)


# --8<-- [start:chunkwise_backward]
def chunkwise_backward(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                       do: Float64Array, chunk_size: int, initial_state: Float64Array | None = None,
                       d_final_state: Float64Array | None = None) -> ChunkwiseGradients:
    """Reference B: chunk by chunk, in reverse. State S^T: (d_k, d_v), the kernel layout; dS^T likewise.

    The forward of chunk [t] (stage 4's reference B; S^T the state at the chunk start, S'^T after it):
        V_new = U - W S^T,   O = (Q ⊙ e^{gamma}) S^T + A_qk V_new,
        S'^T  = Diag(e^{gamma_C}) S^T + (K ⊙ e^{gamma_C - gamma})^T V_new.
    Backward, given dO and dS'^T, each line the chain rule through one forward line, last line first:

        dV_new  = (K ⊙ e^{gamma_C - gamma}) dS'^T + A_qk^T dO
        dS^T    = Diag(e^{gamma_C}) dS'^T + (Q ⊙ e^{gamma})^T dO - W^T dV_new      (to the chunk before)
        dA_qk   = dO V_new^T (lower, diagonal included),   dW = -dV_new S,   dU = dV_new
        dA_hat  = dW (K ⊙ e^{gamma})^T + dU V^T,   dV = A_hat^T dU,   d(K ⊙ e^{gamma}) = A_hat^T dW
        A_hat = diag(beta) T:    dbeta_c += sum_i dA_hat[c, i] T[c, i],   dT = diag(beta) dA_hat
        T = (I + L)^{-1}:        dL = -T^T dT T^T, kept on the strict lower triangle (where L depends
                                 on the inputs; its diagonal and upper triangle are constants)
        L[c, i] = beta_i M[c, i]: dbeta_i += sum_c dL[c, i] M[c, i],   dM = dL diag(beta)

    beta thus enters twice, by rows after the solve and by columns inside it: the two gradients add.
    M and A_qk are sums over channels d of x_c[d] k_i[d] e^{gamma_c[d] - gamma_i[d]} (x = k or q):
    each entry hands dM[c, i] k_i e^{..} to row c, dM[c, i] k_c e^{..} to row i, and
    +-dM[c, i] k_c k_i e^{..} to dgamma_c and dgamma_i. With the terms of e^{gamma} (Q, K),
    e^{gamma_C - gamma} and e^{gamma_C}, dgamma[r] collects every per-position contribution; since
    gamma[r] = g[0] + ... + g[r], the gate gradient is its reverse cumulative sum:
        dg[s] = dgamma[s] + dgamma[s + 1] + ... + dgamma[C - 1].

    The forward keeps the state at every chunk start; the rest of a chunk is recomputed. Returns the
    gradients with dA_qk and dM of every chunk (ChunkwiseGradients). The last chunk may be shorter
    than chunk_size.
    """
    B, N, H, d_k, d_v = check_gradient_inputs(q, k, v, g, beta, do, initial_state, d_final_state)
    check_chunking(N, d_v, chunk_size)
    dq, dk, dg = (np.zeros((B, N, H, d_k)) for _ in range(3))
    dv, o = np.zeros((B, N, H, d_v)), np.zeros((B, N, H, d_v))
    dbeta = np.zeros((B, N, H))
    d_initial_state, final_state = np.zeros((B, H, d_k, d_v)), np.zeros((B, H, d_k, d_v))
    dA_qk_rows, dM_rows = np.zeros((B, N, H, chunk_size)), np.zeros((B, N, H, chunk_size))  # each token's row
    chunks = [slice(start, min(start + chunk_size, N)) for start in range(0, N, chunk_size)]
    for b in range(B):
        for h in range(H):
            S_T = np.zeros((d_k, d_v)) if initial_state is None else initial_state[b, h].copy()
            chunk_start_states = []
            for rows in chunks:  # forward: stage 4's reference B, keeping S^T at every chunk start
                chunk_start_states.append(S_T)
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h]
                f = chunk_forward(Q, K, V, g[b, rows, h], beta[b, rows, h])
                V_new = f.U - f.W @ S_T
                o[b, rows, h] = (Q * np.exp(f.gamma)) @ S_T + f.A_qk @ V_new
                S_T = np.exp(f.gamma[-1])[:, None] * S_T + (K * np.exp(f.gamma[-1] - f.gamma)).T @ V_new
            final_state[b, h] = S_T

            dS_T = np.zeros((d_k, d_v)) if d_final_state is None else d_final_state[b, h].copy()
            for rows, S_T in reversed(list(zip(chunks, chunk_start_states))):  # backward, last chunk first
                Q, K, V, beta_c, dO = q[b, rows, h], k[b, rows, h], v[b, rows, h], beta[b, rows, h], do[b, rows, h]
                f = chunk_forward(Q, K, V, g[b, rows, h], beta_c)
                C, gamma = len(Q), f.gamma
                decay_to_end = np.exp(gamma[-1] - gamma)  # (C, d_k)
                V_new = f.U - f.W @ S_T
                dQ, dK, dgamma = np.zeros((C, d_k)), np.zeros((C, d_k)), np.zeros((C, d_k))
                dbeta_c = np.zeros(C)

                # S'^T = Diag(e^{gamma_C}) S^T + (K ⊙ e^{gamma_C - gamma})^T V_new
                dV_new = (K * decay_to_end) @ dS_T
                dK_to_end = V_new @ dS_T.T  # d(K ⊙ e^{gamma_C - gamma})
                dK += dK_to_end * decay_to_end
                dgamma -= dK_to_end * K * decay_to_end  # the exponent -gamma[r] ...
                dgamma[-1] += np.sum(dK_to_end * K * decay_to_end, axis=0)  # ... and +gamma_C
                dgamma[-1] += np.exp(gamma[-1]) * np.sum(S_T * dS_T, axis=1)  # Diag(e^{gamma_C}) S^T
                dS_T_before = np.exp(gamma[-1])[:, None] * dS_T

                # O = (Q ⊙ e^{gamma}) S^T + A_qk V_new
                dQ_decayed = dO @ S_T.T
                dQ += dQ_decayed * np.exp(gamma)
                dgamma += dQ_decayed * Q * np.exp(gamma)
                dS_T_before += (Q * np.exp(gamma)).T @ dO
                dA_qk = np.tril(dO @ V_new.T)  # j <= c
                dV_new += f.A_qk.T @ dO

                # V_new = U - W S^T
                dU, dW = dV_new, -dV_new @ S_T.T
                dS_T_before -= f.W.T @ dV_new

                # W = A_hat (K ⊙ e^{gamma}),  U = A_hat V
                dA_hat = dW @ (K * np.exp(gamma)).T + dU @ V.T
                dK_decayed = f.A_hat.T @ dW
                dK += dK_decayed * np.exp(gamma)
                dgamma += dK_decayed * K * np.exp(gamma)
                dv[b, rows, h] = f.A_hat.T @ dU

                # A_hat = diag(beta) T,  T = (I + L)^{-1},  L[c, i] = beta_i M[c, i]
                dbeta_c += np.sum(dA_hat * f.T, axis=1)  # beta by rows, after the solve
                dT = beta_c[:, None] * dA_hat
                dL = np.tril(-f.T.T @ dT @ f.T.T, -1)  # strict: i < c
                dbeta_c += np.sum(dL * f.M, axis=0)  # beta by columns, inside the solve
                dM = dL * beta_c[None, :]
                dA_qk_rows[b, rows, h, :C], dM_rows[b, rows, h, :C] = dA_qk, dM

                # M[c, i] and A_qk[c, j]: plain loops, as the forward computes them
                for c in range(C):
                    for i in range(c + 1):
                        decay = np.exp(gamma[c] - gamma[i])
                        if i < c:
                            dK[c] += dM[c, i] * K[i] * decay
                            dK[i] += dM[c, i] * K[c] * decay
                            dgamma[c] += dM[c, i] * K[c] * K[i] * decay
                            dgamma[i] -= dM[c, i] * K[c] * K[i] * decay
                        dQ[c] += dA_qk[c, i] * K[i] * decay
                        dK[i] += dA_qk[c, i] * Q[c] * decay
                        dgamma[c] += dA_qk[c, i] * Q[c] * K[i] * decay
                        dgamma[i] -= dA_qk[c, i] * Q[c] * K[i] * decay

                # gamma[r] = g[0] + ... + g[r]: a reverse cumulative sum over the chunk
                dG = np.zeros((C, d_k))
                running = np.zeros(d_k)
                for r in reversed(range(C)):
                    running = running + dgamma[r]
                    dG[r] = running
                dq[b, rows, h], dk[b, rows, h], dg[b, rows, h], dbeta[b, rows, h] = dQ, dK, dG, dbeta_c
                dS_T = dS_T_before
            d_initial_state[b, h] = dS_T
    return ChunkwiseGradients(dq, dk, dv, dg, dbeta, d_initial_state, o, final_state, dA_qk_rows, dM_rows)
# --8<-- [end:chunkwise_backward]


# --8<-- [start:kernel_mirror_backward]
def kernel_mirror_backward(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                           do: Float64Array, chunk_size: int, initial_state: Float64Array | None = None,
                           d_final_state: Float64Array | None = None, block_dv: int | None = None,
                           sub_block: int | None = None) -> Gradients:
    """Reference C: the backward kernels in order. States S^T and dS^T: (d_k, block_dv) per program.

    block_dv (None: d_v) splits the value columns of the two chunk loops, as the kernels' grids do;
    sub_block (None: the kernels' 16 where it divides chunk_size, else the whole chunk) is the anchors'.
    Like the kernels' wrapper, it zero-pads N up to a multiple of chunk_size: a padded token has
    q = k = v = do = 0, beta = 0 and g = 0, so it changes no state and no gradient of a real token.
    The forward's o and final state, which the backward kernels do not compute, come from stage 5's
    recurrence on the same prepared tensors.
    """
    B, N, H, d_k, d_v = check_gradient_inputs(q, k, v, g, beta, do, initial_state, d_final_state)
    block_dv = d_v if block_dv is None else block_dv
    check_chunking(N, d_v, chunk_size, block_dv)
    if sub_block is None:
        sub_block = SUB_BLOCK if chunk_size % SUB_BLOCK == 0 else chunk_size
    from stages.s05_fast_kda.reference import recurrence

    N_padded = padded_length(N, chunk_size)
    q, k, v, g, do = (_pad_tokens(x, N_padded) for x in (q, k, v, g, do))
    beta = _pad_tokens(beta[..., None], N_padded)[..., 0]
    tensors = prepare(q, k, v, g, beta, chunk_size, sub_block)  # stage 5's prepare kernel, run again
    o, final_state = recurrence(tensors, block_dv, initial_state)
    states = chunk_states(tensors, block_dv, initial_state)
    state_grads = state_gradients(tensors, do, block_dv, d_final_state)
    products = state_products(tensors, states, state_grads, do)
    dq, dk, dv, dg, dbeta = intra_gradients(q, k, v, g, beta, do, states.v_new, state_grads.dv_new, products,
                                            chunk_size, sub_block)
    return Gradients(dq[:, :N], dk[:, :N], dv[:, :N], dg[:, :N], dbeta[:, :N], state_grads.d_initial_state,
                     o[:, :N], final_state)
# --8<-- [end:kernel_mirror_backward]


@dataclass
class ChunkStates:
    """What the states kernel writes: S^T at every chunk start (B, chunks, H, d_k, d_v) and the
    pseudo-values V_new = U - W S^T (B, N_padded, H, d_v). In the kernel both are in the input dtype."""

    states: np.ndarray
    v_new: np.ndarray


# --8<-- [start:chunk_states]
def chunk_states(tensors: ChunkTensors, block_dv: int, initial_state: Float64Array | None = None) -> ChunkStates:
    """The states kernel's control flow: stage 5's recurrence without the output, keeping S^T at every
    chunk start. One program per (block of d_v columns, batch x head)."""
    B, N_padded, H, d_k = tensors.w.shape
    d_v, C = tensors.u.shape[3], tensors.a_qk.shape[3]
    out = ChunkStates(np.zeros((B, N_padded // C, H, d_k, d_v)), np.zeros((B, N_padded, H, d_v)))
    for i_v in range(d_v // block_dv):  # grid.x
        cols = slice(i_v * block_dv, (i_v + 1) * block_dv)
        for i_bh in range(B * H):  # grid.y
            b, h = divmod(i_bh, H)
            S_T = np.zeros((d_k, block_dv)) if initial_state is None else initial_state[b, h][:, cols].copy()
            for i_c in range(N_padded // C):  # the chunk loop, forward in time
                rows = slice(i_c * C, (i_c + 1) * C)
                out.states[b, i_c, h, :, cols] = S_T  # the state this chunk starts from
                V_new = tensors.u[b, rows, h, cols] - tensors.w[b, rows, h] @ S_T  # GEMM
                out.v_new[b, rows, h, cols] = V_new
                S_T = tensors.chunk_decay[b, i_c, h][:, None] * S_T + tensors.k_to_chunk_end[b, rows, h].T @ V_new
    return out
# --8<-- [end:chunk_states]


@dataclass
class StateGradients:
    """What the reverse chunk loop writes: dS^T at every chunk END, the gradient of the state the chunk
    hands on (B, chunks, H, d_k, d_v); dV_new (B, N_padded, H, d_v), both in the input dtype in the
    kernel; and dS_0^T (B, H, d_k, d_v), fp32."""

    d_states: np.ndarray
    dv_new: np.ndarray
    d_initial_state: np.ndarray


# --8<-- [start:state_gradients]
def state_gradients(tensors: ChunkTensors, do: Float64Array, block_dv: int,
                    d_final_state: Float64Array | None = None) -> StateGradients:
    """The reverse chunk loop's control flow: one program per (block of d_v columns, batch x head),
    carrying dS^T (d_k x block_dv) from the last chunk to the first. Per chunk, with dS'^T the
    gradient of the state after it:
        dV_new = (K e^{gamma_C - gamma}) dS'^T + A_qk^T dO
        dS^T   = Diag(e^{gamma_C}) dS'^T + (Q e^gamma)^T dO - W^T dV_new
    do: (B, N_padded, H, d_v), padded as the tensors are.
    """
    B, N_padded, H, d_k = tensors.w.shape
    d_v, C = tensors.u.shape[3], tensors.a_qk.shape[3]
    out = StateGradients(np.zeros((B, N_padded // C, H, d_k, d_v)), np.zeros((B, N_padded, H, d_v)),
                         np.zeros((B, H, d_k, d_v)))
    for i_v in range(d_v // block_dv):  # grid.x
        cols = slice(i_v * block_dv, (i_v + 1) * block_dv)
        for i_bh in range(B * H):  # grid.y
            b, h = divmod(i_bh, H)
            dS_T = np.zeros((d_k, block_dv)) if d_final_state is None else d_final_state[b, h][:, cols].copy()
            for i_c in reversed(range(N_padded // C)):  # the chunk loop, backward in time
                rows = slice(i_c * C, (i_c + 1) * C)
                dO = do[b, rows, h, cols]
                out.d_states[b, i_c, h, :, cols] = dS_T  # the gradient of the state this chunk ends with
                dV_new = tensors.k_to_chunk_end[b, rows, h] @ dS_T  # GEMM: through the state update ...
                dV_new += tensors.a_qk[b, rows, h].T @ dO  # GEMM: ... and through the output
                out.dv_new[b, rows, h, cols] = dV_new
                dS_T = tensors.chunk_decay[b, i_c, h][:, None] * dS_T  # the decay, row by row
                dS_T += tensors.q_decayed[b, rows, h].T @ dO  # GEMM: the output read the state
                dS_T -= tensors.w[b, rows, h].T @ dV_new  # GEMM: V_new read the state
            out.d_initial_state[b, h, :, cols] = dS_T
    return out
# --8<-- [end:state_gradients]


@dataclass
class StateProducts:
    """What the state-products kernel writes, every product of a chunk that sums over d_v (fp32):
    dq_decayed = dO S, dk_to_chunk_end = V_new dS', dw = -dV_new S (B, N_padded, H, d_k) and
    d_gamma_last = e^{gamma_C} ⊙ rowsum(S^T ⊙ dS'^T) (B, chunks, H, d_k), the gradient of the last
    row's gamma through the state's decay."""

    dq_decayed: np.ndarray
    dk_to_chunk_end: np.ndarray
    dw: np.ndarray
    d_gamma_last: np.ndarray


# --8<-- [start:state_products]
def state_products(tensors: ChunkTensors, states: ChunkStates, state_grads: StateGradients,
                   do: Float64Array) -> StateProducts:
    """The state-products kernel's control flow: one program per (chunk, batch x head), all d_v columns.

    S^T is the state the chunk starts from, dS'^T the gradient of the state it ends with (d_k x d_v):
        d(Q e^gamma) = dO S,   d(K e^{gamma_C - gamma}) = V_new dS',   dW = -dV_new S,
        d gamma_C   += e^{gamma_C} ⊙ rowsum(S^T ⊙ dS'^T)
    """
    B, N_padded, H, d_k = tensors.w.shape
    C = tensors.a_qk.shape[3]
    out = StateProducts(np.zeros((B, N_padded, H, d_k)), np.zeros((B, N_padded, H, d_k)),
                        np.zeros((B, N_padded, H, d_k)), np.zeros((B, N_padded // C, H, d_k)))
    for i_c in range(N_padded // C):  # grid.x: no chunk waits for another
        rows = slice(i_c * C, (i_c + 1) * C)
        for i_bh in range(B * H):  # grid.y
            b, h = divmod(i_bh, H)
            S_T, dS_T = states.states[b, i_c, h], state_grads.d_states[b, i_c, h]
            out.dq_decayed[b, rows, h] = do[b, rows, h] @ S_T.T  # GEMM
            out.dk_to_chunk_end[b, rows, h] = states.v_new[b, rows, h] @ dS_T.T  # GEMM
            out.dw[b, rows, h] = -(state_grads.dv_new[b, rows, h] @ S_T.T)  # GEMM
            out.d_gamma_last[b, i_c, h] = tensors.chunk_decay[b, i_c, h] * np.sum(S_T * dS_T, axis=1)
    return out
# --8<-- [end:state_products]


# --8<-- [start:intra_gradients]
def intra_gradients(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                    do: Float64Array, v_new: Float64Array, dv_new: Float64Array, products: StateProducts,
                    chunk_size: int, sub_block: int = SUB_BLOCK) -> tuple[Float64Array, ...]:
    """The intra-chunk kernel's control flow: one program per (chunk, batch x head). Every input is
    padded to N_padded tokens; returns dq, dk (B, N_padded, H, d_k), dv (B, N_padded, H, d_v),
    dg (B, N_padded, H, d_k) and dbeta (B, N_padded, H).

    The kernel reads the chunk's A_kk (M) and T = (I + L)^{-1} as the prepare kernel wrote them
    (its solve_outputs, `solve_outputs` below); here, in float64, they are formed again from the same
    steps, which gives the same numbers and keeps this function's arguments those of the exercise.
    Then, with dW and dU = dV_new from the chunk loops:
        dA_hat = dW (K e^gamma)^T + dV_new V^T,  dV = A_hat^T dV_new,  d(K e^gamma) = A_hat^T dW
        dbeta  = rowsum(dA_hat ⊙ T) + colsum(dL ⊙ M),   dT = diag(beta) dA_hat,
        dL^T   = -T dT^T T = -T (dA_hat^T A_hat) (strict upper),  dM^T = diag(beta) dL^T,
        dA_qk^T = V_new dO^T (upper, diagonal included)
    The kernel keeps dL, dM and dA_qk transposed, so that a column slab of them is a slab of rows.
    `score_gradients` takes dM and dA_qk through the scores, and gives their part of dgamma; the
    terms of Q e^gamma, K e^gamma (+) and K e^{gamma_C - gamma} (-) add theirs, and the last row's
    terms of e^{gamma_C} go to every dg[s]; dg is the reverse cumulative sum of dgamma.
    """
    B, N_padded, H, d_k = q.shape
    C = chunk_size
    dq, dk, dg = (np.zeros((B, N_padded, H, d_k)) for _ in range(3))
    dv, dbeta = np.zeros(v.shape), np.zeros((B, N_padded, H))
    for i_c in range(N_padded // C):  # grid.x
        rows = slice(i_c * C, (i_c + 1) * C)
        for i_bh in range(B * H):  # grid.y
            b, h = divmod(i_bh, H)
            Q, K, V, beta_c = q[b, rows, h], k[b, rows, h], v[b, rows, h], beta[b, rows, h]
            gamma = np.cumsum(g[b, rows, h], axis=0)
            A_kk, _ = intra_chunk_scores(Q, K, gamma, sub_block)  # the kernel reads the prepare kernel's
            T = block_inverse(A_kk * beta_c[None, :], sub_block)
            A_hat = beta_c[:, None] * T
            decay_from_start, decay_to_end = np.exp(gamma), np.exp(gamma[-1] - gamma)
            dW, dV_new = products.dw[b, rows, h], dv_new[b, rows, h]

            dA_hat = dW @ (K * decay_from_start).T + dV_new @ V.T  # GEMMs
            dv[b, rows, h] = A_hat.T @ dV_new  # GEMM
            dK_decayed = A_hat.T @ dW  # GEMM: d(K e^gamma)
            # dL^T = -T dT^T T with dT = diag(beta) dA_hat, so dT^T T = dA_hat^T A_hat: no dT is formed
            dL_T = np.triu(-(T @ (dA_hat.T @ A_hat)), 1)  # two GEMMs; strict upper: dL strict lower
            dbeta[b, rows, h] = np.sum(dA_hat * T, axis=1) + np.sum(dL_T * A_kk.T, axis=1)
            dM_T = dL_T * beta_c[:, None]  # dM = dL diag(beta), transposed
            dA_qk_T = np.triu(v_new[b, rows, h] @ do[b, rows, h].T)  # GEMM; j <= c: upper with the diagonal

            dQ_scores, dK_rows, dK_columns, dgamma = score_gradients(Q, K, gamma, dA_qk_T, dM_T, sub_block)
            dQ_decayed = products.dq_decayed[b, rows, h] * decay_from_start
            dK_decayed *= decay_from_start
            dK_to_end = products.dk_to_chunk_end[b, rows, h] * decay_to_end
            dq[b, rows, h] = dQ_decayed + dQ_scores
            dk[b, rows, h] = dK_decayed + dK_rows + dK_columns + dK_to_end
            dgamma += Q * dQ_decayed + K * (dK_decayed - dK_to_end)  # e^{+gamma} twice, e^{-gamma} once
            # gamma_C enters e^{gamma_C - gamma} of every row and the state's decay; it lies in the
            # last row, which every dg[s] sums: added to all rows at once
            d_gamma_last = np.sum(K * dK_to_end, axis=0) + products.d_gamma_last[b, i_c, h]
            dg[b, rows, h] = np.cumsum(dgamma[::-1], axis=0)[::-1] + d_gamma_last
    return dq, dk, dv, dg, dbeta
# --8<-- [end:intra_gradients]


def solve_outputs(k: Float64Array, g: Float64Array, beta: Float64Array, chunk_size: int,
                  sub_block: int = SUB_BLOCK) -> tuple[Float64Array, Float64Array]:
    """What stage 5's prepare kernel writes with solve_outputs for the intra kernel: every chunk's
    A_kk (C, C), strictly lower, and T = (I + A_kk diag(beta))^{-1}, formed as the prepare kernel forms
    them, row r of a chunk in token r's row, (B, N, H, C) each; N a multiple of chunk_size."""
    B, N, H, _ = k.shape
    a_kk, t = np.zeros((B, N, H, chunk_size)), np.zeros((B, N, H, chunk_size))
    for start in range(0, N, chunk_size):
        rows = slice(start, start + chunk_size)
        for b in range(B):
            for h in range(H):
                K = k[b, rows, h]
                A_kk, _ = intra_chunk_scores(K, K, np.cumsum(g[b, rows, h], axis=0), sub_block)  # no queries here
                a_kk[b, rows, h] = A_kk
                t[b, rows, h] = block_inverse(A_kk * beta[b, rows, h][None, :], sub_block)
    return a_kk, t


# --8<-- [start:score_gradients]
def score_gradients(Q: Float64Array, K: Float64Array, gamma: Float64Array, dA_qk_T: Float64Array, dM_T: Float64Array,
                    sub_block: int) -> tuple[Float64Array, Float64Array, Float64Array, Float64Array]:
    """The gradients through A_qk[c, i] = (q_c ⊙ e^{gamma_c - gamma_i}) · k_i and M (the same with k_c),
    as GEMMs with stage 5's anchors. Q, K, gamma: (C, d_k); dA_qk_T, dM_T: (C, C), the transposes.

    Returns, each (C, d_k):
        dQ_scores[c]  = sum_i dA_qk[c, i] k_i e^{gamma_c - gamma_i}        (row c's q)
        dK_rows[c]    = sum_i dM[c, i] k_i e^{gamma_c - gamma_i}           (row c's k)
        dK_columns[i] = sum_c (dM[c, i] k_c + dA_qk[c, i] q_c) e^{gamma_c - gamma_i}   (column i's k)
        dgamma        = Q ⊙ dQ_scores + K ⊙ dK_rows - K ⊙ dK_columns      (the exponent's gradient)
    Split as the forward splits the scores: within a diagonal sub-block both factors are anchored
    at its middle row; a column slab of sub_block keys is anchored at the first row below it.
    dgamma is computed as each GEMM times its other operand, e.g. (K e^{gamma - anchor}) ⊙
    (dM (K e^{anchor - gamma})): in a kernel that rounds the operands, the two terms of one pair
    (c, i) are then one product, added to row c and taken from row i, and still cancel.
    """
    C = len(K)
    sub_index = np.arange(C) // sub_block
    middle = gamma[sub_index * sub_block + sub_block // 2]
    to_row, to_middle = np.exp(gamma - middle), np.exp(middle - gamma)
    same_block = sub_index[:, None] == sub_index[None, :]
    dA_qk_T_diagonal, dM_T_diagonal = np.where(same_block, dA_qk_T, 0.0), np.where(same_block, dM_T, 0.0)
    K_col = K * to_middle
    Q_row, K_row = Q * to_row, K * to_row
    rows_q, rows_k = dA_qk_T_diagonal.T @ K_col, dM_T_diagonal.T @ K_col  # GEMMs
    columns = dM_T_diagonal @ K_row + dA_qk_T_diagonal @ Q_row  # GEMMs
    dQ_scores, dK_rows, dK_columns = to_row * rows_q, to_row * rows_k, to_middle * columns
    dgamma = Q_row * rows_q + K_row * rows_k - K_col * columns
    for s0 in range(sub_block, C, sub_block):
        slab, below = slice(s0 - sub_block, s0), slice(s0, C)
        anchor = gamma[s0]
        K_col = K[slab] * np.exp(anchor - gamma[slab])  # <= 1
        anchor_to_row = np.zeros_like(K)  # zero above the anchor: the diagonal block is done
        anchor_to_row[below] = np.exp(gamma[below] - anchor)  # <= 1
        Q_row, K_row = Q * anchor_to_row, K * anchor_to_row
        rows_q, rows_k = dA_qk_T[slab].T @ K_col, dM_T[slab].T @ K_col  # GEMMs, C x sub_block x d_k
        columns = dM_T[slab] @ K_row + dA_qk_T[slab] @ Q_row  # GEMMs, sub_block x C x d_k
        dQ_scores += anchor_to_row * rows_q
        dK_rows += anchor_to_row * rows_k
        dK_columns[slab] += np.exp(anchor - gamma[slab]) * columns
        dgamma += Q_row * rows_q + K_row * rows_k
        dgamma[slab] -= K_col * columns
    return dQ_scores, dK_rows, dK_columns, dgamma
# --8<-- [end:score_gradients]


def _pad_tokens(x, length):
    """Zero-pad axis 1 (tokens) of a (B, N, H, D) array to `length`."""
    return np.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
