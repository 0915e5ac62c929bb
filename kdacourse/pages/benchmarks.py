"""The benchmarks page's tables and plots, made from the committed results on any machine.

Reads benchmarks/results/{bench.csv, precision.csv, meta.json}, written on a GPU by
`python -m benchmarks.bench --out RUN_DIR` and folded in by `python -m benchmarks.merge RUN_DIR`,
and writes docs/generated/bench_*; and stage 5's profile table from the committed ncu outputs
(`python -m benchmarks.profile_s05` under ncu: PROFILES), all through kdacourse.results.
"""

from collections import defaultdict

from kdacourse import results
from kdacourse.pages.tables import markdown_table, save_svg

RESULTS = results.RESULTS
UNGATED_STAGES = {"s01_linear_attention"}  # linear attention has no gate: its precision rows say so
PROFILES = [  # (version, ncu output of benchmarks.profile_s05.NCU_COMMAND), oldest first
    ("first version", "s05_prepare_ncu_before.txt"),
    ("scalar merges", "s05_prepare_ncu_scalar_merges.txt"),
    ("merges as TF32 GEMMs (this version)", "s05_prepare_ncu.txt"),
]
TARGETED_STAGES = {"s01_linear_attention", "s02_scalar_decay"}  # fused kernels held to FLA's time (issue 6)
TARGET_VS_FLA = 1.5
STAGE_LABELS = {
    "s01_linear_attention": "s01 linear attention",
    "s02_scalar_decay": "s02 scalar decay",
    "s03_gated_deltanet": "s03 Gated DeltaNet",
    "s04_kda": "s04 KDA",
    "s05_fast_kda": "s05 fast KDA",
}


def _rows(name):
    path = RESULTS / name
    return results.read_rows(path) if path.exists() else []


def _timings():
    """{(stage, B, N, H, D): {impl: row}} for the benchmark shapes (rows with a time or an error)."""
    table = defaultdict(dict)
    for row in _rows("bench.csv"):
        if row["impl"] and row["dtype"] == "bfloat16":
            table[(row["stage"], int(row["B"]), int(row["N"]), int(row["H"]), int(row["D"]))][row["impl"]] = row
    return table


def _ms(row):
    return float(row["time_ms"]) if row and row.get("time_ms") else None


def write_meta(path):
    """One table of what every run shares (machine, versions), one row per run: which stages it measured,
    and whether their kernels are still the committed ones (bench records a digest of each kernel's source)."""
    meta_path = RESULTS / "meta.json"
    if not meta_path.exists():
        path.write_text("No benchmark results are committed yet.\n")
        return
    runs = results.read_json(meta_path)["runs"]
    shared = [key for key in ("device", "torch", "cuda", "triton", "tilelang", "fla", "python")
              if len({run.get(key) for run in runs}) == 1 and key in runs[0]]
    machine = markdown_table(["what", "value"], [(key, runs[0][key]) for key in shared])
    current = {stage: results.current_kernel_digest(stage) for stage in STAGE_LABELS}

    def stages(run, key):
        return ", ".join(STAGE_LABELS.get(stage, stage) for stage in run.get(key, [])) or "–"

    def kernels(run):
        measured = sorted(set(run.get("timed", [])) | set(run.get("precision", [])))
        if "kernels" not in run:
            return "not recorded"
        changed = [stage for stage in measured if run["kernels"].get(stage) != current.get(stage)]
        if not changed:
            return "as committed"
        return "changed since: " + ", ".join(STAGE_LABELS.get(stage, stage) for stage in changed)

    per_run = markdown_table(
        ["run", "date", "timings of", "precision of", "kernels", "seconds", "command"],
        [(index, run["date"], stages(run, "timed"), stages(run, "precision"), kernels(run), run["seconds"],
          f"`{results.shown_command(run['command'])}`") for index, run in enumerate(runs, 1)])
    path.write_text(machine + "\n" + per_run)


