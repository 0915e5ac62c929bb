"""Stage 4's generated files: the error table of references B and C against A (the seed's
consistency table), the three degenerate checks, the small-beta limit, what the catalog's bugs cost,
the identities, the kernel's register and shared-memory budget by layout, and the numerics of
e^{+-gamma} (tables beside the seed's numbers, and two plots)."""

import numpy as np

from kdacourse.pages.stage_tables import identities_table, nvcc_version
from kdacourse.pages.tables import ROUNDING_NOTE, banner, markdown_table, rounding_level, save_svg
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.s04_kda import numerics
from stages.s04_kda.reference import chunkwise, kernel_mirror, recurrent

SOURCE = "kdacourse/pages/s04_kda.py"
STAGE = "s04_kda"
SEED_SHAPE = (2, 12, 2, 4, 4)  # B, N, H, d_k, d_v of the seed's consistency table, with C = 4
# The seed's consistency numbers at that shape (max abs error, relative L2; "" where it gives none)
SEED_ERRORS = {"B chunkwise": ("3.89e-16", "2.46e-16"), "C kernel mirror": ("4.44e-16", "2.57e-16")}
SEED_SPLIT = ("1.94e-16 (section 1.2), 1.11e-16 (section 3.4)", "")
SEED_PAIRINGS = ("1.11e-16 each, against its own reference", "")
SEED_DEGENERATE = {"all channels equal": "4.44e-16", "g = 0": "4.44e-16", "beta -> 0": "1.21e-27"}
SEED_BLOCK_DV = {1: "2.48e-16", 2: "2.57e-16", 4: "2.57e-16"}  # relative L2
SEED_BUG_COSTS = {"s04-beta-before-solve": "1.3e-1"}  # relative L2, random beta

# B, N, H, d_k, d_v, chunk_size, block_dv, sub_chunk_size: the seed's consistency shape, many chunks,
# a padded last chunk, a realistic head, and C = 128 cut into sub-chunks
ERROR_TABLE_SHAPES = [
    (2, 12, 2, 4, 4, 4, 2, None),
    (2, 64, 2, 4, 4, 8, 2, None),
    (2, 50, 2, 8, 8, 16, 4, None),
    (1, 256, 2, 64, 64, 64, 32, None),
    (1, 256, 1, 64, 64, 128, 32, 32),
]


def _inputs(B, N, H, d_k, d_v, seed=0, gate_range=(0.9, 0.999)):
    """The seed's inputs: a in [0.9, 0.999] per channel, beta in [0.1, 0.9], unit q and k, float64."""
    return make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=gate_range, beta_range=(0.1, 0.9), seed=seed)


def _error_cells(error):
    """max abs and relative L2 as figures: an error that is the size of a difference (a bug, fp16)."""
    return f"{error.max_abs:.2e}", f"{error.rel_l2:.2e}"


def _rounding_cells(error):
    """max abs and relative L2 at rounding level: two forms of the same sums, added in different orders."""
    return rounding_level(error.max_abs), rounding_level(error.rel_l2)


def write_error_table(path):
    rows = []
    for B, N, H, d_k, d_v, C, block_dv, sub in ERROR_TABLE_SHAPES:
        x = _inputs(B, N, H, d_k, d_v)
        expected = recurrent(x.q, x.k, x.v, x.g, x.beta)
        shape = f"B={B}, N={N}, H={H}, d_k={d_k}, d_v={d_v}, C={C}, block_dv={block_dv}"
        mirror = ("C kernel mirror" if sub is None else f"C kernel mirror, sub-chunks of {sub}",
                  kernel_mirror(x.q, x.k, x.v, x.g, x.beta, C, block_dv, sub_chunk_size=sub))
        for name, actual in (("B chunkwise", chunkwise(x.q, x.k, x.v, x.g, x.beta, C).o), mirror):
            seed = SEED_ERRORS.get(name, ("", "")) if (B, N, H, d_k, d_v, C) == (*SEED_SHAPE, 4) else ("", "")
            rows.append((shape, f"{name} vs A", *_rounding_cells(error_report(actual, expected)), *seed))
    path.write_text(banner(SOURCE) + markdown_table(
        ["shape", "comparison", "max abs error", "relative L2", "the seed: max abs", "the seed: relative L2"], rows)
        + "\n" + ROUNDING_NOTE)


