"""Independent oracles for the tests: closed forms that share no code with references A, B, C."""

import numpy as np


def causal_linear_attention(q, k, v):
    """o = (Q K^T ⊙ M) V per (batch, head), M the inclusive causal mask: the quadratic form of
    linear attention, computed without any state. q, k: (B, N, H, d_k); v: (B, N, H, d_v)."""
    scores = np.einsum("bthd,bshd->bhts", q, k)
    scores = scores * np.tril(np.ones(scores.shape[-2:]))
    return np.einsum("bhts,bshd->bthd", scores, v)