def roofs_rows(runs, fair_meta=None):
    """Rows (what, bandwidth, bf16 compute, where it comes from): as specified, as measured before the
    runs (DESIGN.md), as each run of `runs` (meta.json's, numbered from 1) and the fair run measured
    them, and the bandwidth the memory bound uses (benchmarks.bench.MEMORY_BANDWIDTH, DESIGN.md's copy)."""
    tb, tflop = results.tb_per_s, results.tflop_per_s
    rows = [("specified", tb(results.SPECIFIED_BANDWIDTH), "", "the H200's HBM3e, as the specification gives it"),
            ("measured before the runs", tb(results.DESIGN_COPY_BANDWIDTH), tflop(results.DESIGN_GEMM_FLOPS),
             "a device-to-device copy and a bf16 torch GEMM on an H200 (DESIGN.md)")]
    for number, run in enumerate(runs, 1):
        roofs = results.roofs_of(run)
        if roofs is not None:
            rows.append((f"run {number}", tb(roofs["bandwidth_bytes_per_s"]), tflop(roofs["bf16_flops_per_s"]),
                         f"measured by the run on its {run.get('device', 'GPU')} (benchmarks/roofs.py)"))
    fair = results.roofs_of(fair_meta) if fair_meta else None
    if fair is not None:
        rows.append((f"fair run of {fair_meta.get('date', '?')}", tb(fair["bandwidth_bytes_per_s"]),
                     tflop(fair["bf16_flops_per_s"]),
                     f"measured by `benchmarks.fair` on its {fair_meta.get('device', 'GPU')} (benchmarks/roofs.py)"))
    rows.append(("the memory bound uses", tb(results.DESIGN_COPY_BANDWIDTH), "", "benchmarks.bench.MEMORY_BANDWIDTH"))
    return rows


def write_roofs_table(path):
    """The machine's roofs: as specified, as measured before the runs, as each run measured them."""
    meta_path, fair_path = RESULTS / "meta.json", RESULTS / results.FAIR_META
    runs = results.read_json(meta_path)["runs"] if meta_path.exists() else []
    fair_meta = results.read_json(fair_path) if fair_path.exists() else None
    path.write_text(markdown_table(["", "memory bandwidth", "bf16 tensor cores", "from"], roofs_rows(runs, fair_meta)))


def write_timing_table(path):
    rows = []
    for (stage, B, N, H, D), by_impl in sorted(_timings().items()):
        ours, fla, plain = (by_impl.get(i) for i in ("ours", "fla", "torch"))
        t_ours, t_fla, t_plain = _ms(ours), _ms(fla), _ms(plain)
        bound = float((ours or fla)["memory_bound_ms"])

        def cell(t):
            return f"{t:.3f}" if t is not None else "failed"

        rows.append((
            STAGE_LABELS.get(stage, stage), f"{B}, {N}, {H}, {D}", cell(t_ours), cell(t_fla), cell(t_plain),
            f"{t_fla / t_ours:.2f}" if t_ours and t_fla else "–",
            f"{bound:.3f}", f"{bound / t_ours:.0%}" if t_ours else "–",
            ours.get("rel_l2_vs_fla") or "–" if ours else "–",
        ))
    path.write_text(markdown_table(
        ["stage", "B, N, H, D", "ours (ms)", "FLA (ms)", "plain torch (ms)", "FLA / ours", "memory bound (ms)",
         "of bound", "rel L2 ours vs FLA"], rows) if rows else "No timings are committed yet.\n")


