"""Stage 3's generated files: the error table of references B and C against A, the degenerate checks,
the small-beta limit, what the beta bugs cost, the identities, the kernel's compile-only report, and
the numerics of the triangular system (table and plot)."""

import functools

import numpy as np

from kdacourse.pages.stage_tables import compile_report_table, identities_table
from kdacourse.pages.tables import ROUNDING_NOTE, banner, markdown_table, rounding_level, save_svg
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.s03_gated_deltanet import numerics
from stages.s03_gated_deltanet.reference import chunkwise, kernel_mirror, recurrent

SOURCE = "kdacourse/pages/s03_gated_deltanet.py"
STAGE = "s03_gated_deltanet"

# B, N, H, d_k, d_v, chunk_size, block_dv: the seed's consistency shape, many chunks, a padded last
# chunk, a realistic head
ERROR_TABLE_SHAPES = [
    (2, 12, 2, 4, 4, 4, 2),
    (2, 64, 2, 4, 4, 8, 2),
    (2, 50, 2, 8, 8, 16, 4),
    (1, 256, 2, 64, 64, 64, 32),
]


def _inputs(B, N, H, d_k, d_v, seed=0, gate_range=(0.9, 0.999)):
    """The seed's inputs: a in [0.9, 0.999], beta in [0.1, 0.9], unit q and k, float64."""
    return make_inputs(B, N, H, d_k, d_v, gate="token", gate_range=gate_range, beta_range=(0.1, 0.9), seed=seed)


def write_error_table(path):
    rows = []
    for B, N, H, d_k, d_v, C, block_dv in ERROR_TABLE_SHAPES:
        x = _inputs(B, N, H, d_k, d_v)
        expected = recurrent(x.q, x.k, x.v, x.g, x.beta)
        shape = f"B={B}, N={N}, H={H}, d_k={d_k}, d_v={d_v}, C={C}, block_dv={block_dv}"
        for name, actual in (("B chunkwise", chunkwise(x.q, x.k, x.v, x.g, x.beta, C).o),
                             ("C kernel mirror", kernel_mirror(x.q, x.k, x.v, x.g, x.beta, C, block_dv))):
            error = error_report(actual, expected)
            rows.append((shape, f"{name} vs A", rounding_level(error.max_abs), rounding_level(error.rel_l2)))
    path.write_text(banner(SOURCE) + markdown_table(["shape", "comparison", "max abs error", "relative L2"], rows)
                    + "\n" + ROUNDING_NOTE)


def write_degenerate_checks(path):
    """The seed's checks at the seed's shape: g = 0 is DeltaNet; block_dv changes nothing."""
    from stages.common.oracles import delta_rule

    x = _inputs(2, 12, 2, 4, 4)
    deltanet = delta_rule(x.q, x.k, x.v, x.beta)
    zero_gate = np.zeros_like(x.g)
    rows = []
    for name, actual in (("A recurrent", recurrent(x.q, x.k, x.v, zero_gate, x.beta)),
                         ("B chunkwise", chunkwise(x.q, x.k, x.v, zero_gate, x.beta, 4).o),
                         ("C kernel mirror", kernel_mirror(x.q, x.k, x.v, zero_gate, x.beta, 4, 2))):
        error = error_report(actual, deltanet)
        rows.append(("g = 0", f"{name} vs DeltaNet (stages/common/oracles.py: delta_rule)",
                     rounding_level(error.max_abs), rounding_level(error.rel_l2)))
    expected = recurrent(x.q, x.k, x.v, x.g, x.beta)
    for block_dv in (1, 2, 4):
        error = error_report(kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 4, block_dv), expected)
        rows.append((f"block_dv = {block_dv}", "C kernel mirror vs A", rounding_level(error.max_abs),
                     rounding_level(error.rel_l2)))
    path.write_text(banner(SOURCE) + "B=2, N=12, H=2, d_k=d_v=4, C=4 (the seed's shape).\n\n"
                    + markdown_table(["check", "comparison", "max abs error", "relative L2"], rows) + "\n" + ROUNDING_NOTE)


BETA_SCALES = (1e-1, 1e-2, 1e-4, 1e-8, 1e-13)


