"""Stage 5 measured fairly: the tables and the roofline of the benchmarks page's "Measured fairly".

Reads benchmarks/results/fair.csv and fair_meta.json, written on a GPU by
`python -m benchmarks.fair --out DIR` and committed from DIR; writes docs/generated/fair_*. Without
them each file says that nothing is measured yet. The FLOPs and bytes of each kernel come from the
run's rows, which counted them from the kernels' TileLang programs (stages.common.program_cost); the
roofs from the run's own measurement (benchmarks/roofs.py), else the figures of DESIGN.md. Every file
is read through kdacourse.results.
"""

from kdacourse import results
from kdacourse.pages.tables import markdown_table, save_svg, spread_cell

RESULTS = results.RESULTS
NOT_MEASURED = ("Not measured yet: `python -m benchmarks.fair --out DIR` on a CUDA machine writes "
                "DIR/fair.csv and DIR/fair_meta.json; committed to benchmarks/results/, `course regenerate` "
                "puts them here.\n")
KERNEL_LABELS = {"prepare": "prepare", "recurrence": "recurrence"}


def _run(folder=None):
    """(rows, meta) of the committed fair run in `folder` (benchmarks/results/ unless given), or (None, None)."""
    return results.committed_run(results.FAIR_CSV, results.FAIR_META, folder or RESULTS)


def _shape(shape):
    return "{}, {}, {}, {}".format(*shape)


def _roofs(meta):
    """(bandwidth bytes/s, bf16 FLOP/s, where they come from)."""
    measured = results.roofs_of(meta or {})
    if measured is not None:
        where = meta.get("roofs_from") or f"measured by the run on its {meta['device']}"
        return measured["bandwidth_bytes_per_s"], measured["bf16_flops_per_s"], where
    return results.DESIGN_COPY_BANDWIDTH, results.DESIGN_GEMM_FLOPS, "measured before the runs (DESIGN.md)"


def about_the_run(meta, current=None):
    """One line on the run: when, where, how many rounds, and whether its kernel is the committed one
    (`current`: the committed kernel's digest, stage 5's unless given)."""
    current = current or results.current_kernel_digest("s05_fast_kda")
    kernel = "the committed kernel" if meta.get("kernel") == current else "an earlier kernel (changed since)"
    complete = meta.get("complete", True)
    # a stopped run's seconds are those of its last write of the meta file, not its length
    seconds = f", {meta.get('seconds', '?')} s" if complete else ""
    stopped = "" if complete else " The run was stopped before it finished."
    note = f" {meta['note']}" if meta.get("note") else ""
    return (f"Run of {meta['date']} on an {meta['device']} (`{results.shown_command(meta['command'])}`, "
            f"{meta['rounds']} round{'' if meta['rounds'] == 1 else 's'}{seconds}), on {kernel}."
            f"{stopped}{note}\n\n")


def write_timings(path, folder=None):
    """FLA / ours, kernels alone and whole calls, and the value check's cost; then the times themselves
    (of the run in `folder`, benchmarks/results/ unless given)."""
    rows, meta = _run(folder)
    if rows is None:
        path.write_text(NOT_MEASURED)
        return
    named = results.fair_comparisons(rows)
    summary = results.summarize(rows)

    ratios = markdown_table(
        ["B, N, H, D", "kernels alone: FLA / ours", "whole call, checks off: FLA / ours",
         "default call: FLA / ours", "default call / checks off", "value check on the host alone (ms)"],
        [(_shape(shape), spread_cell(n["kernels FLA / ours"], "{:.2f}"),
          spread_cell(n["call FLA / ours unchecked"], "{:.2f}"), spread_cell(n["call FLA / ours checked"], "{:.2f}"),
          spread_cell(n["call, checks on / off"], "{:.3f}"),
          spread_cell(n["check alone"], "{:.3f}")) for shape, n in sorted(named.items())])
    costs = markdown_table(
        ["B, N, H, D", "the flags in the prepare (% of the kernels)", "the any-gate branch (% of the kernels)"],
        [(_shape(shape), spread_cell(n["flags in the prepare (% of the kernels)"], "{:+.1f}"),
          spread_cell(n["any-gate branch (% of the kernels)"], "{:+.1f}")) for shape, n in sorted(named.items())])
    columns = [("ours", "kernels"), ("ours", "prepare"), ("ours", "recurrence"), ("ours", "call_unchecked"),
               ("ours", "call"), ("fla", "kernels"), ("fla", "call")]
    headers = {"kernels": "kernels alone", "prepare": "prepare", "recurrence": "recurrence",
               "call_unchecked": "call, checks off", "call": "call"}
    times = markdown_table(
        ["B, N, H, D", *(f"{'FLA' if impl == 'fla' else 'ours'} {headers[what]} (ms)" for impl, what in columns)],
        [(_shape(shape), *(spread_cell(measured.get(key), "{:.3f}") for key in columns))
         for shape, measured in sorted(summary.items())])
    failed = sorted({f"{row['impl']} {row['what']} at {row['B']}, {row['N']}, {row['H']}, {row['D']}: {row['error']}"
                     for row in rows if row.get("error")})
    notes = "".join(f"- {line}\n" for line in failed)
    gates = meta.get("gate_range")
    gate_note = f"Gates a = e^g uniform in [{gates[0]:g}, {gates[1]:g}].\n\n" if gates else ""
    path.write_text(about_the_run(meta) + gate_note + ratios
                    + "\nWhat the prepare kernel's value flags and its any-gate branch cost, each timed alone as a "
                    "CUDA graph beside the prepare without it (`prepare_flagged`, `prepare_bounded_gate`):\n\n"
                    + costs + "\nThe times, medians over the rounds (min to max):\n\n" + times
                    + (f"\nNot measured:\n\n{notes}" if notes else ""))


