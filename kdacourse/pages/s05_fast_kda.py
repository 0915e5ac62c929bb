"""Stage 5's generated files: the error table of references B and C against A, the identities, the
two kernels' compile-only reports, the range of the anchored exponents (table and plot), the fp16
mirror of the prepare kernel, the bytes each kernel moves; and, on the tensors as a model passes them,
what computing the gate, the norms and beta's sigmoid in the prepare saves, the course's design beside
FlashKDA's, the programs each kernel runs at the benchmark's shapes, the call as Kimi Linear makes it
timed (benchmarks/results/kimi_call/), and what a state stored in bf16 would cost."""


import numpy as np

from kdacourse.pages.stage_tables import compile_report_table, identities_table
from kdacourse.pages.tables import (ROUNDING_NOTE, banner, markdown_table, not_yet_run, rounding_level, save_svg,
                                    spread_cell)
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.kda.inputs import InputForm
from stages.s05_fast_kda.reference import (SUB_BLOCK, chunkwise, intra_chunk_scores, kernel_mirror, prepare,
                                           recurrence, recurrent)

SOURCE = "kdacourse/pages/s05_fast_kda.py"
FP16_MAX = float(np.finfo(np.float16).max)

# B, N, H, d_k, d_v, chunk_size, block_dv, sub_block: one chunk, many chunks, a padded last chunk,
# the kernel's chunk and sub-block on a realistic head
ERROR_TABLE_SHAPES = [
    (2, 16, 2, 4, 4, 16, 2, 4),
    (2, 64, 2, 8, 8, 16, 4, 4),
    (2, 50, 2, 8, 8, 16, 4, 8),
    (1, 256, 2, 64, 64, 64, 32, 16),
]
GATE_LOWER_BOUNDS = [0.999, 0.99, 0.95, 0.9, 0.8, 0.5, 0.3, 0.1]


def _inputs(B, N, H, d_k, d_v, seed=0, gate_range=(0.9, 0.999)):
    """The course's inputs: a in gate_range, beta in [0.1, 0.9], unit q and k, float64."""
    return make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=gate_range, beta_range=(0.1, 0.9), seed=seed)


def write_error_table(path):
    rows = []
    for B, N, H, d_k, d_v, C, block_dv, sub in ERROR_TABLE_SHAPES:
        x = _inputs(B, N, H, d_k, d_v)
        expected = recurrent(x.q, x.k, x.v, x.g, x.beta)
        shape = f"B={B}, N={N}, H={H}, d_k={d_k}, d_v={d_v}, C={C}, block_dv={block_dv}, sub-block={sub}"
        for name, actual in (("B chunkwise", chunkwise(x.q, x.k, x.v, x.g, x.beta, C)),
                             ("C kernel mirror", kernel_mirror(x.q, x.k, x.v, x.g, x.beta, C, block_dv, sub))):
            error = error_report(actual, expected)
            rows.append((shape, f"{name} vs A", rounding_level(error.max_abs), rounding_level(error.rel_l2)))
    path.write_text(banner(SOURCE) + markdown_table(["shape", "comparison", "max abs error", "relative L2"], rows)
                    + "\n" + ROUNDING_NOTE)


def write_identities_table(path):
    from stages.s05_fast_kda.identities import IDENTITIES

    path.write_text(identities_table(IDENTITIES, SOURCE))


COMPILE_SHAPE = dict(B=2, N=1024, H=4, d_k=128, d_v=128)
# kernel, C, block_dv, value flags (the prepare as forward's default, checks="device", builds it)
COMPILE_CONFIGS = [("prepare", 64, "-", False), ("prepare", 64, "-", True), ("recurrence", 64, 32, False),
                   ("recurrence", 64, 16, False)]


def write_compile_report(path):
    from stages.s05_fast_kda.kernel import compile_report

    reports = []
    for kernel, C, block_dv, value_flags in COMPILE_CONFIGS:
        tiles = {} if block_dv == "-" else {"block_dv": block_dv}
        flags = {"value_flags": True} if value_flags else {}
        reports.append(({"kernel": kernel, "chunk_size": C, "block_dv": block_dv,
                         "value flags": "yes" if value_flags else "no"},
                        compile_report(kernel, **COMPILE_SHAPE, chunk_size=C, **tiles, **flags)))
    path.write_text(compile_report_table(reports, SOURCE))


