"""Tests of exercise s05.intra_chunk_scores: the anchored GEMM form against the definition, in float64
and with fp16 operands where the chunk-start split overflows."""

import numpy as np
import pytest

from stages.common.compare import assert_close, assert_rule
from stages.common.inputs import make_inputs
from tests.exercises.s05_fast_kda.oracle import decayed_scores

STAGE = "s05_fast_kda"
NAMES = ("A_kk", "A_qk")
AXES = ("row", "column")


@pytest.fixture
def intra_chunk_scores(target_module):
    return target_module(STAGE, "intra_chunk_scores.py").intra_chunk_scores


def _chunk(C, d_k, gate_range, seed):
    x = make_inputs(1, C, 1, d_k, 1, gate="channel", gate_range=gate_range, seed=seed)
    return x.q[0, :, 0], x.k[0, :, 0], np.cumsum(x.g[0, :, 0], axis=0)


@pytest.mark.parametrize("C, d_k, sub_block", [(64, 16, 16), (32, 8, 8), (12, 4, 3), (6, 4, 1)])
def test_matches_definition_in_float64(intra_chunk_scores, C, d_k, sub_block):
    Q, K, gamma = _chunk(C, d_k, (0.5, 0.999), seed=C + sub_block)
    for name, actual, expected in zip(NAMES, intra_chunk_scores(Q, K, gamma, sub_block), decayed_scores(Q, K, gamma)):
        assert_close(actual, expected, max_abs=1e-13, name=name, axes=AXES)


@pytest.mark.parametrize("gate_range", [(0.5, 0.55), (0.6, 0.999)])
def test_fp16_operands_stay_finite_and_close(intra_chunk_scores, gate_range):
    """Gates near 0.5 over a 64-token chunk: e^{-gamma} passes fp16's 65504 by far, the anchored
    factors do not (<= 1 off the diagonal blocks, <= 2^8 on them)."""
    Q, K, gamma = _chunk(64, 32, gate_range, seed=1)
    for name, actual, expected in zip(NAMES, intra_chunk_scores(Q, K, gamma, 16, np.float16), decayed_scores(Q, K, gamma)):
        assert_rule(np.isfinite(actual).all(), f"{name} is finite: no fp16 GEMM operand may pass fp16's 65504",
                    f"{int((~np.isfinite(actual)).sum())} entries are inf or NaN")
        assert_close(actual, expected, rel_l2=2e-3, name=f"{name} from fp16 operands", axes=AXES)