def _points(rows):
    """[(kernel, shape, gemm_flops, bytes, median ms)] for the kernels timed alone."""
    summary, costs = results.summarize(rows), results.kernel_costs(rows)
    points = []
    for (shape, kernel), cost in sorted(costs.items()):
        spread = summary.get(shape, {}).get(("ours", kernel))
        if spread is not None:
            points.append((kernel, shape, cost["gemm_flops"], cost["bytes_read"] + cost["bytes_written"],
                           spread.median, cost["elementwise_flops"]))
    return points


def write_roofline_table(path):
    rows, meta = _run()
    if rows is None:
        path.write_text(NOT_MEASURED)
        return
    bandwidth, peak, source = _roofs(meta)
    ridge = peak / bandwidth
    table = []
    for kernel, shape, flops, moved, ms, elementwise in _points(rows):
        seconds = ms * 1e-3
        intensity = flops / moved
        attainable = min(peak, bandwidth * intensity)
        limit = "memory" if intensity < ridge else "tensor cores"
        table.append((KERNEL_LABELS[kernel], _shape(shape), f"{ms:.3f}", f"{flops / 1e9:.1f}", f"{elementwise / 1e9:.2f}",
                      f"{moved / 1e6:.0f}", f"{intensity:.1f}", f"{flops / seconds / 1e12:.1f}",
                      f"{moved / seconds / 1e12:.2f}", limit, f"{flops / seconds / attainable:.0%}"))
    path.write_text(
        f"Roofs: {results.tb_per_s(bandwidth)} and {results.tflop_per_s(peak)} bf16, {source}; the ridge, where "
        f"the two meet, is at {ridge:.0f} FLOP/byte.\n\n"
        + markdown_table(["kernel", "B, N, H, D", "time (ms)", "GEMM GFLOP", "element-wise GFLOP", "MB moved",
                          "FLOP/byte", "TFLOP/s", "TB/s", "roof at its intensity", "of that roof"], table))


def write_roofline_plot(path):
    """Arithmetic intensity against achieved GEMM FLOP/s, both roofs, one point per kernel and shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, meta = _run()
    figure, axis = plt.subplots(figsize=(8, 5))
    if rows is None:
        axis.text(0.5, 0.5, "not measured yet", ha="center", va="center", fontsize=16, transform=axis.transAxes)
        axis.set_axis_off()
        save_svg(figure, path)
        plt.close(figure)
        return
    bandwidth, peak, source = _roofs(meta)
    points = _points(rows)
    intensities = [flops / moved for _, _, flops, moved, _, _ in points] or [1.0]
    low, high = min(min(intensities) / 4, 1.0), max(max(intensities) * 4, 4 * peak / bandwidth)
    xs = [low * (high / low) ** (i / 200) for i in range(201)]
    axis.plot(xs, [min(peak, bandwidth * x) for x in xs], color="black", linewidth=1.2)
    axis.text(low * 1.2, bandwidth * low * 1.6, f"memory {results.tb_per_s(bandwidth)}", fontsize=8)
    axis.text(high / 1.2, peak * 1.1, f"bf16 tensor cores {results.tflop_per_s(peak)}", ha="right", fontsize=8)
    markers = {"prepare": "o", "recurrence": "s"}
    shapes = sorted({shape for _, shape, *_ in points})
    colors = {shape: f"C{index}" for index, shape in enumerate(shapes)}
    placed = set()
    for kernel, shape, flops, moved, ms, _ in points:
        x, y = flops / moved, flops / (ms * 1e-3)
        axis.plot([x], [y], markers[kernel], color=colors[shape], markersize=7, alpha=0.8)
        if kernel not in placed:  # the shapes of one kernel sit close together: one label for them
            axis.annotate(kernel, (x, y), textcoords="offset points", xytext=(8, 4), fontsize=9)
            placed.add(kernel)
    for kernel, marker in markers.items():
        axis.plot([], [], marker, color="gray", label=kernel)
    for shape, color in colors.items():
        axis.plot([], [], "o", color=color, label=f"B={shape[0]}, N={shape[1]}, H={shape[2]}")
    axis.axvline(peak / bandwidth, color="gray", linewidth=0.6, linestyle=":")
    axis.set(xscale="log", yscale="log", xlabel="arithmetic intensity (GEMM FLOPs per byte of global memory)",
             ylabel="achieved GEMM FLOP/s", title="stage 5's kernels alone, bf16, d = 128 (dotted: the ridge)")
    axis.legend(loc="lower right", fontsize=7)
    save_svg(figure, path)
    plt.close(figure)


def generated_files():
    return {
        "docs/generated/fair_timings.md": write_timings,
        # the run after the value flags (issue 27): what they and the any-gate branch cost
        "docs/generated/fair_checks.md": lambda path: write_timings(path, RESULTS / "fair_checks"),
        # the any-gate branch's worst case: every diagonal sub-block past the operands' range
        "docs/generated/fair_any_gate_worst.md": lambda path: write_timings(path, RESULTS / "fair_any_gate_worst"),
        "docs/generated/fair_roofline.md": write_roofline_table,
        "docs/generated/fair_roofline.svg": write_roofline_plot,
    }