def write_split_and_pairings(path):
    """The seed's other consistency rows, on one chunk of its shape: the exponent split against the
    weighted dot products, and the two beta pairings against each other."""
    x = _inputs(*SEED_SHAPE)
    K, beta = x.k[0, :4, 0], x.beta[0, :4, 0]
    gamma = np.cumsum(x.g[0, :4, 0], axis=0)
    naive = np.array([[(K[c] * np.exp(gamma[c] - gamma[i])) @ K[i] for i in range(4)] for c in range(4)])
    split = (K * np.exp(gamma)) @ (K * np.exp(-gamma)).T
    M = np.tril(naive, -1)
    after = beta[:, None] * np.linalg.inv(np.eye(4) + M * beta[None, :])  # L = beta_i M, diag(beta) T
    before = np.linalg.inv(np.eye(4) + beta[:, None] * M) * beta[None, :]  # L = beta_c M, T diag(beta)
    rows = [("exponent split K+ K-^T vs weighted dot products, all (c, i)",
             *_rounding_cells(error_report(split, naive)), SEED_SPLIT[0]),
            ("L = beta_i M with diag(beta) T vs L = beta_c M with T diag(beta)",
             *_rounding_cells(error_report(after, before)), SEED_PAIRINGS[0])]
    # no ROUNDING_NOTE: the page shows this table right below s04_errors.md, which ends with it
    path.write_text(banner(SOURCE) + "One chunk of the seed's shape (C = 4, d_k = 4).\n\n"
                    + markdown_table(["comparison", "max abs error", "relative L2", "the seed: max abs"], rows))


def _equal_channels(g):
    """Every key channel given the gate of channel 0: a scalar gate per token."""
    return np.repeat(g[..., :1], g.shape[-1], axis=-1)


def write_degenerate_checks(path):
    """The seed's three degenerate checks at its shape, plus block_dv, each against an independent form."""
    from stages.s03_gated_deltanet import reference as stage_3
    from stages.common.oracles import delta_rule

    x = _inputs(*SEED_SHAPE)
    run = {"A recurrent": lambda g: recurrent(x.q, x.k, x.v, g, x.beta),
           "B chunkwise": lambda g: chunkwise(x.q, x.k, x.v, g, x.beta, 4).o,
           "C kernel mirror": lambda g: kernel_mirror(x.q, x.k, x.v, g, x.beta, 4, 2)}
    scalar_gate = x.g[..., 0]
    rows = []
    for name, function in run.items():
        equal = function(_equal_channels(x.g))
        for against, expected in (("stage 3's kernel mirror", stage_3.kernel_mirror(x.q, x.k, x.v, scalar_gate, x.beta, 4, 2)),
                                  ("Gated DeltaNet (stages/common/oracles.py: delta_rule)", delta_rule(x.q, x.k, x.v, x.beta, scalar_gate))):
            rows.append(("all channels equal", f"{name} vs {against}", *_rounding_cells(error_report(equal, expected)),
                         SEED_DEGENERATE["all channels equal"], ""))
    for name, function in run.items():
        error = error_report(function(np.zeros_like(x.g)), delta_rule(x.q, x.k, x.v, x.beta))
        rows.append(("g = 0", f"{name} vs DeltaNet (stages/common/oracles.py: delta_rule)", *_rounding_cells(error),
                     SEED_DEGENERATE["g = 0"], ""))
    expected = recurrent(x.q, x.k, x.v, x.g, x.beta)
    for block_dv in (1, 2, 4):
        error = error_report(kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 4, block_dv), expected)
        rows.append((f"block_dv = {block_dv}", "C kernel mirror vs A", *_rounding_cells(error), "",
                     SEED_BLOCK_DV[block_dv]))
    path.write_text(banner(SOURCE) + "B=2, N=12, H=2, d_k=d_v=4, C=4 (the seed's shape). The seed's third check, "
                    f"beta -> 0 ({SEED_DEGENERATE['beta -> 0']}), is the small-beta table below.\n\n"
                    + markdown_table(["check", "comparison", "max abs error", "relative L2", "the seed: max abs",
                                      "the seed: relative L2"], rows) + "\n" + ROUNDING_NOTE)


