"""Tests of stages/common: the seeded inputs, the error measure, the shape and tile checks."""

import numpy as np
import pytest

from stages.common.checks import check_chunking, check_qkv, padded_length
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.common.torch_checks import check_tile_sizes


def test_inputs_are_normalized_and_gates_stay_in_their_range():
    x = make_inputs(2, 16, 3, 8, 5, gate="channel", gate_range=(0.9, 0.95), beta_range=(0.2, 0.3), seed=0)
    np.testing.assert_allclose(np.linalg.norm(x.q, axis=-1), 1.0)
    np.testing.assert_allclose(np.linalg.norm(x.k, axis=-1), 1.0)
    assert x.g.shape == (2, 16, 3, 8) and x.beta.shape == (2, 16, 3)
    assert np.all((np.exp(x.g) >= 0.9) & (np.exp(x.g) <= 0.95))
    assert np.all((x.beta >= 0.2) & (x.beta <= 0.3))


def test_inputs_are_seeded():
    first, second = make_inputs(1, 4, 1, 4, 4, seed=3), make_inputs(1, 4, 1, 4, 4, seed=3)
    assert np.array_equal(first.v, second.v)
    assert not np.array_equal(first.v, make_inputs(1, 4, 1, 4, 4, seed=4).v)


@pytest.mark.parametrize("kwargs, message", [
    (dict(gate="vector"), "gate must be one of"),
    (dict(gate="head", gate_range=(0.0, 0.9)), "gate_range"),
    (dict(gate="head", gate_range=(0.99, 0.9)), "gate_range"),
    (dict(beta_range=(0.5, 1.5)), "beta_range"),
])
def test_inputs_reject_bad_ranges(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_inputs(1, 4, 1, 4, 4, **kwargs)


def test_error_report_gives_both_measures():
    expected = np.array([3.0, 4.0])
    report = error_report(np.array([3.0, 4.5]), expected)
    assert report.max_abs == pytest.approx(0.5)
    assert report.rel_l2 == pytest.approx(0.5 / 5.0)
    assert np.isnan(error_report(np.array([np.nan, 4.0]), expected).rel_l2)
    with pytest.raises(ValueError, match="shapes differ"):
        error_report(np.zeros(3), expected)


def test_shape_and_chunk_checks():
    x = make_inputs(1, 6, 2, 4, 3, seed=1)
    assert check_qkv(x.q, x.k, x.v) == (1, 6, 2, 4, 3)
    with pytest.raises(ValueError, match="block_dv"):
        check_chunking(6, 3, 4, block_dv=2)
    with pytest.raises(ValueError, match="chunk_size"):
        check_chunking(6, 3, 0)
    assert [padded_length(n, 4) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]


@pytest.mark.parametrize("d_k, d_v, chunk_size, block_dv, message", [
    (128, 128, 48 + 1, 32, "chunk_size"),
    (128, 128, 8, 32, "chunk_size"),
    (100, 128, 64, 32, "d_k"),
    (128, 128, 64, 24, "block_dv"),
    (128, 96, 64, 64, "block_dv"),
])
def test_tile_sizes_the_tensor_cores_refuse(d_k, d_v, chunk_size, block_dv, message):
    with pytest.raises(ValueError, match=message):
        check_tile_sizes(d_k, d_v, chunk_size, block_dv)
    check_tile_sizes(128, 128, 64, 32)  # the default tiles pass