def write_small_beta_limit(path):
    """o(eps beta) against eps times gated linear attention with values beta_j v_j, for shrinking eps."""
    from stages.common.oracles import token_gated_linear_attention

    x = _inputs(2, 12, 2, 4, 4)
    first_order = token_gated_linear_attention(x.q, x.k, x.beta[..., None] * x.v, x.g)
    rows = []
    for scale in BETA_SCALES:
        output = kernel_mirror(x.q, x.k, x.v, x.g, scale * x.beta, 4, 2)
        absolute = error_report(output, scale * first_order)
        relative = error_report(output / scale, first_order)
        rows.append((f"{scale:.0e}", f"{np.max(np.abs(output)):.2e}", f"{absolute.max_abs:.2e}",
                     f"{relative.rel_l2:.2e}"))
    path.write_text(banner(SOURCE) + "B=2, N=12, H=2, d_k=d_v=4, C=4; beta = eps x U(0.1, 0.9), "
                    "C kernel mirror against eps x (gated linear attention with values beta_j v_j).\n\n"
                    + markdown_table(["eps", "max abs output", "max abs error", "relative L2 error"], rows))


def write_beta_bugs(path):
    """The two beta bugs of the catalog, run from solutions/ with the bug applied, random vs equal beta."""
    from kdacourse.targets import load_module

    x = _inputs(2, 12, 2, 4, 4)
    equal_beta = np.full_like(x.beta, 0.5)
    bugs = [("s03-beta-before-solve", "kernel_mirror.py", lambda f, beta: f(x.q, x.k, x.v, x.g, beta, 4, 2)),
            ("s03-mixed-beta-pairing", "chunkwise.py", lambda f, beta: f(x.q, x.k, x.v, x.g, beta, 4).o)]
    rows = []
    for bug, file, run in bugs:
        function = getattr(load_module(f"bug:{bug}", STAGE, file), file.removesuffix(".py"))
        for label, beta in (("random, U(0.1, 0.9)", x.beta), ("all equal, 0.5", equal_beta)):
            error = error_report(run(function, beta), recurrent(x.q, x.k, x.v, x.g, beta))
            # with equal beta the bug changes nothing: what is left is rounding
            cells = (f"{error.max_abs:.2e}", f"{error.rel_l2:.2e}") if beta is x.beta else (
                rounding_level(error.max_abs), rounding_level(error.rel_l2))
            rows.append((f"`{bug}`", label, *cells))
    path.write_text(banner(SOURCE) + "B=2, N=12, H=2, d_k=d_v=4, C=4, against reference A.\n\n"
                    + markdown_table(["bug", "beta", "max abs error", "relative L2"], rows) + "\n" + ROUNDING_NOTE)


def write_identities_table(path):
    from stages.common.symbolic import counterexample
    from stages.s03_gated_deltanet.identities import IDENTITIES, REFUTED

    refuted = []
    for build in REFUTED:
        identity = build()
        point = counterexample(identity)
        refuted.append((f"`{build.__name__}`", identity.name, identity.statement,
                        "refuted at one rational point" if point else "**not refuted**"))
    path.write_text(identities_table(IDENTITIES, SOURCE) + "\n"
                    + markdown_table(["function", "not an identity", "statement", "SymPy"], refuted))


# The compile-only test's shape at the default tiles, a wider value block, and a longer chunk.
COMPILE_SHAPE = dict(B=2, N=1024, H=4, d_k=128, d_v=128)
COMPILE_TILES = [(64, 32), (64, 64), (128, 32)]  # (chunk_size, block_dv)
SHARED_MEMORY_LIMIT_KIB = 227  # per block on sm_90 (H100, H200)


def write_compile_report(path):
    from stages.s03_gated_deltanet.kernel import compile_report

    reports = [({"chunk_size": C, "block_dv": block_dv}, compile_report(**COMPILE_SHAPE, chunk_size=C, block_dv=block_dv))
               for C, block_dv in COMPILE_TILES]
    too_big = [f"chunk_size = {values['chunk_size']}, block_dv = {values['block_dv']}" for values, report in reports
               if report.shared_memory > SHARED_MEMORY_LIMIT_KIB * 1024]
    path.write_text(compile_report_table(reports, SOURCE)
                    + f"A block may use at most {SHARED_MEMORY_LIMIT_KIB} KiB of shared memory on sm_90; "
                    + (f"{'; '.join(too_big)} cannot launch.\n" if too_big else "every row fits.\n"))


