"""CPU tests of benchmarks/studies/s05_variants.py: every prepare variant through the tile interpreter (float64
against reference C's prepare, fp16 through the committed recurrence against reference A), and the
GPU script's arguments."""

import numpy as np
import pytest

from benchmarks.studies import s05_variants
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


ROUNDED_SHAPE = (1, 256, 2, 128)  # B, N, H, d: four chunks at the benchmarks' d_k = d_v
UNIT_ROUNDOFF = {"float16": UNIT_ROUNDOFF_FP16, "bfloat16": 2.0**-8}
STRONG_GATES = [(0.01, 0.1), (1e-4, 1e-3)]  # log gates down to -4.6 and -9.2


@pytest.fixture(scope="module")
def rounded_error():
    """error(name, gate_range, dtype="bfloat16") -> (o's rel L2, the floor's): inputs rounded to dtype
    from float64 ones (beta in [0, 1]), prepared by the variant and run through the committed
    recurrence, o against float64 of the unrounded inputs; the floor rounds the inputs and o alone, no
    kernel can beat it. Programs are interpreted once per variant and dtype."""
    from stages.common.interpreter import round_to_dtype

    B_, N_, H_, D_ = ROUNDED_SHAPE
    programs = {}

    def program(key, build, out_idx):
        if key not in programs:
            programs[key] = interpret(build(), out_idx=out_idx)
        return programs[key]

    def rel_l2(actual, expected):
        return np.linalg.norm(np.asarray(actual, dtype=np.float64) - expected) / np.linalg.norm(expected)

    def error(name, gate_range, dtype="bfloat16"):
        prepare_program = program((name, dtype), lambda: s05_variants.VARIANTS[name](B_, N_, H_, D_, D_, C, dtype),
                                  s05_variants.PREPARE_OUT)
        recurrence = program(("recurrence", dtype),
                             lambda: build_recurrence_program(B_, N_, H_, D_, D_, C, 32, dtype), [7, 8])
        x = make_inputs(B_, N_, H_, D_, D_, gate="channel", gate_range=gate_range, beta_range=(0.0, 1.0), seed=0)
        q, k, v = (np.asarray(round_to_dtype(a, dtype), dtype=np.float64) for a in (x.q, x.k, x.v))
        expected = recurrent(x.q, x.k, x.v, x.g, x.beta)
        o, _ = recurrence(*prepare_program(q, k, v, x.g, x.beta), np.zeros((B_, H_, D_, D_)))
        floor = rel_l2(round_to_dtype(recurrent(q, k, v, x.g, x.beta), dtype), expected)
        return rel_l2(o, expected), floor

    return error


def test_fp16_score_operands_cut_the_bf16_error(rounded_error):
    """Gates down to 0.5: the fp16 score operands must do clearly better than the bf16 ones (the
    committed kernel), and no kernel can beat rounding the inputs and the output alone."""
    committed, _ = rounded_error("staged_all", (0.5, 0.999))
    fp16, floor = rounded_error("fp16_scores", (0.5, 0.999))
    assert floor < fp16 < 0.95 * committed, (floor, fp16, committed)


def test_fp16_slab_operands_cut_the_bf16_error(rounded_error):
    """With gates near 1 the slabs' 6 x 16 x 16 = 1536 scores are three quarters of the 2080 a chunk
    computes (the diagonal blocks' lower triangles are 4 x 136) and decay little, so fp16 slab operands
    alone must win at least half of what fp16 operands everywhere win. With gates down to 0.5 the slab
    scores are products of many gates and most of the error sits on the diagonal: still no worse."""
    gentle = (0.99, 0.999)
    committed, _ = rounded_error("staged_all", gentle)
    everywhere, _ = rounded_error("fp16_scores", gentle)
    slabs, floor = rounded_error("fp16_slabs", gentle)
    assert floor < slabs <= committed - 0.5 * (committed - everywhere), (floor, slabs, everywhere, committed)
    committed, _ = rounded_error("staged_all", (0.5, 0.999))
    slabs, floor = rounded_error("fp16_slabs", (0.5, 0.999))
    assert floor < slabs < committed, (floor, slabs, committed)


@pytest.mark.parametrize("gate_range", STRONG_GATES)
def test_fp16_slab_operands_stay_in_range_with_strong_gates(rounded_error, gate_range):
    """A diagonal block's factors reach a_min^{-8} (1e16 and 1e32 here), past fp16's 65504, so fp16
    operands on the diagonal (fp16_scores) give inf and o is nan; the slabs' factors are products of
    gates, <= 1, and fp16_slabs stays within bf16's rounding, as the committed kernel (bf16 operands,
    fp32's range) does."""
    everywhere, _ = rounded_error("fp16_scores", gate_range)
    assert not np.isfinite(everywhere)
    slabs, floor = rounded_error("fp16_slabs", gate_range)
    assert floor < slabs < 2 * UNIT_ROUNDOFF["bfloat16"], (floor, slabs)


@pytest.mark.parametrize("gate_range", [(0.5, 0.999), *STRONG_GATES])
def test_tf32_diagonal_has_fp16_precision_at_any_gate(rounded_error, gate_range):
    """bf16 inputs: TF32 diagonal operands keep fp16's 10 mantissa bits with fp32's range, so
    tf32_diagonal must cut the committed kernel's error as clearly as fp16_scores does where that is
    finite (the same rounding grid for operands in fp16's normal range: the same error), and go on
    doing so with the strong gates that make fp16_scores nan."""
    committed, _ = rounded_error("staged_all", gate_range)
    tf32, floor = rounded_error("tf32_diagonal", gate_range)
    assert floor < tf32 < 0.95 * committed, (floor, tf32, committed)
    everywhere, _ = rounded_error("fp16_scores", gate_range)
    if np.isfinite(everywhere):
        assert tf32 <= 1.01 * everywhere, (tf32, everywhere)


@pytest.mark.parametrize("gate_range", STRONG_GATES)
def test_tf32_diagonal_keeps_fp16_inputs_in_range(rounded_error, gate_range):
    """fp16 inputs: the committed kernel's fp16 diagonal operands overflow (factors up to a_min^{-8})
    and o is nan; tf32_diagonal stays within the fp16 variants' bound of 4 unit roundoffs."""
    committed, _ = rounded_error("staged_all", gate_range, "float16")
    assert not np.isfinite(committed)
    tf32, floor = rounded_error("tf32_diagonal", gate_range, "float16")
    assert floor < tf32 < 4 * UNIT_ROUNDOFF["float16"], (floor, tf32)


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
    """The stage 5 page marks its adopted variant: it must build stages/s05_fast_kda's program, less
    the exact path for sub-blocks past the operands' range that came after the study (any_gate)."""
    from kdacourse.pages.s05_fast_kda import ADOPTED_VARIANT
    from stages.s05_fast_kda.kernel import build_prepare_program

    shape = (1, 128, 2, 64, 64, 64)
    for dtype in ("float16", "bfloat16", "float64"):
        adopted = s05_variants.VARIANTS[ADOPTED_VARIANT](*shape, dtype).with_attr("global_symbol", "k").script()
        library = build_prepare_program(*shape, dtype, any_gate=False)
        assert adopted == library.with_attr("global_symbol", "k").script(), dtype
