"""Stage 5's generated files: the error table of references B and C against A, the identities, the
two kernels' compile-only reports, the range of the anchored exponents (table and plot), the fp16
mirror of the prepare kernel, and the bytes each kernel moves."""


import numpy as np

from kdacourse.pages.stage_tables import compile_report_table, identities_table
from kdacourse.pages.tables import ROUNDING_NOTE, banner, markdown_table, rounding_level, save_svg
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
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
    }