FP16_MAX = float(np.finfo(np.float16).max)


@functools.cache
def _study(chunk_size, key_norm):
    """numerics.study, computed once per process for the table and the plot."""
    return numerics.study(chunk_size, key_norm)


def write_substitution_cost(path):
    """What the in-kernel forward substitution costs per chunk, from the kernel's tile sizes."""
    import inspect

    from stages.s03_gated_deltanet.kernel import DEFAULT_BLOCK_DV, build_program

    d_k = d_v = COMPILE_SHAPE["d_k"]
    threads = inspect.signature(build_program).parameters["threads"].default
    rows = []
    for C in (32, 64, 128):
        width = d_k + DEFAULT_BLOCK_DV
        rows.append((C, DEFAULT_BLOCK_DV, C - 1, -(-width // threads), C * (C - 1) // 2, width, d_v // DEFAULT_BLOCK_DV))
    path.write_text(banner(SOURCE) + f"d_k = d_v = {d_k}, {threads} threads per program.\n\n" + markdown_table(
        ["C", "block_dv", "serial steps per chunk", "barriers per step", "multiply-adds per column",
         "columns solved (d_k + block_dv)", "programs per head that solve the same K part"], rows))


def write_numerics_table(path):
    rows = []
    for key_norm in numerics.KEY_NORMS:
        for chunk_size in numerics.CHUNK_SIZES:
            row = _study(chunk_size, key_norm)
            overflow = "yes" if row.largest_entry_of_T > FP16_MAX else "no"
            rows.append((f"{key_norm:.2f}", chunk_size, f"{row.condition:.2e}", f"{row.largest_entry_of_T:.2e}",
                         overflow, rounding_level(row.fp32_solve_error)))
    path.write_text(
        banner(SOURCE) + f"d_k = {numerics.D_K}, a in [0.9, 0.999], beta in [0.1, 0.9]; medians over 8 chunks. "
        f"Key norm 1 is the L2-normalized key; {numerics.KEY_NORMS[-1]:.2f} = sqrt(d_k) is the norm of a "
        f"key drawn from N(0, I). fp16's largest finite value is {FP16_MAX:.0f}.\n\n"
        + markdown_table(["key norm", "C", "cond_inf(I + L)", "max abs T", "T overflows fp16", "fp32 solve error"], rows)
        + "\n" + ROUNDING_NOTE)


def write_numerics_plot(path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    for key_norm in numerics.KEY_NORMS:
        rows = [_study(C, key_norm) for C in numerics.CHUNK_SIZES]
        label = {1.0: "unit keys (L2-normalized)", numerics.KEY_NORMS[-1]: f"key norm {key_norm:.2f}, N(0, I) keys"}.get(
            key_norm, f"key norm {key_norm:.2f}")
        left.plot(numerics.CHUNK_SIZES, [r.condition for r in rows], marker="o", label=label)
        right.plot(numerics.CHUNK_SIZES, [r.largest_entry_of_T for r in rows], marker="o", label=label)
    right.axhline(FP16_MAX, color="gray", linestyle="--", label="fp16 largest value")
    for axes, title in ((left, "cond_inf(I + L)"), (right, "max |T|, T = (I + L)^-1")):
        axes.set_xscale("log", base=2)
        axes.set_yscale("log")
        axes.set_xticks(numerics.CHUNK_SIZES, [str(C) for C in numerics.CHUNK_SIZES])
        axes.set_xlabel("chunk size C")
        axes.set_title(title)
        axes.grid(True, which="major", alpha=0.3)
    right.legend(fontsize=8)
    save_svg(figure, path)
    plt.close(figure)


def generated_files():
    return {
        "docs/generated/s03_errors.md": write_error_table,
        "docs/generated/s03_degenerate_checks.md": write_degenerate_checks,
        "docs/generated/s03_small_beta.md": write_small_beta_limit,
        "docs/generated/s03_beta_bugs.md": write_beta_bugs,
        "docs/generated/s03_identities.md": write_identities_table,
        "docs/generated/s03_compile_report.md": write_compile_report,
        "docs/generated/s03_substitution_cost.md": write_substitution_cost,
        "docs/generated/s03_numerics.md": write_numerics_table,
        "docs/generated/s03_numerics.svg": write_numerics_plot,
    }
