"""Stage 7 reference in NumPy float64: the decode step, one token per sequence from a stored state.

    S_t = S_{t-1} Diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T        o_t = S_t q_t
                                                             (paper layout: S is d_v x d_k)

The math is stage 4's at N = 1: a server that has prefilled a prompt keeps each sequence's state and
advances it by one token per step. The states live in a pool, (P, H, d_k, d_v), in the kernel
layout S^T (d_k x d_v), the layout of stage 5's `initial_state` and of FLA's. A batch of B
sequences names its states by `slots` (B,): sequence b reads and writes state_pool[slots[b]]. In
the kernel layout the step is

    S^T <- (I - beta k k^T) Diag(a) S^T + beta k v^T                  o = (S^T)^T q

and the kernel computes it as a decay, one product and a rank-one write, never forming a d_k x d_k
matrix (expand the product: (I - beta k k^T) X + beta k v^T = X + k (beta (v - X^T k))^T):

    S^T <- Diag(e^g) S^T                       decay: row d of S^T is key channel d
    u    = beta (v - (S^T)^T k)                the new value minus what the state recalls for k
    S^T <- S^T + k u^T                         the delta-rule write
    o    = (S^T)^T q                           read with the updated state

q, k: (B, H, d_k); v: (B, H, d_v); g = log(a): (B, H, d_k); beta: (B, H). The token axis is gone:
one token per sequence.

The pool is updated in place, as a server's is: it holds every live sequence's state (P of them,
64 KiB per head at d_k = d_v = 128 in fp32), a step touches only B of them, and a copy of the whole
pool per step would move more memory than the step itself. The reference does what the kernel does,
so the two are tested through the same contract: the states at `slots` change, the others do not.
"""

import numpy as np

from stages.common.checks import Float64Array, check_array, check_log_gates, check_shaped, check_slots, check_values


def check_decode_inputs(q, k, v, g, beta, state_pool, slots):
    """The shapes of one decode step; returns (B, H, d_k, d_v, P). Every array float64 and finite,
    g <= 0, beta in [0, 1], slots in [0, P) and distinct."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x, 3, "(B, H, D): one token per sequence")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    B, H, d_k = q.shape
    if tuple(v.shape[:2]) != (B, H):
        raise ValueError(f"v must be (B, H, d_v) = ({B}, {H}, d_v), got {tuple(v.shape)}")
    d_v = v.shape[2]
    check_shaped("g", g, (B, H, d_k), f"(B, H, d_k) = {(B, H, d_k)}")
    check_log_gates("g", g)
    check_shaped("beta", beta, (B, H), f"(B, H) = {(B, H)}")
    check_values("beta", beta, 0.0, 1.0, "beta must lie in [0, 1]")
    check_array("state_pool", state_pool, 4, "(P, H, d_k, d_v)")
    if tuple(state_pool.shape[1:]) != (H, d_k, d_v):
        raise ValueError(f"state_pool must be (P, H, d_k, d_v) = (P, {H}, {d_k}, {d_v}), S^T in the kernel layout, "
                         f"got {tuple(state_pool.shape)}")
    P = state_pool.shape[0]
    check_slots(slots, B, P)
    return B, H, d_k, d_v, P


# --8<-- [start:decode_step]
def decode_step(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                state_pool: Float64Array, slots: np.ndarray) -> Float64Array:
    """One token per sequence: advance state_pool[slots[b]] (S^T, the kernel layout) by the token
    and return o: (B, H, d_v). The pool is updated in place; every input is checked first, so a
    refused call leaves it as it was."""
    B, H, d_k, d_v, _ = check_decode_inputs(q, k, v, g, beta, state_pool, slots)
    o = np.zeros((B, H, d_v))
    for b in range(B):
        slot = slots[b]
        for h in range(H):
            k_t, beta_t = k[b, h], beta[b, h]
            S_T = state_pool[slot, h]  # (d_k, d_v)
            decay = np.diag(np.exp(g[b, h]))  # Diag(a_t): one rate per key channel, a row of S^T
            householder = np.eye(d_k) - beta_t * np.outer(k_t, k_t)
            # stage 4's S Diag(a)(I - beta k k^T), transposed: the Householder factor acts last
            S_T = householder @ decay @ S_T + beta_t * np.outer(k_t, v[b, h])
            o[b, h] = S_T.T @ q[b, h]
            state_pool[slot, h] = S_T
    return o
# --8<-- [end:decode_step]
