"""Stage 2's generated files: the error table of references B and C against A, the identities
table, the kernel's compile-only report at a few tile sizes, the numerics tables and their plot."""

import numpy as np

from kdacourse.pages.stage_tables import compile_report_table, identities_table
from kdacourse.pages.tables import ROUNDING_NOTE, banner, markdown_table, rounding_level, save_svg
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.s01_linear_attention import reference as stage1
from stages.s02_scalar_decay import numerics
from stages.s02_scalar_decay.reference import chunkwise, kernel_mirror, recurrent

SOURCE = "kdacourse/pages/s02_scalar_decay.py"

# B, N, H, d_k, d_v, chunk_size, block_dv: one chunk, many chunks, a padded last chunk, a realistic head
ERROR_TABLE_SHAPES = [
    (2, 16, 2, 4, 4, 16, 2),
    (2, 64, 2, 4, 4, 8, 2),
    (2, 50, 2, 8, 8, 16, 4),
    (1, 256, 2, 64, 64, 64, 32),
]
# The seed's statement: the factorized table gives NaN in fp16 from this alpha down, at this C;
# and the gate values its stage 4 table samples (stage 2's grid is not printed in the seeds).
SEED_NAN_ALPHA, SEED_CHUNK_SIZE = 0.8, 64
SEED_GATE_GRID = (0.999, 0.99, 0.95, 0.9, 0.8, 0.5)


def write_error_table(path):
    rows = []
    for B, N, H, d_k, d_v, C, block_dv in ERROR_TABLE_SHAPES:
        x = make_inputs(B, N, H, d_k, d_v, gate="head", seed=0)
        expected = recurrent(x.q, x.k, x.v, x.g)
        shape = f"B={B}, N={N}, H={H}, d_k={d_k}, d_v={d_v}, C={C}, block_dv={block_dv}"
        for name, actual in (("B chunkwise", chunkwise(x.q, x.k, x.v, x.g, C).o),
                             ("C kernel mirror", kernel_mirror(x.q, x.k, x.v, x.g, C, block_dv))):
            error = error_report(actual, expected)
            rows.append((shape, f"{name} vs A", rounding_level(error.max_abs), rounding_level(error.rel_l2)))
        no_decay = np.zeros(H)
        error = error_report(kernel_mirror(x.q, x.k, x.v, no_decay, C, block_dv),
                             stage1.kernel_mirror(x.q, x.k, x.v, C, block_dv))
        # the same products in the same order (e^0 = 1 exactly): equal bits on any machine
        rows.append((shape, "C with g = 0 vs stage 1's C", f"{error.max_abs:.2e}", f"{error.rel_l2:.2e}"))
    path.write_text(banner(SOURCE) + markdown_table(["shape", "comparison", "max abs error", "relative L2"], rows)
                    + "\n" + ROUNDING_NOTE)


def write_identities_table(path):
    from stages.s02_scalar_decay.identities import IDENTITIES

    path.write_text(identities_table(IDENTITIES, SOURCE))


# The compile-only test's shape, at the default tiles and at the ones a tuner would try first: a
# wider value block (fewer programs, a bigger state fragment each), and a longer chunk (C x C tiles
# four times larger: the scores and the decay table), with 128 threads and then with 256.
COMPILE_SHAPE = dict(B=2, N=1024, H=4, d_k=128, d_v=128)
COMPILE_TILES = [(64, 32, 128), (64, 64, 128), (128, 32, 128), (128, 32, 256)]  # (chunk_size, block_dv, threads)


def write_compile_report(path):
    from stages.s02_scalar_decay.kernel import compile_report

    reports = [({"chunk_size": C, "block_dv": block_dv, "threads": threads},
                compile_report(**COMPILE_SHAPE, chunk_size=C, block_dv=block_dv, threads=threads))
               for C, block_dv, threads in COMPILE_TILES]
    path.write_text(compile_report_table(reports, SOURCE))


