"""Tests of exercise s03.chunk_system: I + L of one chunk against its entries written out one by one.

The keys have norms far from 1 on every input, as the function's docstring allows."""

import numpy as np
import pytest

from stages.common.compare import assert_close

STAGE = "s03_gated_deltanet"
AXES = ("row", "column")


@pytest.fixture
def chunk_system(target_module):
    return target_module(STAGE, "chunk_system.py").chunk_system


def _chunk(C, d_k, seed):
    """Keys with norms spread over [0.5, 5], gates a in [0.8, 0.99], beta in [0.1, 0.9]."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((C, d_k))
    k *= rng.uniform(0.5, 5.0, (C, 1)) / np.linalg.norm(k, axis=1, keepdims=True)
    return k, np.log(rng.uniform(0.8, 0.99, C)), rng.uniform(0.1, 0.9, C)


def _entries(k, g, beta, key_norm):
    """1 on the diagonal; below it beta_i (a_{i+1} ... a_c) key_norm^2 cos(k_c, k_i)."""
    C = len(g)
    expected = np.eye(C)
    for c in range(C):
        for i in range(c):
            cosine = (k[c] @ k[i]) / np.sqrt((k[c] @ k[c]) * (k[i] @ k[i]))
            expected[c, i] = beta[i] * np.prod(np.exp(g[i + 1:c + 1])) * key_norm**2 * cosine
    return expected


@pytest.mark.parametrize("C, d_k, key_norm", [(4, 3, 1.0), (8, 16, 1.0), (6, 8, 3.0)])
def test_matches_entries(chunk_system, C, d_k, key_norm):
    k, g, beta = _chunk(C, d_k, seed=C)
    assert_close(chunk_system(k, g, beta, key_norm), _entries(k, g, beta, key_norm), rel_l2=1e-12, name="I + L",
                 axes=AXES)


def test_independent_of_the_keys_scale(chunk_system):
    k, g, beta = _chunk(6, 4, seed=1)
    assert_close(chunk_system(7.0 * k, g, beta), chunk_system(k, g, beta), rel_l2=1e-14, name="I + L of the keys times 7",
                 axes=AXES)


def test_orthogonal_keys_give_the_identity(chunk_system):
    k = 3.0 * np.eye(4)
    assert_close(chunk_system(k, np.log(np.full(4, 0.9)), np.full(4, 0.5)), np.eye(4), rtol=1e-7, atol=1e-15,
                 name="I + L of orthogonal keys", axes=AXES)