BETA_SCALES = (1e-1, 1e-2, 1e-4, 1e-8, 1e-13)


def write_small_beta_limit(path):
    """o(eps beta) against eps times per-channel gated linear attention with values beta_j v_j."""
    from stages.common.oracles import channel_gated_linear_attention

    x = _inputs(*SEED_SHAPE)
    first_order = channel_gated_linear_attention(x.q, x.k, x.beta[..., None] * x.v, x.g)
    rows = []
    for scale in BETA_SCALES:
        output = kernel_mirror(x.q, x.k, x.v, x.g, scale * x.beta, 4, 2)
        absolute = error_report(output, scale * first_order)
        relative = error_report(output / scale, first_order)
        rows.append((f"{scale:.0e}", f"{np.max(np.abs(output)):.2e}", f"{absolute.max_abs:.2e}",
                     f"{relative.rel_l2:.2e}"))
    path.write_text(banner(SOURCE) + "B=2, N=12, H=2, d_k=d_v=4, C=4; beta = eps x U(0.1, 0.9), C kernel mirror "
                    "against eps x (per-channel gated linear attention with values beta_j v_j). The seed's "
                    f"beta -> 0 check reports {SEED_DEGENERATE['beta -> 0']}.\n\n"
                    + markdown_table(["eps", "max abs output", "max abs error", "relative L2 error"], rows))


def write_bug_costs(path):
    """Every NumPy bug of the catalog, run from solutions/ with the bug applied, on the seed's shape:
    on inputs where it shows, and on the inputs where the catalog says it hides."""
    from kdacourse.catalog import bugs
    from kdacourse.targets import load_module

    x = _inputs(*SEED_SHAPE)
    hiding = {"all channels equal": dict(g=_equal_channels(x.g)), "all beta equal": dict(beta=np.full_like(x.beta, 0.5)),
              "g = 0": dict(g=np.zeros_like(x.g))}
    hides_under = {"s04-diag-after-householder": "all channels equal", "s04-mixed-beta-pairing": "all beta equal",
                   "s04-beta-before-solve": "all beta equal", "s04-decay-outside-key-product": "all channels equal",
                   "s04-state-decay-inverted": "g = 0"}
    extra = {"recurrent.py": (), "chunkwise.py": (4,), "kernel_mirror.py": (4, 2)}
    rows = []
    for bug in (b for b in bugs() if b.stage == STAGE and b.file in extra):
        function = getattr(load_module(f"bug:{bug.id}", STAGE, bug.file), bug.file.removesuffix(".py"))
        for label, change in [("random", {})] + ([(hides_under[bug.id], hiding[hides_under[bug.id]])]
                                                 if bug.id in hides_under else []):
            inputs = dict(g=x.g, beta=x.beta) | change
            output = function(x.q, x.k, x.v, inputs["g"], inputs["beta"], *extra[bug.file])
            output = getattr(output, "o", output)  # reference B returns o in its ChunkwiseOutput
            error = error_report(output, recurrent(x.q, x.k, x.v, inputs["g"], inputs["beta"]))
            seed = SEED_BUG_COSTS.get(bug.id, "") if label == "random" else ""
            # where the bug hides it changes nothing: what is left is rounding
            cells = _error_cells(error) if label == "random" else _rounding_cells(error)
            rows.append((f"`{bug.id}`", f"`{bug.file}`", label, *cells, seed))
    path.write_text(banner(SOURCE) + "B=2, N=12, H=2, d_k=d_v=4, C=4, against reference A; 'random' is the seed's "
                    "inputs (gates U(0.9, 0.999) per channel, beta U(0.1, 0.9)).\n\n"
                    + markdown_table(["bug", "file", "inputs", "max abs error", "relative L2",
                                      "the seed: relative L2"], rows) + "\n" + ROUNDING_NOTE)