def write_ratio_summary(path):
    """Per stage, the range over the benchmark shapes of FLA / ours, plain torch / ours and the memory bound
    fraction, and for the stages with a target (1 and 2: ours / FLA <= TARGET_VS_FLA) whether it is met."""
    by_stage = defaultdict(list)
    for (stage, *_), by_impl in sorted(_timings().items()):
        t_ours, t_fla, t_plain = (_ms(by_impl.get(impl)) for impl in ("ours", "fla", "torch"))
        if t_ours:
            bound = float(by_impl["ours"]["memory_bound_ms"])
            by_stage[stage].append((t_fla / t_ours if t_fla else None, t_plain / t_ours if t_plain else None,
                                    bound / t_ours))

    def span(values, form):
        values = [v for v in values if v is not None]
        return f"{form(min(values))} to {form(max(values))}" if values else "–"

    def target(stage, rows):
        if stage not in TARGETED_STAGES:
            return "not targeted"
        met = all(vs_fla is not None and 1 / vs_fla <= TARGET_VS_FLA for vs_fla, _, _ in rows)
        return f"{'met' if met else 'missed'} at {len(rows)} shapes"

    rows = [(STAGE_LABELS.get(stage, stage), span([r[0] for r in rows], "{:.2f}x".format),
             span([r[1] for r in rows], "{:.1f}x".format), span([r[2] for r in rows], "{:.1%}".format),
             target(stage, rows)) for stage, rows in by_stage.items()]
    path.write_text(markdown_table(
        ["stage", "FLA / ours", "plain torch / ours", "of memory bound", f"ours / FLA <= {TARGET_VS_FLA}"], rows)
        if rows else "No timings are committed yet.\n")


def write_correctness_table(path):
    rows = [(STAGE_LABELS.get(r["stage"], r["stage"]), f"{r['B']}, {r['N']}, {r['H']}, {r['D']}", r["dtype"],
             r["rel_l2_vs_float64"]) for r in _rows("bench.csv") if r["rel_l2_vs_float64"]]
    path.write_text(markdown_table(["stage", "B, N, H, D", "inputs", "rel L2 vs float64"], rows)
                    if rows else "No results are committed yet.\n")


def write_precision_table(path):
    """Stage by stage (each stage's rows in the order its run wrote them): one column per N."""
    table = defaultdict(dict)
    for row in _rows("precision.csv"):
        gates = "no gates" if row["stage"] in UNGATED_STAGES else f"[{row['gate_lower']}, {row['gate_upper']}]"
        key = (row["stage"], gates, row["dtype"], row["impl"])
        table[key][int(row["N"])] = row.get("rel_l2_vs_float64") or "failed"
    lengths = sorted({n for values in table.values() for n in values})
    rows = [(STAGE_LABELS.get(s, s), gates, dtype, impl, *(values.get(n, "–") for n in lengths))
            for (s, gates, dtype, impl), values in sorted(table.items(), key=lambda item: item[0][0])]
    path.write_text(markdown_table(["stage", "gates a in", "inputs", "kernel", *(f"N = {n}" for n in lengths)], rows)
                    if rows else "No precision results are committed yet.\n")