# --8<-- [start:factor_ranges]
def factor_ranges(gamma, sub_block):
    """The largest GEMM-operand factor of one chunk under three splits of e^{gamma_c - gamma_i}.

    gamma: (C, d_k) cumulative log gates. Returns a dict: stage 4's chunk-start split (e^{-gamma_i}),
    the anchored diagonal sub-blocks (middle-row anchor), the anchored off-diagonal slabs."""
    C = len(gamma)
    middle = gamma[(np.arange(C) // sub_block) * sub_block + sub_block // 2]
    diagonal = max(np.max(gamma - middle), np.max(middle - gamma))
    off_diagonal = max(max(np.max(gamma[s0:] - gamma[s0]), np.max(gamma[s0] - gamma[s0 - sub_block:s0]))
                       for s0 in range(sub_block, C, sub_block))
    return {"chunk start": np.exp(np.max(-gamma)), "diagonal": np.exp(diagonal), "off-diagonal": np.exp(off_diagonal)}
# --8<-- [end:factor_ranges]


def _worst_chunk(lower, C=64, d_k=128, seed=0):
    """gamma of one chunk with a ~ U(lower, 0.999) per token and channel, as the seed samples it."""
    g = np.log(np.random.default_rng(seed).uniform(lower, 0.999, (C, d_k)))
    return np.cumsum(g, axis=0)


def write_anchor_table(path):
    rows = []
    for lower in GATE_LOWER_BOUNDS:
        ranges = factor_ranges(_worst_chunk(lower), SUB_BLOCK)
        rows.append([f"{lower}"] + [f"{value:.3g}" + ("" if value <= FP16_MAX else " (fp16 inf)") for value in ranges.values()])
    path.write_text(
        banner(SOURCE) + "One chunk, C = 64, d_k = 128, sub-blocks of 16, a ~ U(lower bound, 0.999) per token and "
        "channel. Each cell is the largest factor that goes into a GEMM operand; fp16's largest value is "
        f"{FP16_MAX:.0f}.\n\n"
        + markdown_table(["gate lower bound", "chunk-start split: max e^{-gamma}", "anchored, diagonal sub-blocks",
                          "anchored, off-diagonal slabs"], rows))


def write_anchor_plot(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lowers = np.linspace(0.1, 0.999, 60)
    ranges = [factor_ranges(_worst_chunk(lower), SUB_BLOCK) for lower in lowers]
    figure, axes = plt.subplots(figsize=(6.4, 3.6))
    for name, style in (("chunk start", "-"), ("diagonal", "--"), ("off-diagonal", ":")):
        axes.semilogy(lowers, [r[name] for r in ranges], style, label=name)
    axes.axhline(FP16_MAX, color="black", linewidth=0.8, label="fp16 largest value")
    axes.set_xlabel("gate lower bound (a ~ U(bound, 0.999))")
    axes.set_ylabel("largest operand factor")
    axes.set_title("C = 64, d_k = 128, sub-blocks of 16")
    axes.legend()
    save_svg(figure, path)
    plt.close(figure)


def _chunk_start_scores_fp16(Q, K, gamma):
    """Stage 4's split, e^{gamma} and e^{-gamma} from the chunk start, with fp16 GEMM operands."""
    as_fp16 = lambda x: x.astype(np.float16).astype(np.float64)  # noqa: E731
    with np.errstate(over="ignore", invalid="ignore"):
        K_plus, K_minus, Q_plus = as_fp16(K * np.exp(gamma)), as_fp16(K * np.exp(-gamma)), as_fp16(Q * np.exp(gamma))
        return np.tril(K_plus @ K_minus.T, -1), np.tril(Q_plus @ K_minus.T)


def write_fp16_table(path):
    """Relative L2 error of A_qk and of the whole forward with fp16 operands, against float64."""
    rows = []
    for lower in (0.9, 0.5, 0.3):
        x = _inputs(1, 256, 2, 64, 64, seed=1, gate_range=(lower, 0.999))
        expected = recurrent(x.q, x.k, x.v, x.g, x.beta)
        o, _ = recurrence(prepare(x.q, x.k, x.v, x.g, x.beta, 64, SUB_BLOCK, np.float16), 32)
        Q, K = x.q[0, :64, 0], x.k[0, :64, 0]
        gamma = np.cumsum(x.g[0, :64, 0], axis=0)
        exact = intra_chunk_scores(Q, K, gamma, SUB_BLOCK)[1]
        anchored = error_report(intra_chunk_scores(Q, K, gamma, SUB_BLOCK, np.float16)[1], exact).rel_l2
        chunk_start = error_report(_chunk_start_scores_fp16(Q, K, gamma)[1], exact).rel_l2
        rows.append((f"[{lower}, 0.999]", f"{chunk_start:.2e}", f"{anchored:.2e}", f"{error_report(o, expected).rel_l2:.2e}"))
    path.write_text(
        banner(SOURCE) + "B = 1, N = 256, H = 2, d_k = d_v = 64, C = 64; relative L2 against float64. \"nan\": an fp16 "
        "operand overflowed to inf. The last column is reference.prepare with operand_dtype=np.float16 (every cast "
        "the prepare kernel makes), then the recurrence in float64.\n\n"
        + markdown_table(["gates a in", "A_qk, chunk-start split, fp16", "A_qk, anchored, fp16",
                          "output, fp16 prepare mirror"], rows))


# --8<-- [start:bytes]
def bytes_per_token(D=128, C=64, element=2, block_dv=32):
    """Bytes each kernel moves per token and head (d_k = d_v = D), counting HBM traffic once per
    tensor (the d_v / block_dv programs of a head read W, Q e^gamma, K e^{gamma_C - gamma} and A_qk
    at about the same time, from L2)."""
    return {
        "prepare reads q, k, v, g, beta": 3 * D * element + 4 * D + 4,
        "prepare writes W, U, Q e^gamma, K e^(gamma_C - gamma), A_qk, e^gamma_C": 4 * D * element + C * element + 4 * D / C,
        "recurrence reads them": 4 * D * element + C * element + 4 * D / C,
        "recurrence writes o": D * element,
        "a separate output kernel would add: per-chunk states S^T written and read": 2 * D * D * element / C,
        "... and V_new written and read": 2 * D * element,
    }
# --8<-- [end:bytes]


def write_bytes_table(path):
    """bytes_per_token beside the forward's least traffic at each benchmark shape, as the committed
    benchmark run counted it (bench.csv's bytes: q, k, v, g, beta in, o out), and their times at
    DESIGN.md's copy bandwidth (the bandwidth of bench.csv's memory bound)."""
    from kdacourse import results

    bandwidth = results.DESIGN_COPY_BANDWIDTH
    least = {}  # (B, N, H): bytes the forward must move, from the benchmark's rows at d = 128
    for row in results.read_rows(results.RESULTS / "bench.csv"):
        if row["stage"] == "s05_fast_kda" and row["dtype"] == "bfloat16" and row["D"] == "128" and row["bytes"]:
            least[results.shape_of(row)[:3]] = int(row["bytes"])
    bounds = {int(moved) / (B * N * H) for (B, N, H), moved in least.items()}
    if len(bounds) != 1:
        raise ValueError(f"bench.csv's stage 5 rows count {sorted(bounds)} bytes a token and head: one expected")
    bound, = bounds
    per_token = bytes_per_token()
    ours = sum(list(per_token.values())[:4])
    rows = [(name, f"{value:.0f}") for name, value in per_token.items()]
    rows += [("**both kernels**", f"**{ours:.0f}**"), ("the forward's least traffic (inputs once, output once)", f"{bound:.0f}")]

    def milliseconds(B, N, H, bytes_per_token_and_head):
        return f"{B * N * H * bytes_per_token_and_head / bandwidth * 1e3:.3f}"

    shapes = [(f"B={B}, N={N}, H={H}", milliseconds(B, N, H, ours), milliseconds(B, N, H, bound))
              for B, N, H in least]
    path.write_text(
        banner(SOURCE) + "Per token and head, d_k = d_v = 128, C = 64, bf16 tensors, fp32 gates.\n\n"
        + markdown_table(["traffic", "bytes per token"], rows)
        + f"\nAt {bandwidth / 1e12:.1f} TB/s (what a device-to-device copy reached on the H200; its HBM3e is "
        f"specified for {results.SPECIFIED_BANDWIDTH / 1e12:.1f}), the time that traffic alone takes at the "
        "benchmark's shapes (benchmarks/results/bench.csv):\n\n"
        + markdown_table(["shape", "both kernels (ms)", "least traffic (ms)"], shapes))


ADOPTED_VARIANT = "tf32_diagonal_bf16"  # what stages/s05_fast_kda/kernel.py's prepare kernel is now
PREPARE_VARIANTS = {  # archive/studies/s05_variants.py's variants, in its order: what each changes
    'committed': (
        'The committed kernel rebuilt here with every switch off: the control (its time should equal '
        "stages.s05_fast_kda.kernel.build_prepare_program's)."),
    'vectorized_slabs': (
        'The anchored-operand passes with less shared-memory traffic: the slab loop unrolled at build time, '
        'so each slab pass has a static extent and vectorizes (4-wide float4/uint2 accesses instead of scalar'
        ' ones, whose 4-byte gamma reads were 4-way bank conflicted), one pass per slab and channel pass for '
        'the row and the column operands; every pass reads gamma and K once per element'),
    'vectorized_kg': (
        'vectorized_slabs, and K e^gamma written to its own buffer (which takes the bytes of the dead K_row_s'
        ' and K_col_s, so shared memory stays 105 KiB) instead of K_s in place: the in-place pass had a '
        '__syncthreads in each of its 8 unrolled steps, gone here.'),
    'staged_wu': (
        'vectorized_kg, and W, U staged in shared memory (in the bytes of Q_s/V_s and K_s, dead by then: '
        'still 105 KiB) and written out by TMA stores of whole rows'),
    'staged_all': (
        'staged_wu, and A_qk staged too (the diagonal blocks were 2-byte stores over 8 rows per instruction) '
        'and written by one TMA store after the slabs'),
    'slabs_early_v': (
        'vectorized_slabs, and V loaded from HBM into registers at the start (16 registers a thread), moved '
        "to shared memory where the committed kernel loads it: the load's latency overlaps the score passes "
        'instead of standing between the decayed pass and the block inverse.'),
    'paired': (
        'staged_all, and the GEMMs that share an operand issued together and waited for once (the score GEMMs'
        ' of the diagonal blocks, the W and U GEMMs): 3 waits fewer a chunk.'),
    'paired_slabs': "paired, and the slabs' score GEMMs paired too: 9 waits fewer a chunk.",
    'fp16_scores': (
        "staged_all, and with bf16 inputs every score GEMM's anchored operands in fp16 (3 more mantissa bits,"
        ' the same bytes)'),
    'fp16_slabs': (
        "staged_all, and with bf16 inputs the off-diagonal slabs' anchored operands in fp16, in buffers of "
        'their own, where every factor is a product of gates (<= 1) and fp16 cannot overflow; the diagonal '
        'blocks, whose factors reach a_min^{-8}, keep bf16 operands'),
    'tf32_diagonal': (
        "fp16_slabs, and the diagonal blocks' anchored operands in fp32, read by the tensor cores as TF32: "
        'the precision fp16_scores gave the diagonal, without its overflow'),
    'tf32_diagonal_bf16': (
        'tf32_diagonal for bf16 inputs only; fp16 inputs keep fp16 diagonal operands, as fp16_slabs'),
}
RECURRENCE_VARIANTS = {  # archive/studies/s05_recurrence_variants.py's: what each changes
    'committed': 'The committed kernel rebuilt here with every switch off: the control',
    'paired': 'Two waits a chunk: (W S^T, Q e^gamma S^T) together, then (K^T V_new, A_qk V_new) together',
    'paired_staged_o': 'paired, and o staged in shared memory for a TMA store of whole rows',
    'staged_o': 'o staged in shared memory for a TMA store of whole rows; the GEMMs as committed',
}
RECURRENCE_BLOCK_DV = 32  # value columns a program, in the recurrence the study started from


def write_variants_table(path):
    """The prepare kernel's variants as measured on the H200 (the archived study s05_variants, committed
    results in benchmarks/results/s05_variants.csv): each step's time, its speed-up over the kernel
    it started from, the two kernels against FLA, and how far its outputs are from the old kernel's."""
    from kdacourse import results

    summary = results.prepare_variants(results.read_rows(results.RESULTS / "s05_variants.csv"))
    shapes = sorted(summary)
    header = ["variant", "what it changes"] + [f"prepare (ms), B={B} N={N} H={H}" for B, N, H, _ in shapes] + \
        ["speed-up of prepare"] + [f"FLA / both kernels, B={B} N={N}" for B, N, _, _ in shapes] + ["outputs vs the old kernel"]
    rows = []
    base = [summary[shape]["committed"][0] for shape in shapes]
    for name, what in PREPARE_VARIANTS.items():
        if any(name not in summary[shape] for shape in shapes):
            continue  # measured in a later run: write_later_variants_table
        prepare = [summary[shape][name][0] for shape in shapes]
        error = max(summary[shape][name][3] for shape in shapes)
        rows.append([f"**{name}** (adopted)" if name == ADOPTED_VARIANT else name,
                     what,
                     *(f"{t:.3f}" for t in prepare),
                     " / ".join(f"{b / t:.2f}x" for b, t in zip(base, prepare)),
                     *(f"{summary[shape][name][2] / summary[shape][name][1]:.2f}" for shape in shapes),
                     "bitwise equal" if error == 0 else f"rel L2 {error:.1e}"])
    path.write_text(banner("kdacourse/pages/s05_fast_kda.py") + results.study_command("s05_variants", "--out DIR")
                    + ".\n\n" + markdown_table(header, rows))


def write_later_variants_table(path):
    """The variants tried after the adopted one, measured on the H200 on 2026-12-01: the prepare
    kernel's paired GEMMs (benchmarks/results/s05_variants_paired.csv, against staged_all, the
    committed kernel then) and the recurrence's (the archived study s05_recurrence_variants,
    benchmarks/results/s05_recurrence_variants.csv, against the recurrence committed then)."""
    from kdacourse import results

    prepare = results.prepare_variants(results.read_rows(results.RESULTS / "s05_variants_paired.csv"))
    medians = results.recurrence_variants(results.read_rows(results.RESULTS / "s05_recurrence_variants.csv"))
    shapes = sorted(prepare)
    header = ["kernel", "variant", "what it changes"] + [f"ms, B={B} N={N} H={H}" for B, N, H, _ in shapes] + \
        ["speed-up"]
    rows = []
    for name in ("staged_all", "paired", "paired_slabs"):
        times = [prepare[shape][name][0] for shape in shapes]
        base = [prepare[shape]["staged_all"][0] for shape in shapes]
        rows.append(["prepare", name, PREPARE_VARIANTS[name].rstrip("."),
                     *(f"{t:.3f}" for t in times), " / ".join(f"{b / t:.2f}x" for b, t in zip(base, times))])
    for name, per_shape in medians.items():
        base_name, _, columns = name.partition("_dv")
        what = f"{RECURRENCE_VARIANTS[base_name]}; {columns or RECURRENCE_BLOCK_DV} columns a program"
        rows.append(["recurrence", name, what, *(f"{per_shape[shape]:.3f}" for shape in shapes),
                     " / ".join(f"{medians['committed'][shape] / per_shape[shape]:.2f}x" for shape in shapes)])
    commands = (results.study_command("s05_variants", "--out DIR --variants staged_all,paired,paired_slabs --no-fla")
                + " and " + results.study_command("s05_recurrence_variants", "--out DIR"))
    path.write_text(banner("kdacourse/pages/s05_fast_kda.py") + f"{commands}.\n\n" + markdown_table(header, rows))


def write_accuracy_table(path):
    """What the anchored operands' dtypes changed, measured on the H200 on 2026-12-01: o's rel L2 against
    float64 at N=4096 before (bf16 operands everywhere: benchmarks/results/precision_before_tf32_diagonal.csv)
    and after (benchmarks/results/precision.csv, `python -m benchmarks.bench --stages s05 --no-timings`),
    beside FLA's; then the prepare kernel's time, staged_all against tf32_diagonal, whose bf16 program is
    the adopted one (benchmarks/results/s05_variants_accuracy.csv, the archived study s05_variants)."""
    from kdacourse import results

    def errors(name):
        return {(row["dtype"], row["gate_lower"], row["impl"]): float(row["rel_l2_vs_float64"])
                for row in results.read_rows(results.RESULTS / name)
                if row["stage"] == "s05_fast_kda" and row["N"] == "4096"}

    before, after = errors("precision_before_tf32_diagonal.csv"), errors("precision.csv")
    rows = [[dtype, f"[{lower}, 0.999]", f"{before[dtype, lower, 'ours']:.3e}", f"{after[dtype, lower, 'ours']:.3e}",
             f"{after[dtype, lower, 'fla']:.3e}", f"{before[dtype, lower, 'ours'] / before[dtype, lower, 'fla']:.2f}",
             f"{after[dtype, lower, 'ours'] / after[dtype, lower, 'fla']:.2f}"]
            for dtype in ("bfloat16", "float16") for lower in ("0.5", "0.9")]
    accuracy = markdown_table(["inputs", "gates", "ours before", "ours after", "FLA", "before / FLA", "after / FLA"], rows)
    summary = results.prepare_variants(results.read_rows(results.RESULTS / "s05_variants_accuracy.csv"))
    times = markdown_table(
        ["B, N, H", "prepare, bf16 operands (ms)", "prepare, fp32 diagonal and fp16 slab operands (ms)", "cost"],
        [(f"{B}, {N}, {H}", f"{variants['staged_all'][0]:.3f}", f"{variants['tf32_diagonal'][0]:.3f}",
          f"+{variants['tf32_diagonal'][0] - variants['staged_all'][0]:.3f} ms")
         for (B, N, H, _), variants in sorted(summary.items())])
    path.write_text(banner(SOURCE) + "o against float64, N = 4096, H = 4, d = 128 (the benchmarks page's precision "
                    "study), before and after the change:\n\n" + accuracy +
                    "\nThe prepare kernel's time in bf16, the two programs interleaved in 3 rounds (medians):\n\n" + times)


ANY_GATE_STRENGTHS = [-0.1, -1.0, -1.4, -5.0, -12.0, -100.0, -1e4]  # the log gate of tokens 1 to 8 of one channel


def _interpreted_output(x, dtype, chunk_size, anchored_only):
    """o of stage 5's prepare and recurrence programs through the tile interpreter; anchored_only builds
    them as they were before the any-gate branch (every diagonal sub-block through the anchored GEMMs)."""
    import math
    from unittest import mock

    from stages.common.interpreter import interpret
    from stages.s05_fast_kda import kernel, numerics

    B, N, H, d_k = x.q.shape
    d_v = x.v.shape[3]
    spans = {name: math.inf for name in numerics.FAST_SPAN_LOG} if anchored_only else {}
    with mock.patch.dict(numerics.FAST_SPAN_LOG, spans):
        prepare = interpret(kernel.build_prepare_program(B, N, H, d_k, d_v, chunk_size, dtype=dtype),
                            out_idx=[5, 6, 7, 8, 9, 10])
    recurrence = interpret(kernel.build_recurrence_program(B, N, H, d_k, d_v, chunk_size, d_v, dtype=dtype),
                           out_idx=[7, 8])
    o, _ = recurrence(*prepare(x.q, x.k, x.v, x.g, x.beta), np.zeros((B, H, d_k, d_v)))
    return o


def write_any_gate_table(path):
    """The failing case and the fix, through the tile interpreter on the CPU: gentle gates with one
    channel's log gates at `strength` on tokens 1 to 8, so that the first sub-block's anchored factor
    above its middle row is e^{-8 strength}; o's rel L2 against float64 (reference A) for the programs
    with the anchored GEMMs alone (before) and with the any-gate branch (after)."""
    from stages.s05_fast_kda.numerics import FAST_SPAN_LOG, score_operand_dtypes

    C = 32
    rows = []
    for strength in ANY_GATE_STRENGTHS:
        x = make_inputs(1, 2 * C, 1, 32, 32, gate="channel", gate_range=(0.9, 0.999), beta_range=(0.0, 1.0), seed=5)
        x.g[0, 1:9, 0, 3] = strength
        expected = recurrent(x.q, x.k, x.v, x.g, x.beta)
        row = [f"{strength:g}", f"{-8 * strength:g}"]
        for dtype in ("float16", "bfloat16"):
            takes_gemms = -8 * strength <= FAST_SPAN_LOG[score_operand_dtypes(dtype)[0]]
            errors = []
            for anchored_only in (True, False):
                o = _interpreted_output(x, dtype, C, anchored_only)
                errors.append(f"{error_report(o, expected).rel_l2:.2e}" if np.all(np.isfinite(o)) else "NaN")
            row += ["GEMMs" if takes_gemms else "term by term", *errors]
        rows.append(row)
    headers = ["log gate, tokens 1-8", "span (e-folds)"] + [
        f"{name}: {column}" for name in ("fp16", "bf16") for column in ("sub-block 0 takes", "before", "after")]
    path.write_text(banner(SOURCE) + markdown_table(headers, rows))


# ---------------------------------------------------------------- the tensors as a model passes them

KIMI_D = 128  # Kimi Linear's head dims, d_k = d_v
# the layer's default call: the softplus gate, both norms, beta's sigmoid, q scaled by 1 / sqrt(d_k)
KIMI_FORM = InputForm(gate="softplus", l2_normalize=True, beta="sigmoid", scale=KIMI_D ** -0.5)
H200_SMS = 132  # the streaming multiprocessors of an H200 (and of an H100 SXM)
# DESIGN.md's shapes "as Kimi Linear calls it": name: (sequence lengths, H)
KIMI_SHAPES = {
    "T 8192, H 64": ((8192,), 64),
    "T 8192, H 96": ((8192,), 96),
    "6 sequences, 8192 tokens, H 96": ((1300, 547, 2048, 963, 271, 3063), 96),
    "8 x 1024, H 96": ((1024,) * 8, 96),
    "T 16384, H 32": ((16384,), 32),
    "T 65536, H 32": ((65536,), 32),
    "8 x 4096, H 16": ((4096,) * 8, 16),
}
KIMI_TABLE_SHAPE = KIMI_SHAPES["T 8192, H 96"]  # where the bytes table gives whole megabytes


# --8<-- [start:torch_passes]
def torch_passes(d=KIMI_D, element=2):
    """{pass: (bytes read, bytes written) per token and head} of the five elementwise passes a caller
    runs in front of kernels that take the recurrence's own q, k, g and beta, from bf16 tensors (an
    element of `element` bytes) with g and beta out in fp32, each pass one kernel that reads its input
    once and writes its output once (eager torch takes more than one kernel for most of them: a floor).
    A_log and dt_bias are read once a head for the whole call, nothing per token."""
    return {
        "q's L2 norm: q in, q out": (d * element, d * element),
        "k's L2 norm: k in, k out": (d * element, d * element),
        "q's scale: q in, q out": (d * element, d * element),
        "the gate: x in, g out (fp32)": (d * element, 4 * d),
        "beta's sigmoid: the logit in, beta out (fp32)": (element, 4),
    }
# --8<-- [end:torch_passes]


def prepare_bytes_per_token(form_options, chunk_size, d=KIMI_D):
    """{global buffer: bytes read and written per token and head} of the prepare kernel as
    stages.common.program_cost counts it, built for bf16 inputs with `form_options` (two chunks of two
    heads: every count grows with chunks x heads)."""
    from stages.common.program_cost import program_cost
    from stages.s05_fast_kda.kernel import build_prepare_program

    N, H = 2 * chunk_size, 2
    cost = program_cost(build_prepare_program(1, N, H, d, d, chunk_size, dtype="bfloat16", **form_options))
    return {name: moved / (N * H) for name, moved in cost.bytes_by_buffer.items()}


def write_fusion_bytes_table(path):
    """Bytes per token and head of the forward's prepare on the recurrence's tensors (after the five
    passes) and on the model's (the form inside), counted from the programs; the totals at one of the
    Kimi shapes, and their time at DESIGN.md's copy bandwidth."""
    from kdacourse import results

    from stages.kda.config import default_chunk_size

    lengths, H = KIMI_TABLE_SHAPE
    C = default_chunk_size(len(lengths), H)  # the forward's chunk at that shape
    passes = torch_passes()
    plain = prepare_bytes_per_token({}, C)
    fused = prepare_bytes_per_token(dict(form=KIMI_FORM, gate_dtype="bfloat16", beta_dtype="bfloat16"), C)
    pass_rows = [(name, f"{read:.0f}", f"{written:.0f}", f"{read + written:.0f}") for name, (read, written) in passes.items()]
    passes_total = sum(read + written for read, written in passes.values())
    pass_rows.append(("**the five passes**", "", "", f"**{passes_total:.0f}**"))
    inputs = [name for name in fused if name not in plain] + [name for name in plain]
    prepare_rows = [(name, f"{plain.get(name, 0):.0f}", f"{fused.get(name, 0):.0f}") for name in inputs]
    plain_total, fused_total = sum(plain.values()), sum(fused.values())
    prepare_rows.append(("**the prepare kernel**", f"**{plain_total:.0f}**", f"**{fused_total:.0f}**"))
    before, after = passes_total + plain_total, fused_total
    tokens = sum(lengths) * H
    bandwidth = results.DESIGN_COPY_BANDWIDTH

    def at_the_shape(per_token):
        return f"{per_token * tokens / 1e6:.0f} MB, {per_token * tokens / bandwidth * 1e6:.0f} µs"

    totals = markdown_table(["", "bytes per token and head", f"T = {sum(lengths)}, H = {H}"],
                            [("five passes, then the prepare", f"{before:.0f}", at_the_shape(before)),
                             ("the prepare on the model's tensors", f"{after:.0f}", at_the_shape(after)),
                             ("saved", f"{before - after:.0f}", at_the_shape(before - after))])
    # A_log (H,) and dt_bias (H, d_k) are a few hundred bytes: a count past one read of both a chunk
    # ((d_k + 1) * 4 bytes over C tokens) means the program reads them once per lane that uses them
    per_lane = [name for name in ("A_log", "Dt_bias") if fused.get(name, 0) > (KIMI_D + 1) * 4 / C]
    note = (f"\n{' and '.join(per_lane)} {'are' if len(per_lane) > 1 else 'is'} read from global memory once for "
            "every element of the gate's loop that uses it, as the program is written (the count charges every "
            "read; the L1 cache serves the repeats): read once per chunk into shared memory, as exercise "
            "s05.fused_loads asks, the rows would count d_k * 4 + 4 bytes a chunk.\n" if per_lane else "")
    path.write_text(
        banner(SOURCE) + f"d_k = d_v = {KIMI_D}, bf16 q, k, v, C = {C} (the forward's chunk at T = {sum(lengths)}, "
        f"H = {H}). The passes a caller runs in front of "
        "kernels that take q, k, g and beta as the recurrence does (`torch_passes`), per token and head:\n\n"
        + markdown_table(["pass", "bytes read", "bytes written", "both"], pass_rows)
        + "\nThe prepare kernel's global traffic per token and head, read and written, by buffer "
        "(stages.common.program_cost on the program built without a form and with Kimi Linear's: the "
        "softplus gate from a bf16 x, both norms, beta's sigmoid from a bf16 logit):\n\n"
        + markdown_table(["buffer", "on the recurrence's tensors (g, beta fp32)", "on the model's tensors"],
                         prepare_rows)
        + note + f"\nIn all, and at DESIGN.md's copy bandwidth ({bandwidth / 1e12:.2f} TB/s):\n\n" + totals)


# FlashKDA's design, as MoonshotAI/FlashKDA's docs/20260420-flashkda-v1-deep-dive.md and its
# flash_kda.fwd (csrc/flash_kda.cpp, csrc/smxx/fwd_launch.cu) give it
FLASHKDA_SOURCE = "MoonshotAI/FlashKDA: docs/20260420-flashkda-v1-deep-dive.md, flash_kda/__init__.py, csrc/smxx/fwd_launch.cu"
FLASHKDA_CHUNK = 16


def write_design_table(path):
    """The course's forward beside FlashKDA's, choice by choice; the course's column from its own
    constants."""
    from stages.kda.config import (DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE, MANY_SEQUENCE_HEADS, SUB_BLOCK,
                                   default_chunk_size, default_prepare_threads)

    C, small_C = DEFAULT_CHUNK_SIZE, default_chunk_size(MANY_SEQUENCE_HEADS, 1)
    rows = [
        ("kernels", "two: the prepare (token-parallel, one program per chunk and head) and the recurrence "
         "(one per value block, head and sequence)",
         "two: K1 (token-parallel, one program per chunk and head) and K2 (one per head and sequence)"),
        ("what the first kernel does", "the gate, the norms and beta's sigmoid as it loads a chunk, the "
         "cumulative gates, the anchored scores, the block inverse, W and U",
         "the gate's activation, the L2 norms, the decays, L and M_qk, the inverse"),
        ("chunk", f"{C} tokens, {small_C} from {MANY_SEQUENCE_HEADS} sequence-heads on (the forward), in "
         f"sub-blocks of {SUB_BLOCK}", f"{FLASHKDA_CHUNK} tokens"),
        ("exponents in range", "anchored at each sub-block's middle row and below each slab; a sub-block past "
         "the operands' range taken term by term: any gate <= 0",
         "a chunk of 16 keeps exp(cumsum(g)) within bf16 at lower_bound = -5: the gate must be bounded"),
        ("the triangular inverse", f"C x C in fp32, by {SUB_BLOCK} x {SUB_BLOCK} blocks (substitution, then "
         "TF32 merges)", f"{FLASHKDA_CHUNK} x {FLASHKDA_CHUNK} by a Neumann series, in fp16"),
        ("the state on chip", f"fp32 registers, {DEFAULT_BLOCK_DV} or {2 * DEFAULT_BLOCK_DV} value columns a "
         "program", "bf16, updated with fp32 FMAs, all 128 value columns a program"),
        ("gates taken", "the log gate itself, or either of FLA's raw forms (softplus, unbounded; sigmoid, bounded)",
         "the bounded form only, lower_bound in [-5, 0]"),
        ("exp, sigmoid", "exp2 of fp32, sigmoid as 1 / (1 + exp2(-x log2 e))", "ex2.approx, sigmoid from tanh.approx"),
        ("threads", f"prepare {default_prepare_threads(C)} at C = {C}, {default_prepare_threads(small_C)} at "
         f"{small_C}", "K1 256, launch bounds for 8 blocks an SM (some spills accepted)"),
        ("backward", "yes (stage 6)", "no: a forward"),
        ("dtypes, sizes", "fp16 or bf16; d_k, d_v multiples of 32; grouped value heads",
         "bf16; d_k = d_v = 128; q, k and v with the same heads"),
    ]
    path.write_text(banner(SOURCE) + f"FlashKDA's column from {FLASHKDA_SOURCE}.\n\n"
                    + markdown_table(["", "the course", "FlashKDA"], rows))


def kernel_programs(lengths, H, d=KIMI_D, num_sms=H200_SMS):
    """{kernel: programs in its grid} at one shape, sequences of `lengths` tokens and H heads, and the
    course's chunk and value columns there: the course's prepare (chunks x heads) and recurrence
    (sequences x heads x value blocks), at the chunk and width the forward resolves for the shape
    (stages.kda.config.resolve), FlashKDA's K1 (chunks of 16 x heads) and K2 (sequences x heads)."""
    from stages.kda.config import resolve

    def chunks(size):
        return sum(-(-n // size) for n in lengths)

    config = resolve(len(lengths), H, d, d, num_sms)
    return {"course chunk": config.chunk_size, "course value columns": config.block_dv,
            "course prepare": chunks(config.chunk_size) * H,
            "course recurrence": len(lengths) * H * (d // config.block_dv),
            "FlashKDA K1": chunks(FLASHKDA_CHUNK) * H,
            "FlashKDA K2": len(lengths) * H}


def write_parallelism_table(path):
    """Programs per kernel at DESIGN.md's Kimi shapes, and each sequential kernel's against the SMs."""
    rows = []
    for name, (lengths, H) in KIMI_SHAPES.items():
        programs = kernel_programs(lengths, H)
        rows.append([name, *(f"{count}" for count in programs.values()),
                     *(f"{programs[kernel] / H200_SMS:.2f}" for kernel in ("course recurrence", "FlashKDA K2"))])
    path.write_text(banner(SOURCE) + f"Programs in each kernel's grid, d = {KIMI_D}, the course's chunk and value "
                    "columns a program as its forward resolves them for the shape; the last two columns: the "
                    f"sequential kernels' programs per SM of an H200 ({H200_SMS} SMs; below 1, SMs idle for the whole "
                    "kernel).\n\n"
                    + markdown_table(["shape", "course chunk", "course value columns", "course prepare",
                                      "course recurrence", "FlashKDA K1", "FlashKDA K2", "course recurrence / SMs",
                                      "FlashKDA K2 / SMs"], rows))


def write_kimi_call_table(path, folder=None):
    """The call as Kimi Linear makes it, FLA's, FlashKDA's and the course's, from the committed run of
    `python -m benchmarks.kimi_call` (benchmarks/results/kimi_call/ unless `folder`)."""
    from kdacourse import results

    run = results.kimi_call_run(results.KIMI_CALL if folder is None else folder)
    if run is None:
        path.write_text(not_yet_run("python -m benchmarks.kimi_call --out DIR",
                                    f"DIR/{results.KIMI_CALL_CSV}, {results.KIMI_CALL_META} and "
                                    f"{results.KIMI_CALL_ACCURACY}",
                                    "benchmarks/results/kimi_call/"))
        return
    measured = [("fla", "call"), ("flashkda", "call"), ("course", "call"), ("course", "call_unchecked"),
                ("fla", "kernels"), ("flashkda", "kernels"), ("course", "kernels")]
    labels = {"call": "call", "call_unchecked": "call, checks off", "kernels": "graph"}
    names = {"fla": "FLA", "flashkda": "FlashKDA", "course": "course"}
    shape = [f"{case.tokens} tokens in {case.sequences}, H {case.H}" if case.sequences > 1 else
             f"T {case.tokens}, H {case.H}" for case in run.cases.values()]
    times = markdown_table(["shape", *(f"{names[impl]} {labels[what]} (ms)" for impl, what in measured)],
                           [[label, *(spread_cell(case.times.get(key)) for key in measured)]
                            for label, case in zip(shape, run.cases.values())])
    ratios = markdown_table(["shape", *results.KIMI_CALL_RATIOS],
                            [[label, *(spread_cell(case.ratios[name], "{:.2f}") for name in results.KIMI_CALL_RATIOS)]
                             for label, case in zip(shape, run.cases.values())])
    missing = sorted({f"{names[impl]} {labels.get(what, what)}: {why}" for case in run.cases.values()
                      for (impl, what), why in case.missing.items()})
    accuracy = ""
    if run.accuracy:
        accuracy = ("\nAgainst a float64 recurrence on the same tensors activated exactly (relative L2):\n\n"
                    + markdown_table(["", "o", "final state"], [(names.get(impl, impl), f"{o:.2e}", f"{state:.2e}")
                                                                for impl, (o, state) in run.accuracy.items()]))
    path.write_text(
        banner(SOURCE) + f"{results.kimi_call_provenance(run)}; medians over the rounds (min to max):\n\n" + times
        + "\nThe course's speed-up on each peer, round by round (above 1: the course is faster):\n\n" + ratios
        + ("\nNot measured: " + "; ".join(missing) + ".\n" if missing else "") + accuracy)


PROGRAMS_PER_SM_VARIANTS = {  # archive/studies/kda_recurrence_programs_per_sm.py's: value columns, programs an SM
    "dv64": "64 columns, 1 an SM (today's)", "dv64_pp2": "64 columns, 2 an SM", "dv32": "32 columns, 1 an SM",
    "dv32_pp2": "32 columns, 2 an SM", "dv32_pp3": "32 columns, 3 an SM",
    "dv32_pp3_mma_state": "32 columns, 3 an SM, no wgmma", "dv64_pp2_mma_state": "64 columns, 2 an SM, no wgmma",
    "dv64_plain_o_store": "64 columns, 1 an SM, o stored by the threads",
    "dv64_pp2_plain_o_store": "64 columns, 2 an SM, o stored by the threads",
    "dv32_pp3_plain_o_store": "32 columns, 3 an SM, o stored by the threads",
    "dv32_pp3_no_ws": "32 columns, 3 an SM, no TMA, no loading warp group"}


def write_programs_per_sm_table(path):
    """The fused call with the recurrence at one, two or three programs an SM, beside FlashKDA, and how
    often o changed from call to call (the committed run of the archived study)."""
    from kdacourse import results

    times, repeats, meta = results.programs_per_sm_run()
    variants = [v for v in PROGRAMS_PER_SM_VARIANTS if any(v in case for case in times.values())]
    rows = []
    for case, measured in times.items():
        flashkda = measured["flashkda"][0]
        rows.append([case, *(f"{measured[v][0]:.3f} ({flashkda / measured[v][0]:.2f}x)" if v in measured else "–"
                             for v in variants), f"{flashkda:.3f}"])  # "–": a variant not built for the case
    repeat_rows = [[case, PROGRAMS_PER_SM_VARIANTS[variant], f"{differ} of {calls}", f"{error:.2e}"]
                   for (case, variant), (differ, calls, error) in repeats.items()]
    path.write_text(
        banner(SOURCE) + f"{results.provenance(meta)}, benchmarks/results/{results.PROGRAMS_PER_SM.name}/: the fused "
        "call, checks off, as one CUDA graph, medians of three interleaved rounds in ms (FlashKDA's time over the "
        "course's):\n\n"
        + markdown_table(["case", *(PROGRAMS_PER_SM_VARIANTS[v] for v in variants), "FlashKDA"], rows)
        + "\nEach variant called 30 times more: the calls whose o differs from its first call's, and its first "
        "call's o against float64 (relative L2):\n\n"
        + markdown_table(["case", "recurrence", "calls that differ", "o against float64"], repeat_rows))


STORED_IN = {"float32": "fp32", "bfloat16": "bf16"}
# N, d_k = d_v, the window of tokens each error is taken over: head dims of 64 keep the study about a
# second of a CPU (it is regenerated with every check of the site)
STORED_STATE_SHAPE = (2048, 64, 256)


def write_stored_state_table(path):
    """stored_state_study's errors of o, in three windows of 256 tokens, and of the final state."""
    from stages.s05_fast_kda.numerics import STATE_STUDY_GATES, STATE_STUDY_STORES, stored_state_study

    N, d, window = STORED_STATE_SHAPE
    found = stored_state_study(N=N, d=d, window=window)
    shown = [0, 1024 // window - 1, N // window - 1]  # the windows that end at tokens 256, 1024 and N
    rows = []
    for gates in STATE_STUDY_GATES:
        for chunk_size, dtype in STATE_STUDY_STORES:
            windows, state = found[gates, chunk_size, dtype]
            rows.append([gates, f"{chunk_size}", STORED_IN[dtype],
                         *(f"{windows[i]:.1e}" for i in shown), f"{state:.1e}"])
    headers = [f"o, tokens {i * window + 1}-{(i + 1) * window}" for i in shown]
    path.write_text(
        banner(SOURCE) + f"`forward_with_stored_state` (stages/s05_fast_kda/numerics.py): one head per gate range, "
        f"d_k = d_v = {d}, N = {N}, unit q and k, v ~ N(0, 1), beta in [0.1, 0.9]; relative L2 against the same "
        "loop with the state stored exactly.\n\n"
        + markdown_table(["gates", "chunk", "state stored in", *headers, "final state"], rows))


def generated_files():
    return {
        "docs/generated/s05_errors.md": write_error_table,
        "docs/generated/s05_identities.md": write_identities_table,
        "docs/generated/s05_compile_report.md": write_compile_report,
        "docs/generated/s05_anchor_range.md": write_anchor_table,
        "docs/generated/s05_anchor_range.svg": write_anchor_plot,
        "docs/generated/s05_fp16.md": write_fp16_table,
        "docs/generated/s05_bytes.md": write_bytes_table,
        "docs/generated/s05_variants.md": write_variants_table,
        "docs/generated/s05_later_variants.md": write_later_variants_table,
        "docs/generated/s05_accuracy.md": write_accuracy_table,
        "docs/generated/s05_any_gate.md": write_any_gate_table,
        "docs/generated/s05_fusion_bytes.md": write_fusion_bytes_table,
        "docs/generated/s05_flashkda_design.md": write_design_table,
        "docs/generated/s05_parallelism.md": write_parallelism_table,
        "docs/generated/s05_kimi_call.md": write_kimi_call_table,
        "docs/generated/s05_programs_per_sm.md": write_programs_per_sm_table,
        "docs/generated/s05_stored_state.md": write_stored_state_table,
    }
