"""Tests of exercise s03.chunk_scores: L and A_qk of one chunk against their entries written out one
by one, and the output of one chunk made from them against the delta rule."""

import numpy as np
import pytest

from stages.common.compare import assert_close, assert_rule
from stages.common.inputs import make_inputs
from stages.common.oracles import delta_rule

STAGE = "s03_gated_deltanet"
AXES = ("row", "column")


@pytest.fixture
def chunk_scores(target_module):
    return target_module(STAGE, "chunk_scores.py").chunk_scores


def _chunk(C, seed):
    """One chunk of one head: random gates and beta, so no decay and no write strength hides a term."""
    x = make_inputs(1, C, 1, 4, 3, gate="token", gate_range=(0.8, 0.99), beta_range=(0.1, 0.9), seed=seed)
    return x, x.q[0, :, 0], x.k[0, :, 0], x.g[0, :, 0], x.beta[0, :, 0]


def _entries(Q, K, g, beta):
    """L[c, i] for i < c and A_qk[c, j] for j <= c, one entry at a time (the page's definitions)."""
    C = len(g)
    L, A_qk = np.zeros((C, C)), np.zeros((C, C))
    for c in range(C):
        for i in range(c + 1):
            decay = np.prod(np.exp(g[i + 1:c + 1]))  # alpha_{i+1} ... alpha_c
            if i < c:
                L[c, i] = beta[i] * decay * (K[c] @ K[i])
            A_qk[c, i] = decay * (Q[c] @ K[i])
    return L, A_qk


@pytest.mark.parametrize("C", [1, 4, 8])
def test_matches_entries(chunk_scores, C):
    _, Q, K, g, beta = _chunk(C, seed=C)
    L, A_qk = chunk_scores(Q, K, g, beta)
    expected_L, expected_A_qk = _entries(Q, K, g, beta)
    assert_close(L, expected_L, rel_l2=1e-12, max_abs=1e-12, name="L", axes=AXES)
    assert_close(A_qk, expected_A_qk, rel_l2=1e-12, name="A_qk", axes=AXES)


def test_one_chunk_matches_delta_rule(chunk_scores):
    """From a zero state: V_new = diag(beta) (I + L)^{-1} V and O = A_qk V_new, the delta rule's output."""
    x, Q, K, g, beta = _chunk(8, seed=11)
    L, A_qk = chunk_scores(Q, K, g, beta)
    V_new = beta[:, None] * np.linalg.solve(np.eye(len(g)) + L, x.v[0, :, 0])
    expected = delta_rule(x.q, x.k, x.v, x.beta, x.g)[0, :, 0]
    assert_close(A_qk @ V_new, expected, rel_l2=1e-12, name="O of one chunk from L and A_qk",
                 axes=("token", "channel"))


def test_diagonals(chunk_scores):
    _, Q, K, g, beta = _chunk(6, seed=3)
    L, A_qk = chunk_scores(Q, K, g, beta)
    assert_rule(np.all(np.diag(L) == 0), "I + L is unit lower triangular: a token's write does not depend on itself",
                f"L's diagonal has {int(np.sum(np.diag(L) != 0))} nonzero entries of {len(g)}")
    own = np.einsum("cd,cd->c", Q, K)
    assert_rule(np.allclose(np.diag(A_qk), own, rtol=1e-12, atol=0),
                "a token's output sees its own write, undecayed: A_qk[c, c] = q_c · k_c")
