"""Shared by stage 7's test files (test_s07_decode, test_s07_prefill, test_s07_serving): the rounding
bounds, the inputs every product's tests start from, and the decode kernel's interpreter case."""

import numpy as np

from stages.common.inputs import make_inputs
from stages.s04_kda.reference import recurrent

POOL_AXES = ("slot", "head", "d_k", "d_v")
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
FP32_FLOOR = 8 * 2.0**-24  # a program that computes in fp32 against float64

# two blocks of d_v columns, B * H = 6 programs per block, d_k != d_v
B, H, D_K, D_V, BLOCK_DV, P = 3, 2, 16, 32, 16, 7
SLOTS = np.array([5, 0, 3])


def make_sequences(B, N, H, d_k, d_v, seed, gate_range=(0.3, 1.0)):
    """Strong gates (a down to 0.3, and up to 1: no decay), beta in [0, 1] with entries exactly 0 and 1."""
    x = make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=gate_range, beta_range=(0.0, 1.0), seed=seed)
    x.beta[:, 1::5] = 0.0
    x.beta[:, 3::5] = 1.0
    return x


def final_state_of_reference_a(x):
    """S_N^T (B, H, d_k, d_v) read through reference A's outputs alone: d_k probe tokens appended,
    each with g = 0, beta = 0 (the state stays S_N) and q = e_j, so that o = S_N e_j, row j of S_N^T."""
    B, N, H, d_k = x.q.shape
    d_v = x.v.shape[3]
    probe_q = np.broadcast_to(np.eye(d_k)[None, :, None, :], (B, d_k, H, d_k))
    zeros_k, zeros_v = np.zeros((B, d_k, H, d_k)), np.zeros((B, d_k, H, d_v))
    o = recurrent(np.concatenate([x.q, probe_q], axis=1), np.concatenate([x.k, zeros_k], axis=1),
                  np.concatenate([x.v, zeros_v], axis=1), np.concatenate([x.g, zeros_k], axis=1),
                  np.concatenate([x.beta, np.zeros((B, d_k, H))], axis=1))
    return o[:, :N], o[:, N:].transpose(0, 2, 1, 3)  # (B, d_k, H, d_v) -> (B, H, d_k, d_v)
