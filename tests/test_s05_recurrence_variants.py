"""CPU tests of benchmarks/studies/s05_recurrence_variants.py: every recurrence variant through the tile
interpreter (float64, from a nonzero state, against reference C's recurrence), and the script's
arguments. The paired variants run T.wgmma_gemm and T.wait_wgmma, so these also hold that the
interpreter runs them as T.gemm."""

import numpy as np
import pytest

from benchmarks.studies import s05_recurrence_variants as variants
from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.interpreter import interpret
from stages.s05_fast_kda import reference

B, N, H, D, C = 1, 192, 2, 32, 64
FP32_FLOOR = 8 * 2.0**-24  # the state and the accumulators are fp32 in the float64 program too


@pytest.fixture(scope="module")
def prepared():
    x = make_inputs(B, N, H, D, D, gate="channel", gate_range=(0.5, 0.999), beta_range=(0.0, 1.0), seed=7)
    state = np.random.default_rng(7).standard_normal((B, H, D, D)) * 0.1
    return reference.prepare(x.q, x.k, x.v, x.g, x.beta, C), state


@pytest.mark.parametrize("block_dv", [16, 32])
@pytest.mark.parametrize("name", list(variants.VARIANTS))
def test_float64_variant_equals_reference_c(name, block_dv, prepared):
    tensors, state = prepared
    program = variants.VARIANTS[name](B, N, H, D, D, C, block_dv, "float64")
    o, final_state = interpret(program, out_idx=[7, 8])(*tensors.__dict__.values(), state)
    expected_o, expected_state = reference.recurrence(tensors, block_dv, state)
    assert_close(o, expected_o, rel_l2=FP32_FLOOR, chunk_size=C, name=f"{name} o")
    assert_close(final_state, expected_state, rel_l2=FP32_FLOOR, name=f"{name} final state",
                 axes=("batch", "head", "d_k", "d_v"))


def test_arguments():
    args = variants.parse_args(["--out", "x"])
    assert args.variants == list(variants.VARIANTS) and args.rounds == variants.ROUNDS
    args = variants.parse_args(["--out", "x", "--quick", "--variants", "paired"])
    assert args.variants == ["paired"] and args.shapes == variants.QUICK_SHAPES
    with pytest.raises(SystemExit):
        variants.parse_args(["--out", "x", "--variants", "nope"])