def write_identities_table(path):
    from stages.common.symbolic import counterexample
    from stages.s04_kda.identities import IDENTITIES, REFUTED

    refuted = []
    for build in REFUTED:
        identity, hidden = build(), build(True)
        refuted.append((f"`{build.__name__}`", identity.name, identity.statement,
                        "refuted at one rational point" if counterexample(identity) else "**not refuted**",
                        "proved" if hidden.holds() else "**FAILS**"))
    path.write_text(identities_table(IDENTITIES, SOURCE) + "\n" + markdown_table(
        ["function", "not an identity", "statement", "SymPy", "with equal channels (or betas)"], refuted))


# The seed's register budget (d_k = d_v = 128, block_dv = 32, 128 threads): its sum of fragment
# sizes for each layout it discusses, beside what ptxas allocates for the same layout.
R, S = "registers", "shared"
LAYOUT_ROWS = [  # (C, e^{+gamma}, e^{-gamma}, W, the seed's estimate)
    (64, R, R, R, "≈ 320, over 255"),
    (64, R, S, R, "≈ 256"),
    (64, R, S, S, "≈ 192, its choice"),
    (64, S, S, S, "its kernel's code"),
    (32, R, R, R, "≈ 160, C-sized tiles halved"),
]
SHARED_MEMORY_LIMIT_KIB = 227  # per block on sm_90 (H100, H200)


def write_register_budget(path):
    from stages.s04_kda.kernel import DEFAULT_LAYOUT, compile_report

    rows = []
    for C, e_plus, e_minus, w, seed in LAYOUT_ROWS:
        layout = (("e_plus_gamma", e_plus), ("e_minus_gamma", e_minus), ("w", w))
        report = compile_report(chunk_size=C, layout=layout)
        fits = "yes" if report.shared_memory <= SHARED_MEMORY_LIMIT_KIB * 1024 else "**no**"
        name = " (shipped)" if layout == DEFAULT_LAYOUT and C == 64 else ""
        rows.append((f"{C}{name}", e_plus, e_minus, w, seed, report.registers,
                     f"{report.spill_stores} / {report.spill_loads}", f"{report.shared_memory / 1024:.1f}", fits))
    path.write_text(
        banner(SOURCE) + "d_k = d_v = 128, block_dv = 32, 128 threads (warp specialization off), fp16; "
        f"compiled for sm_90a by nvcc {nvcc_version()}, no GPU involved.\n\n"
        + markdown_table(["C", "e^{+gamma}", "e^{-gamma}", "W", "the seed's estimate", "registers/thread (ptxas)",
                          "spill stores / loads (B)", "shared memory (KiB)",
                          f"fits in {SHARED_MEMORY_LIMIT_KIB} KiB"], rows))


def _sampled(s, digits=3):
    """'median [5%, 95%]' of a Sampled statistic."""
    return f"{s.median:.{digits}g} [{s.low:.{digits}g}, {s.high:.{digits}g}]"


def _seed_cells(s, digits=3):
    return f"{s.seed:.{digits}g}", f"{s.seed_percentile:.0f}%", "yes" if s.seed_within_band else "**no**"


def _sampling_note():
    return (f"Ours: median [5%, 95%] over {numerics.DRAWS} chunks of {numerics.D_K} channels drawn with "
            f"seed {numerics.SEED}; 'seed at' is the share of our chunks below the seed's number.\n\n")


SEED_COLUMNS = ["the seed", "seed at", "within 5-95%"]


