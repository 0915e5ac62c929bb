"""benchmarks.studies.s07_decode_variants: its variants, built from stage 7's decode kernel's own source,
compute what the kernel computes, through the tile interpreter on the CPU."""

import numpy as np
import pytest

from stages.common.device_checks import FLAG_COUNT

B, P, H, D, BLOCK_DV, THREADS = 4, 6, 2, 8, 4, 64


def _step(program, pool):
    """One decode step of `program` on fixed inputs and a copy of `pool`: (o, the pool after, the flags)."""
    from stages.common.interpreter import interpret

    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, B, H, D))
    v = rng.standard_normal((B, H, D))
    g, beta = -3 * rng.random((B, H, D)), rng.random((B, H))
    slots = np.array([3, 0, 5, 2], dtype=np.int32)  # not in order: a program's states are not neighbours
    pool, flags, o = pool.copy(), np.zeros(FLAG_COUNT, dtype=np.int32), np.zeros((B, H, D))
    interpret(program)(q, k, v, g, beta, slots, pool, flags, o)  # writes the pool, flags and o in place
    return o, pool, flags


@pytest.mark.parametrize("heads, num_stages", [(1, None), (2, None), (4, None), (2, 2), (4, 2)])
def test_a_variant_gives_the_kernels_outputs_bit_for_bit(heads, num_stages):
    from benchmarks.studies.s07_decode_variants import build_variant
    from stages.s07_serving.kernel import build_decode_program

    pool = np.random.default_rng(1).standard_normal((P, H, D, D))
    expected = _step(build_decode_program(B, P, H, D, D, BLOCK_DV, "float64", "float64", THREADS, True), pool)
    actual = _step(build_variant(B, P, H, D, D, BLOCK_DV, "float64", heads, num_stages, THREADS, "float64"), pool)
    assert not np.array_equal(expected[1], pool), "the kernel wrote no state"
    for name, a, e in zip(("o", "the pool", "the flags"), actual, expected):
        assert np.array_equal(a, e), f"{name} differs from the kernel's"


def test_heads_must_divide_the_states():
    from benchmarks.studies.s07_decode_variants import build_variant

    with pytest.raises(ValueError, match="heads = 3 must divide B \\* H = 8"):
        build_variant(B, P, H, D, D, BLOCK_DV, "float64", 3, None)