def write_plots(path):
    """Three panels: time vs N (B = 1, H = 32), FLA / ours at every shape, fraction of the memory bound."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    timings = _timings()
    figure, (time_axis, ratio_axis, bound_axis) = plt.subplots(1, 3, figsize=(15, 4.8))
    stages = sorted({key[0] for key in timings})
    shapes = sorted({key[1:] for key in timings})
    colors = {stage: f"C{index}" for index, stage in enumerate(stages)}  # one color per stage in all panels
    all_lengths = set()
    for stage in stages:
        lengths = sorted(N for (s, B, N, H, D) in timings if s == stage and B == 1)
        for impl, style in (("ours", "-o"), ("fla", "--s")):
            points = [(N, _ms(timings[(stage, 1, N, 32, 128)].get(impl))) for N in lengths]
            points = [(N, t) for N, t in points if t is not None]
            if points:
                time_axis.plot(*zip(*points), style, color=colors[stage])
                all_lengths.update(N for N, _ in points)
    time_axis.set(xscale="log", yscale="log", xlabel="N (B = 1, H = 32, D = 128)", ylabel="forward time (ms)",
                  title="time against sequence length (solid: ours, dashed: FLA)")
    time_axis.set_xticks(sorted(all_lengths), [str(N) for N in sorted(all_lengths)], minor=False)
    time_axis.xaxis.set_minor_formatter(NullFormatter())
    width = 0.8 / max(len(stages), 1)
    for index, stage in enumerate(stages):
        ratios, bounds = [], []
        for shape in shapes:
            by_impl = timings.get((stage, *shape), {})
            t_ours, t_fla = _ms(by_impl.get("ours")), _ms(by_impl.get("fla"))
            ratios.append(t_fla / t_ours if t_ours and t_fla else float("nan"))
            row = by_impl.get("ours")
            bounds.append(float(row["memory_bound_ms"]) / t_ours if row and t_ours else 0)
        offsets = [i + (index - (len(stages) - 1) / 2) * width for i in range(len(shapes))]
        ratio_axis.bar(offsets, ratios, width, color=colors[stage], label=STAGE_LABELS.get(stage, stage))
        bound_axis.bar(offsets, bounds, width, color=colors[stage])
    labels = [f"B={B}\nN={N}\nH={H}" for B, N, H, D in shapes]
    ratio_axis.axhline(1.0, color="black", linewidth=0.8)
    # log scale: the teaching kernels sit at a few hundredths of FLA, the fused ones near 1
    ratio_axis.set(xticks=range(len(shapes)), xticklabels=labels, yscale="log", ylabel="time(FLA) / time(ours)",
                   title="speed relative to FLA (> 1: ours faster)")
    bound_axis.set(xticks=range(len(shapes)), xticklabels=labels, ylabel="memory-bound time / time",
                   title="fraction of the memory-traffic bound")
    figure.legend(*ratio_axis.get_legend_handles_labels(), loc="lower center", ncol=len(stages), fontsize=9)
    figure.tight_layout(rect=(0, 0.07, 1, 1))
    save_svg(figure, path)
    plt.close(figure)


def profile_rows(profiles):
    """The table's rows: one per quantity, one column per profile ({(name, unit): value} each)."""
    def value(metrics, name, unit, form):
        return form(metrics[(name, unit)]) if (name, unit) in metrics else "–"

    def blocks_per_sm(metrics):
        return int(min(v for (name, _), v in metrics.items() if name.startswith("Block Limit ")))

    def lsu_busy_cycles(metrics):  # the shared-memory pipe's busy cycles: its share of the kernel's cycles
        share = metrics.get(("L1: Data Pipe Lsu Wavefronts", "%"))
        return "–" if share is None else f"{share / 100 * metrics[('Elapsed Cycles', 'cycle')] / 1e6:.2f} M"

    def cell(name, unit, form):
        return lambda metrics: value(metrics, name, unit, form)

    quantities = [
        ("threads per block", cell("Block Size", "", lambda v: f"{v:.0f}")),
        ("registers per thread", cell("Registers Per Thread", "register/thread", lambda v: f"{v:.0f}")),
        ("shared memory per block", cell("Dynamic Shared Memory Per Block", "Kbyte/block",
                                         lambda v: f"{v * 1000 / 1024:.0f} KiB")),
        ("blocks per SM", blocks_per_sm),
        ("active warps per scheduler", cell("Active Warps Per Scheduler", "warp", lambda v: f"{v:.2f}")),
        ("instructions issued per scheduler and cycle", cell("Issued Warp Per Scheduler", "", lambda v: f"{v:.2f}")),
        ("duration", cell("Duration", "ms", lambda v: f"{v:.2f} ms")),
        ("cycles", cell("Elapsed Cycles", "cycle", lambda v: f"{v / 1e6:.2f} M")),
        ("busiest memory unit (of its peak)", cell("Memory Throughput", "%", lambda v: f"{v:.1f} %")),
        ("shared-memory pipe (L1 LSU wavefronts)", cell("L1: Data Pipe Lsu Wavefronts", "%", lambda v: f"{v:.1f} %")),
        ("shared-memory pipe busy", lsu_busy_cycles),
        ("DRAM throughput", cell("DRAM Throughput", "%", lambda v: f"{v:.1f} %")),
    ]
    return [(label, *(quantity(metrics) for metrics in profiles)) for label, quantity in quantities]


def write_profile_table(path):
    """Stage 5's prepare kernel as ncu saw it, one column per version of PROFILES."""
    profiles = [results.read_ncu(RESULTS / name) for _, name in PROFILES]
    path.write_text(markdown_table(["", *(version for version, _ in PROFILES)], profile_rows(profiles)))