def _verdict(sampled, largest):
    """Whether a format whose largest finite value is `largest` holds the statistic."""
    if sampled.high <= largest:
        return "OK"
    return "overflows" if sampled.median > largest else "overflows in some chunks"


def write_gate_bound_table(path):
    rows = []
    for L, s in numerics.gate_bound_rows():
        rows.append((L, _sampled(s), _verdict(s, numerics.FP16_MAX), _verdict(s, numerics.FP32_MAX), *_seed_cells(s)))
    path.write_text(banner(SOURCE) + "C = 64, a ~ U(L, 1) per token and channel. " + _sampling_note()
                    + markdown_table(["gate lower bound L", "max e^{-gamma}", "fp16", "fp32"] + SEED_COLUMNS, rows))


def write_underflow_table(path):
    rows = []
    for (gate_range, C), smallest, zeroed in numerics.underflow_rows():
        rows.append((f"[{gate_range[0]}, {gate_range[1]}]", C, _sampled(smallest), *_seed_cells(smallest),
                     f"{zeroed.median:.0f} [{zeroed.low:.0f}, {zeroed.high:.0f}] / {numerics.D_K}",
                     f"{zeroed.seed:.0f} / {numerics.D_K}"))
    path.write_text(banner(SOURCE) + "a ~ U(range) per token and channel. " + _sampling_note() + markdown_table(
        ["a range", "C", "min e^{gamma_C}"] + SEED_COLUMNS + ["channels fp16 rounds to 0", "the seed"], rows))


def write_lower_bound_table(path):
    rows = []
    for L, smallest, zeroed in numerics.lower_bound_rows():
        rows.append(("none" if L is None else L, _sampled(smallest), *_seed_cells(smallest),
                     f"{zeroed.median:.0f} [{zeroed.low:.0f}, {zeroed.high:.0f}] / {numerics.D_K}"))
    path.write_text(banner(SOURCE) + "C = 128, a = max(a', L) with a' ~ U(0.01, 0.999). " + _sampling_note()
                    + markdown_table(["lower bound L", "min e^{gamma_C}"] + SEED_COLUMNS
                                     + ["channels fp16 rounds to 0"], rows))


def write_spread_table(path):
    rows = []
    for (gate_range, C), s in numerics.spread_rows():
        rows.append((f"[{gate_range[0]}, {gate_range[1]}]", C, _sampled(s), f"{np.exp(s.median):.3g}",
                     *_seed_cells(s)))
    path.write_text(banner(SOURCE) + "Spread = max - min over channels of gamma_C. " + _sampling_note()
                    + markdown_table(["a range", "C", "spread of gamma_C (log units)", "e^{median spread}"]
                                     + SEED_COLUMNS, rows))


def write_sub_chunk_table(path):
    rows = [(sub if sub < 128 else "128 (whole chunk)", _sampled(s), *_seed_cells(s))
            for sub, s in numerics.sub_chunk_rows()]
    path.write_text(banner(SOURCE) + "C = 128, a ~ U(0.9, 1); gamma restarts at every sub-chunk. " + _sampling_note()
                    + markdown_table(["sub-chunk", "max e^{-gamma}"] + SEED_COLUMNS, rows))


def write_fp16_error_table(path):
    from stages.s04_kda.kernel import MAX_LOG_DECAY

    bound = MAX_LOG_DECAY["float16"]
    rows = [(L, f"{worst:.2f}", "runs" if worst <= bound else "refuses", *_error_cells(error))
            for L, worst, error in numerics.fp16_error_rows()]
    path.write_text(banner(SOURCE) + "B=1, N=256, H=2, d_k=d_v=64, C=64, a ~ U(L, 1), beta ~ U(0.1, 0.9); "
                    "numerics.fp16_kernel_emulation against reference C in float64. The wrapper's bound "
                    f"is -gamma <= 14 ln 2 = {bound:.2f}.\n\n" + markdown_table(
                        ["gate lower bound L", "largest -gamma in a chunk", "the wrapper", "max abs error",
                         "relative L2"], rows))