def write_factorized_vs_ratio(path):
    rows = []
    for row in numerics.factorized_vs_ratio():
        rows.append((
            f"{row['alpha']:g}",
            f"{row['largest_factor']:.3g}",
            row["factorized_nonfinite"],
            _error(row["factorized_error"]),
            _error(row["ratio_error"]),
            "yes" if row["factorized_fp32_finite"] else "**no**",
        ))
    C = numerics.CHUNK_SIZE
    fp16_max = float(np.finfo(np.float16).max)
    threshold16 = numerics.overflow_threshold(C, np.float16)
    threshold32 = numerics.overflow_threshold(C, np.float32)
    seed_finite = min(a for a in SEED_GATE_GRID if a > SEED_NAN_ALPHA)
    path.write_text(
        banner(SOURCE)
        + markdown_table(
            ["alpha", "largest factor alpha^(-C)", "non-finite entries, factorized fp16",
             "fp16 intra-chunk rel L2, factorized", "fp16 intra-chunk rel L2, ratio", "factorized finite in fp32"],
            rows)
        + f"\nC = {C}, one chunk, d_k = d_v = {numerics.HEAD_DIM}; inputs and decayed scores in fp16, products and "
          f"accumulation in fp32, against float64 with the exact table.\n\n"
        + f"The factorized table leaves fp16 at alpha < {threshold16:.4f} (bisection; the closed form "
          f"{fp16_max:g}^(-1/C) = {fp16_max ** (-1 / C):.4f}), and fp32 at alpha < {threshold32:.4f}. "
          f"The seed reports NaN for alpha <= {SEED_NAN_ALPHA:g} at C = {SEED_CHUNK_SIZE}, on a grid of "
          f"gate values ({', '.join(f'{a:g}' for a in SEED_GATE_GRID)} in its stage 4 table) whose "
          f"next value up, {seed_finite:g}, is finite: the same threshold, seen at a coarser step.\n"
    )


def write_chunk_reset_range(path):
    rows = []
    for row in numerics.cumulative_product_range():
        rows.append((
            f"{row['alpha']:g}", row["N"],
            f"{row['smallest']:.3g}", _stored(row["smallest_fp16"]), _stored(row["smallest_fp32"]),
            f"{row['largest']:.3g}", _stored(row["largest_fp16"]), _stored(row["largest_fp32"]),
            f"{row['log_spacing_fp32']:.2g}",
            f"[{row['per_chunk_smallest']:.3g}, 1]",
        ))
    path.write_text(
        banner(SOURCE)
        + markdown_table(
            ["alpha", "N", "alpha^N", "in fp16", "in fp32", "alpha^(-N)", "in fp16", "in fp32",
             "fp32 spacing at N log(alpha)", f"per chunk (C = {numerics.CHUNK_SIZE})"],
            rows)
    )


def write_numerics_plot(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    C = numerics.CHUNK_SIZE
    fp16_max, fp32_max = float(np.finfo(np.float16).max), float(np.finfo(np.float32).max)
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))

    alphas = np.linspace(0.2, 0.999, 400)
    left.semilogy(alphas, alphas ** -C, label=r"factorized: largest factor $\alpha^{-C}$")
    left.semilogy(alphas, np.ones_like(alphas), label=r"ratio: largest entry $\alpha^0 = 1$")
    left.axhline(fp16_max, color="C3", linestyle="--", label="fp16 largest finite")
    left.axhline(fp32_max, color="C4", linestyle=":", label="fp32 largest finite")
    left.axvline(numerics.overflow_threshold(C, np.float16), color="C3", linewidth=0.8,
                 label="fp16 overflow threshold")
    left.set_xlabel(r"$\alpha$")
    left.set_title(f"decay table factors, C = {C}")
    left.legend(fontsize=8, loc="upper right")

    lengths = np.geomspace(numerics.LENGTHS[0] // 4, numerics.LENGTHS[-1], 200)
    for number, alpha in enumerate(numerics.RANGE_ALPHAS):
        with np.errstate(under="ignore"):
            right.loglog(lengths, np.float64(alpha) ** lengths, color=f"C{number}",
                         label=rf"global: $\alpha^N$, $\alpha$ = {alpha:g}")
        right.axhline(alpha ** C, color=f"C{number}", linestyle="-.",
                      label=rf"reset per chunk: at least $\alpha^C$, $\alpha$ = {alpha:g}")
    right.axhline(float(np.finfo(np.float16).smallest_subnormal), color="C3", linestyle="--",
                  label="fp16 smallest subnormal")
    right.axhline(float(np.finfo(np.float32).smallest_subnormal), color="C4", linestyle=":",
                  label="fp32 smallest subnormal")
    right.set_ylim(1e-60, 10)
    right.set_xlabel("N (tokens)")
    right.set_title("smallest cumulative decay in a sequence of N tokens")
    right.legend(fontsize=8, loc="lower left")

    figure.tight_layout()
    save_svg(figure, path)
    plt.close(figure)


def _error(value):
    return "**NaN**" if np.isnan(value) else f"{value:.2e}"


def _stored(value):
    if value == 0:
        return "**0** (underflow)"
    if np.isinf(value):
        return "**inf** (overflow)"
    return f"{value:.3g}"


def generated_files():
    return {
        "docs/generated/s02_errors.md": write_error_table,
        "docs/generated/s02_identities.md": write_identities_table,
        "docs/generated/s02_compile_report.md": write_compile_report,
        "docs/generated/s02_factorized_vs_ratio.md": write_factorized_vs_ratio,
        "docs/generated/s02_chunk_reset_range.md": write_chunk_reset_range,
        "docs/generated/s02_numerics.svg": write_numerics_plot,
    }
