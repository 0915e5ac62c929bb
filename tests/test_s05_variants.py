"""CPU tests of benchmarks/s05_variants.py: every prepare variant through the tile interpreter (float64
against reference C's prepare, fp16 through the committed recurrence against reference A), and the
GPU script's arguments."""

import numpy as np
import pytest

from benchmarks import s05_variants
from stages.common.compare import assert_close
from stages.common.inputs import make_inputs
from stages.common.interpreter import interpret
from stages.s04_kda.reference import recurrent
from stages.s05_fast_kda.kernel import build_recurrence_program
from stages.s05_fast_kda.reference import prepare

B, N, H, D, C = 1, 128, 2, 64, 64
UNIT_ROUNDOFF_FP16 = 2.0**-11


@pytest.fixture(scope="module")
def inputs():
    return make_inputs(B, N, H, D, D, gate="channel", gate_range=(0.5, 0.999), beta_range=(0.1, 0.9), seed=5)


@pytest.mark.parametrize("name", list(s05_variants.VARIANTS))
def test_float64_variant_equals_reference_c(name, inputs):
    x = inputs
    program = s05_variants.VARIANTS[name](B, N, H, D, D, C, "float64")
    actual = interpret(program, out_idx=s05_variants.PREPARE_OUT)(x.q, x.k, x.v, x.g, x.beta)
    expected = prepare(x.q, x.k, x.v, x.g, x.beta, C)
    for output_name, output in zip(s05_variants.OUTPUTS, actual):
        axes = ("batch", "chunk", "head", "channel") if output_name == "chunk_decay" else None
        assert_close(output, getattr(expected, output_name), rel_l2=2.0**-13, name=f"{name} {output_name}",
                     axes=axes, chunk_size=None if output_name == "chunk_decay" else C)


@pytest.mark.parametrize("name", list(s05_variants.VARIANTS))
def test_fp16_variant_through_the_recurrence(name, inputs):
    x = inputs
    prepared = interpret(s05_variants.VARIANTS[name](B, N, H, D, D, C, "float16"),
                         out_idx=s05_variants.PREPARE_OUT)(x.q, x.k, x.v, x.g, x.beta)
    recurrence = build_recurrence_program(B, N, H, D, D, C, 32, "float16")
    o, _ = interpret(recurrence, out_idx=[7, 8])(*prepared, np.zeros((B, H, D, D)))
    assert_close(o, recurrent(x.q, x.k, x.v, x.g, x.beta), rel_l2=4 * UNIT_ROUNDOFF_FP16, chunk_size=C,
                 name=f"{name} (fp16) through the recurrence")


def test_fp16_score_operands_cut_the_bf16_error():
    """bf16 inputs (rounded from float64 ones), gates down to 0.5: o against float64 of the unrounded
    inputs, through the committed recurrence. The fp16 score operands must do clearly better than the
    bf16 ones (the committed kernel), and no kernel can beat rounding the inputs and the output alone."""
    from stages.common.interpreter import round_to_dtype

    B_, N_, H_, D_ = 1, 256, 2, 128
    x = make_inputs(B_, N_, H_, D_, D_, gate="channel", gate_range=(0.5, 0.999), beta_range=(0.0, 1.0), seed=0)
    q, k, v = (np.asarray(round_to_dtype(a, "bfloat16"), dtype=np.float64) for a in (x.q, x.k, x.v))
    expected = recurrent(x.q, x.k, x.v, x.g, x.beta)
    recurrence = interpret(build_recurrence_program(B_, N_, H_, D_, D_, C, 32, "bfloat16"), out_idx=[7, 8])

    def error(name):
        prepared = interpret(s05_variants.VARIANTS[name](B_, N_, H_, D_, D_, C, "bfloat16"),
                             out_idx=s05_variants.PREPARE_OUT)(q, k, v, x.g, x.beta)
        o, _ = recurrence(*prepared, np.zeros((B_, H_, D_, D_)))
        o = np.asarray(o, dtype=np.float64)
        return np.linalg.norm(o - expected) / np.linalg.norm(expected)

    committed, fp16 = error("staged_all"), error("fp16_scores")
    rounded_only = round_to_dtype(recurrent(q, k, v, x.g, x.beta), "bfloat16")
    floor = np.linalg.norm(rounded_only - expected) / np.linalg.norm(expected)
    assert floor < fp16 < 0.95 * committed, (floor, fp16, committed)


def test_arguments():
    args = s05_variants.parse_args(["--out", "x"])
    assert args.variants == list(s05_variants.VARIANTS)
    assert args.shapes == s05_variants.SHAPES and args.rounds == s05_variants.ROUNDS and not args.no_fla
    args = s05_variants.parse_args(["--out", "x", "--quick", "--variants", "committed,staged_wu", "--no-fla"])
    assert args.variants == ["committed", "staged_wu"] and args.no_fla
    assert args.shapes == s05_variants.QUICK_SHAPES and args.rounds == s05_variants.QUICK_ROUNDS
    with pytest.raises(SystemExit):
        s05_variants.parse_args(["--out", "x", "--variants", "nope"])


def test_table_from_rows(capsys):
    rows = [dict(B=1, N=16384, H=32, D=128, variant=name, prepare_ms=str(ms), kernels_ms=str(ms + 0.3), fla_ms="1.9",
                 **{f"rel_l2_{n}": "0" for n in s05_variants.OUTPUTS}, round=1)
            for name, ms in (("committed", 1.1), ("staged_wu", 0.9))]
    summary = s05_variants.summarize(rows)
    assert summary[(1, 16384, 32, 128)]["staged_wu"][0] == pytest.approx(0.9)
    s05_variants.print_table(rows)
    assert "staged_wu" in capsys.readouterr().out


def test_the_adopted_variant_is_the_library_kernel():
    """The stage 5 page marks staged_all as adopted: it must build stages/s05_fast_kda's program."""
    from kdacourse.pages.s05_fast_kda import ADOPTED_VARIANT
    from stages.s05_fast_kda.kernel import build_prepare_program

    shape = (1, 128, 2, 64, 64)
    adopted = s05_variants.VARIANTS[ADOPTED_VARIANT](*shape).with_attr("global_symbol", "k").script()
    assert adopted == build_prepare_program(*shape).with_attr("global_symbol", "k").script()