def _plot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


PLOT_BOUNDS = (0.99, 0.95, 0.9, 0.85, 0.8, 0.7, 0.6, 0.5)


def write_exponent_range_plot(path):
    """max e^{-gamma} against the gate lower bound, for four chunk sizes, with fp16's limits."""
    from stages.s04_kda.kernel import MAX_LOG_DECAY

    plt = _plot()
    figure, axes = plt.subplots(figsize=(6.5, 3.8))
    for C in (16, 32, 64, 128):
        samples = [numerics.compare(numerics.max_exp_neg_gamma(numerics.sample_gates((L, 1.0), C)), 0)
                   for L in PLOT_BOUNDS]
        line, = axes.plot(PLOT_BOUNDS, [s.median for s in samples], marker="o", label=f"C = {C}")
        axes.fill_between(PLOT_BOUNDS, [s.low for s in samples], [s.high for s in samples], color=line.get_color(),
                          alpha=0.2)
    axes.axhline(numerics.FP16_MAX, color="black", linestyle="--", label="fp16 largest value")
    axes.axhline(np.exp(MAX_LOG_DECAY["float16"]), color="gray", linestyle=":", label=r"the wrapper's bound, $2^{14}$")
    axes.set_yscale("log")
    axes.invert_xaxis()
    axes.set_xlabel(r"gate lower bound $L$ ($a \sim U(L, 1)$)")
    axes.set_ylabel(r"max $e^{-\gamma}$ in one chunk")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize=8)
    save_svg(figure, path)
    plt.close(figure)


def write_channel_plot(path):
    """e^{gamma_C} of the 128 channels of one median chunk, sorted, for the seed's gate ranges."""
    plt = _plot()
    figure, axes = plt.subplots(figsize=(6.5, 3.8))
    for gate_range, C in (((0.9, 0.999), 64), ((0.9, 0.999), 128), ((0.5, 0.999), 64), ((0.5, 0.999), 128)):
        gamma_end = numerics.sample_gates(gate_range, C).sum(axis=1)  # (draws, d_k)
        median_draw = np.argsort(gamma_end.min(axis=1))[len(gamma_end) // 2]
        axes.plot(np.exp(np.sort(gamma_end[median_draw])), label=f"$a \\in [{gate_range[0]}, {gate_range[1]}]$, C = {C}")
    axes.axhline(2.0 ** -25, color="black", linestyle="--", label=r"fp16 rounds to 0 below $2^{-25}$")
    axes.axhline(2.0 ** -14, color="gray", linestyle=":", label=r"fp16 smallest normal, $2^{-14}$")
    axes.set_yscale("log")
    axes.set_xlabel("channel, sorted by decay")
    axes.set_ylabel(r"$e^{\gamma_C}$")
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize=8)
    save_svg(figure, path)
    plt.close(figure)


def generated_files():
    return {
        "docs/generated/s04_errors.md": write_error_table,
        "docs/generated/s04_split_and_pairings.md": write_split_and_pairings,
        "docs/generated/s04_degenerate_checks.md": write_degenerate_checks,
        "docs/generated/s04_small_beta.md": write_small_beta_limit,
        "docs/generated/s04_bug_costs.md": write_bug_costs,
        "docs/generated/s04_identities.md": write_identities_table,
        "docs/generated/s04_register_budget.md": write_register_budget,
        "docs/generated/s04_gate_bound.md": write_gate_bound_table,
        "docs/generated/s04_underflow.md": write_underflow_table,
        "docs/generated/s04_lower_bound.md": write_lower_bound_table,
        "docs/generated/s04_spread.md": write_spread_table,
        "docs/generated/s04_sub_chunks.md": write_sub_chunk_table,
        "docs/generated/s04_fp16_emulation.md": write_fp16_error_table,
        "docs/generated/s04_exponent_range.svg": write_exponent_range_plot,
        "docs/generated/s04_channels.svg": write_channel_plot,
    }