# The fused path's goals as Kimi Linear calls and trains it: the course's speed-up on each peer
KIMI_GOALS = {"the call against FlashKDA": 1.1, "the call against FLA": 2.0, "training against FLA": 2.0}
KIMI_CALL_GOAL_RATIOS = {"the call against FlashKDA": "FlashKDA call / course call",
                         "the call against FLA": "FLA call / course call"}


def kimi_goal_bars(call_run, train_run) -> dict:
    """{goal name of KIMI_GOALS: [(label, Spread of the course's speed-up)]}: the call's ratios of each
    case of a kimi_call run (results.kimi_call_run; None: not run), the training's of each (case, gate)
    of a kimi_train run (results.kimi_train_run). A case whose ratio was not measured is left out."""
    bars = {name: [] for name in KIMI_GOALS}
    for case in (call_run.cases.values() if call_run else ()):
        label = (f"{case.tokens} in {case.sequences}\nH {case.H}" if case.sequences > 1
                 else f"T {case.tokens}\nH {case.H}")
        for goal, ratio_name in KIMI_CALL_GOAL_RATIOS.items():
            if case.ratios.get(ratio_name) is not None:
                bars[goal].append((label, case.ratios[ratio_name]))
    for (_, gate), case in (train_run.cases.items() if train_run else ()):
        if case.speedup is not None:
            bars["training against FLA"].append((f"{gate}\nT {case.tokens}", case.speedup))
    return bars


def write_kimi_goals_plot(path, call_folder=None, train_folder=None):
    """Three panels, one per goal of KIMI_GOALS: the course's speed-up at each measured shape (bar: the
    median over rounds, whiskers: min to max), the goal as a dashed line, a bar that reaches it green."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = kimi_goal_bars(results.kimi_call_run(results.KIMI_CALL if call_folder is None else call_folder),
                          results.kimi_train_run(results.KIMI_TRAIN if train_folder is None else train_folder))
    figure, axes = plt.subplots(1, len(KIMI_GOALS), figsize=(15, 4.4),
                                gridspec_kw={"width_ratios": [max(len(b), 2) for b in bars.values()]})
    for axis, (goal, goal_bars) in zip(axes, bars.items()):
        target = KIMI_GOALS[goal]
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.axhline(target, color="C3", linestyle="--", linewidth=1.2, label=f"goal: {target:g}x")
        axis.set(title=goal, ylabel="the course's speed-up (> 1: faster)")
        axis.legend(loc="upper right", fontsize=8)
        if not goal_bars:
            axis.text(0.5, 0.5, "not measured yet", transform=axis.transAxes, ha="center", va="center")
            axis.set(xticks=[], ylim=(0, target * 1.3))
            continue
        labels, spreads = zip(*goal_bars)
        medians = [s.median for s in spreads]
        whiskers = [[s.median - s.low for s in spreads], [s.high - s.median for s in spreads]]
        colors = ["C2" if m >= target else "C1" for m in medians]
        axis.bar(range(len(spreads)), medians, 0.6, color=colors, yerr=whiskers, capsize=3, ecolor="0.3")
        for index, spread in enumerate(spreads):
            axis.text(index, spread.high, f"{spread.median:.2f}", ha="center", va="bottom", fontsize=8)
        axis.set(xticks=range(len(labels)), ylim=(0, max(target, *(s.high for s in spreads)) * 1.15))
        axis.set_xticklabels(labels, fontsize=8)
    figure.tight_layout()
    save_svg(figure, path)
    plt.close(figure)


def generated_files():
    return {
        "docs/generated/bench_meta.md": write_meta,
        "docs/generated/bench_roofs.md": write_roofs_table,
        "docs/generated/bench_timings.md": write_timing_table,
        "docs/generated/bench_summary.md": write_ratio_summary,
        "docs/generated/s05_prepare_profile.md": write_profile_table,
        "docs/generated/bench_correctness.md": write_correctness_table,
        "docs/generated/bench_precision.md": write_precision_table,
        "docs/generated/bench_plots.svg": write_plots,
        "docs/generated/kimi_goals.svg": write_kimi_goals_plot,
    }
