"""The benchmarks page's sections on training and serving: stage 6's forward + backward, stage 7's
variable-length prefill and its decode step, each timed beside FLA 0.6.0.

Reads what the GPU runs wrote, committed to benchmarks/results/:
- backward.csv, backward_meta.json: `python -m benchmarks.backward --out DIR`;
- varlen.csv, varlen_meta.json: `python -m benchmarks.varlen --out DIR`;
- decode.csv: `python -m benchmarks.decode --out DIR`;
and writes docs/generated/{backward,varlen,decode}_timings.md, reading them through kdacourse.results.
Rounds are summarized as the forward's fair timings are: each cell the median over the rounds with
(min to max), a ratio taken within one round, then summarized. Without a run's files its table says so.
"""

import re

from kdacourse import results
from kdacourse.pages.fair import about_the_run
from kdacourse.pages.tables import markdown_table, spread_cell

RESULTS = results.RESULTS
NOT_COMMITTED = ("No {what} timings are committed yet: `python -m benchmarks.{module} --out DIR` on a CUDA machine "
                 "writes {files}; copied to benchmarks/results/, `course regenerate` puts them here.\n")


def committed_run(csv_name, meta_name=None):
    """(rows, meta) of a committed run in RESULTS ({} for a run without a meta file), or (None, None)."""
    return results.committed_run(csv_name, meta_name, RESULTS)


def _shape(shape):
    return "{}, {}, {}, {}".format(*shape)


def _failures(rows, where):
    """A bullet list of the rows that carry an error (each placed by `where(row)`), or ""."""
    failed = sorted({f"{row['impl']} {row['what']} at {where(row)}: {row['error']}"
                     for row in rows if row.get("error")})
    return "\nNot measured:\n\n" + "".join(f"- {line}\n" for line in failed) if failed else ""


# ------------------------------------------------------------------ stage 6: forward and backward

BACKWARD_TIMES = [("ours", "fwd_bwd_kernels", "ours fwd+bwd kernels"), ("ours", "fwd_bwd_call", "ours fwd+bwd call"),
                  ("ours", "fwd_bwd_call_default", "ours fwd+bwd call, default checks"),
                  ("ours", "fwd_bwd_call_kept", "ours fwd+bwd call, forward tensors kept"),
                  ("ours", "backward_kernels", "ours backward kernels"),
                  ("fla", "fwd_bwd_call", "FLA fwd+bwd call"),
                  ("fla", "fwd_bwd_call_kept", "FLA fwd+bwd call, disable_recompute"),
                  ("fla", "backward_call", "FLA backward call")]


def write_backward_timings(path, run=""):
    """FLA / ours for forward + backward (kernels, calls) and the backward alone; the times; each backward
    kernel alone; our gradients against FLA's and the block_dv of both passes. run: the run's folder
    under benchmarks/results ("" for the main run, "backward_b8/" for the later one of two shapes,
    "backward_ours/" for ours alone, "backward_solve/" for the three shapes beside FLA once the intra
    kernel read A_kk and T from the prepare, "backward_ours_padded/" for ours alone with its fp32 rows
    padded, "backward_registers/" for the three shapes beside FLA once it kept its decays in registers)."""
    rows, meta = committed_run(run + results.BACKWARD_CSV, run + results.BACKWARD_META)
    if rows is None:
        path.write_text(NOT_COMMITTED.format(what="backward", module="backward",
                                             files="DIR/backward.csv and DIR/backward_meta.json"))
        return
    named, summary = results.backward_comparisons(rows), results.summarize(rows)
    # a run before a measurement existed (the default checks' call came later) shows no column for it
    ratio_names = [name for name in next(iter(named.values()), {})
                   if any(n[name] is not None for n in named.values())]
    columns = [(impl, what, label) for impl, what, label in BACKWARD_TIMES
               if any((impl, what) in measured for measured in summary.values())]
    ratios = markdown_table(["B, N, H, D", *(name.replace("fwd+bwd", "forward + backward") for name in ratio_names)],
                            [(_shape(shape), *(spread_cell(n[name], "{:.2f}") for name in ratio_names))
                             for shape, n in sorted(named.items())]) if ratio_names else "No ratios: FLA was not run.\n"
    times = markdown_table(["B, N, H, D", *(f"{label} (ms)" for _, _, label in columns)],
                           [(_shape(shape), *(spread_cell(measured.get((impl, what))) for impl, what, _ in columns))
                            for shape, measured in sorted(summary.items())])
    kernels = markdown_table(["B, N, H, D", *(f"{kernel} (ms)" for kernel in results.BACKWARD_KERNELS)],
                             [(_shape(shape), *(spread_cell(measured.get(("ours", kernel)))
                                                for kernel in results.BACKWARD_KERNELS))
                              for shape, measured in sorted(summary.items())])

    def gradient_row(label, notes):
        errors = notes.get("rel_l2_ours_vs_fla") or {}
        shape = re.findall(r"=(\d+)", label)  # the meta names a shape "B=1 N=4096 H=32 D=128"
        return (", ".join(shape), *(f"{errors[name]:.2e}" if name in errors else "–" for name in results.BACKWARD_GRADIENTS),
                notes.get("forward_block_dv", "–"), notes.get("backward_block_dv", "–"))

    gradients = markdown_table(["B, N, H, D", *(f"{name}: rel L2 vs FLA" for name in results.BACKWARD_GRADIENTS),
                                "forward block_dv", "backward block_dv"],
                               [gradient_row(label, notes) for label, notes in meta.get("shapes", {}).items()])
    path.write_text(about_the_run(meta, results.current_kernel_digest("s06_backward")) + ratios
                    + "\nThe times, medians over the rounds (min to max):\n\n" + times
                    + "\nThe backward's five kernels, each alone on the outputs of the one before, medians over the "
                    "rounds (min to max):\n\n" + kernels
                    + "\nOur gradients against FLA's at each shape, and the value columns per program of each pass:\n\n"
                    + gradients + _failures(rows, lambda row: f"{row['B']}, {row['N']}, {row['H']}, {row['D']}"))


# ------------------------------------------------------------------ stage 7: variable-length prefill

VARLEN_TIMES = [("ours", "call", "ours call"), ("ours", "call_unchecked", "ours call, checks off"),
                ("ours", "kernels", "ours kernels alone"), ("ours", "one_sequence", "stage 5, one sequence"),
                ("ours", "graph", "ours as a graph"), ("fla", "call", "FLA call"),
                ("fla", "call_new_cu_seqlens", "FLA call, a new cu_seqlens"), ("fla", "graph", "FLA as a graph")]


def write_varlen_timings(path):
    """Per mix: its tokens, FLA / ours for the calls, the times over rounds, ours against FLA's output."""
    rows, meta = committed_run("varlen.csv", "varlen_meta.json")
    if rows is None:
        path.write_text(NOT_COMMITTED.format(what="variable-length prefill", module="varlen",
                                             files="DIR/varlen.csv and DIR/varlen_meta.json"))
        return
    first = {row["mix"]: row for row in reversed(rows)}  # per mix, its sizes (the same on every row)
    mixes = list(dict.fromkeys(row["mix"] for row in rows))
    measured = results.varlen_times(rows)
    rounds = max(int(row["round"]) for row in rows)

    def ratio(mix, fla, ours):
        return spread_cell(results.paired(measured[mix], fla, ours, results.ratio), "{:.2f}")

    def checked(mix, key):
        value = meta.get("mixes", {}).get(mix, {}).get(key)
        return f"{value:.2e}" if value is not None else "–"

    sizes = markdown_table(
        ["mix", "sequences", "tokens", "rows chunk-aligned", "H, D", "FLA call / ours call",
         "FLA call / ours call, checks off", "o: rel L2 vs FLA", "final states: rel L2 vs FLA"],
        [(mix, first[mix]["sequences"], first[mix]["tokens"], first[mix]["padded_tokens"],
          f"{first[mix]['H']}, {first[mix]['D']}", ratio(mix, ("fla", "call"), ("ours", "call")),
          ratio(mix, ("fla", "call"), ("ours", "call_unchecked")), checked(mix, "rel_l2_o_ours_vs_fla"),
          checked(mix, "rel_l2_state_ours_vs_fla")) for mix in mixes])
    times = markdown_table(
        ["mix", *(f"{label} (ms)" for _, _, label in VARLEN_TIMES)],
        [(mix, *(spread_cell(results.Spread.of(measured[mix].get((impl, what), {}).values()))
                 for impl, what, _ in VARLEN_TIMES))
         for mix in mixes])
    about = (f"Run on an {meta.get('device', '?')} (`{results.shown_command(meta.get('command', '?'))}`, {rounds} "
             f"round{'s' if rounds > 1 else ''}, {first[mixes[0]]['dtype']}).\n\n")
    path.write_text(about + sizes + "\nThe times, medians over the rounds (min to max):\n\n" + times
                    + _failures(rows, lambda row: f"the {row['mix']} mix"))


# ------------------------------------------------------------------ stage 7: the decode step

def _decode_command(rows):
    """The command that writes a decode.csv of these rows' sizes and block_dvs (decode.csv keeps no command)."""
    row = rows[0]
    block_dvs = ",".join(dict.fromkeys(r["block_dv"] for r in rows if r["impl"] == "ours" and r["what"] == "kernel"))
    return (f"python -m benchmarks.decode --out DIR --B {row['B']} --H {row['H']} --d {row['d_k']} "
            f"--pool {row['pool']} --block-dv {block_dvs} --dtype {row['dtype']}")


def write_decode_timings(path):
    """Each measurement of the decode step: its time (median, 20th to 80th percentile of the repeats), the
    bytes it moves per second as a fraction of the copy bandwidth measured in the same run, FLA / ours
    against FLA in the same form (graph or call), and the errors against the float64 step."""
    rows, _ = committed_run("decode.csv")
    if rows is None:
        path.write_text(NOT_COMMITTED.format(what="decode", module="decode", files="DIR/decode.csv"))
        return
    timed = [row for row in rows if row.get("time_ms")]
    fla = {row["what"]: float(row["time_ms"]) for row in timed if row["impl"] == "fla"}
    # ours' measurement: FLA's timed the same way
    same_form = {"kernel": "kernel", "call": "call", "call_graph": "kernel", "call_host_checks": "call"}

    def microseconds(row):
        return (f"{float(row['time_ms']) * 1e3:.1f} ({float(row['time_ms_p20']) * 1e3:.1f} to "
                f"{float(row['time_ms_p80']) * 1e3:.1f})")

    def versus_fla(row):
        against = fla.get(same_form.get(row["what"])) if row["impl"] == "ours" else None
        return f"{against / float(row['time_ms']):.2f}" if against else "–"

    forms = {"graph": "CUDA graph", "events": "CUDA events"}
    table = markdown_table(
        ["impl", "what", "block_dv", "timed as", "time (µs)", "TB/s", "of the copy bandwidth",
         "FLA / ours, timed alike",
         "o: rel L2 vs float64", "states: rel L2 vs float64"],
        [("FLA" if row["impl"] == "fla" else "ours", row["what"].replace("_", " "), row["block_dv"] or "–",
          forms.get(row["method"], row["method"]), microseconds(row), f"{float(row['bytes_per_s']) / 1e12:.2f}",
          f"{float(row['fraction_of_copy']):.1%}", versus_fla(row), row["rel_l2_o"] or "–",
          row["rel_l2_state"] or "–")
         for row in timed])
    shape = rows[0]
    about = (f"B = {shape['B']} sequences, H = {shape['H']}, d_k = d_v = {shape['d_k']}, a pool of {shape['pool']} "
             f"fp32 states, {shape['dtype']} q, k, v (`{_decode_command(rows)}`). One step moves "
             f"{int(shape['bytes']) / 2**20:.1f} MiB, {int(shape['state_bytes']) / 2**20:.0f} MiB of them the states "
             f"read and written; the copy bandwidth measured in the same run: "
             f"{float(shape['copy_bytes_per_s']) / 1e12:.2f} TB/s.\n\n")
    path.write_text(about + table + _failures(rows, lambda row: f"block_dv {row['block_dv'] or '–'}"))


DECODE_BATCH_RUNS = ("decode_b1.csv", "decode_b8.csv", "decode.csv", "decode_b256.csv")  # B = 1, 8, 64, 256


def write_decode_batches(path):
    """The decode step at each batch size of DECODE_BATCH_RUNS: each block_dv's kernel and the default
    call (values checked on the device) as CUDA graphs, FLA's graph, FLA / ours and the copy fraction."""
    runs = [rows for rows in (committed_run(name)[0] for name in DECODE_BATCH_RUNS) if rows]
    if not runs:
        path.write_text(NOT_COMMITTED.format(what="decode", module="decode", files="DIR/decode.csv"))
        return
    table = []
    for rows in runs:
        timed = {(row["impl"], row["what"], row["block_dv"]): row for row in rows if row.get("time_ms")}
        fla = timed.get(("fla", "kernel", ""))
        for (impl, what, block_dv), row in timed.items():
            if impl != "ours" or what not in ("kernel", "call_graph"):
                continue
            milliseconds = float(row["time_ms"])
            table.append((row["B"], "kernel" if what == "kernel" else "default call", block_dv,
                          f"{milliseconds * 1e3:.1f}", f"{float(row['fraction_of_copy']):.1%}",
                          f"{float(fla['time_ms']) * 1e3:.1f}" if fla else "–",
                          f"{float(fla['time_ms']) / milliseconds:.2f}" if fla else "–"))
    commands = "; ".join(f"`{_decode_command(rows)}`" for rows in runs)
    path.write_text(f"Each CUDA graph replayed, H = 32, d_k = d_v = 128, a pool of 256 fp32 states, bf16 q, k, v; "
                    f"one run per batch size ({commands}).\n\n" + markdown_table(
                        ["B", "ours", "block_dv", "time (µs)", "of the copy bandwidth", "FLA graph (µs)",
                         "FLA / ours"], table))


DECODE_THREAD_RUNS = ("decode_b64_blocks.csv", "decode_b64_t256.csv", "decode_b64_t64.csv")  # 128, 256, 64 threads


def write_decode_threads(path):
    """Decode's kernel at B = 64 for each threads a program and block_dv of DECODE_THREAD_RUNS, as CUDA
    graphs: its time, the fraction of the copy bandwidth measured in its run, and FLA's graph of the
    same run."""
    rows = [row for rows in (committed_run(name)[0] for name in DECODE_THREAD_RUNS) if rows
            for row in rows if row["what"] == "kernel" and row.get("time_ms")]
    if not rows:
        path.write_text(NOT_COMMITTED.format(what="decode", module="decode", files="DIR/decode.csv"))
        return
    fla = {row["threads"]: float(row["time_ms"]) for row in rows if row["impl"] == "fla"}  # one run per threads
    table = [(row["threads"], row["block_dv"], f"{float(row['time_ms']) * 1e3:.1f}",
              f"{float(row['fraction_of_copy']):.1%}", f"{fla[row['threads']] * 1e3:.1f}" if row["threads"] in fla
              else "–") for row in sorted((r for r in rows if r["impl"] == "ours"),
                                          key=lambda r: (int(r["threads"]), int(r["block_dv"])))]
    commands = "; ".join(dict.fromkeys(
        f"`{_decode_command([r for r in rows if r['threads'] == row['threads']])} --threads {row['threads']}`"
        for row in rows))
    path.write_text("Each CUDA graph replayed, B = 64, H = 32, d_k = d_v = 128, a pool of 256 fp32 states, bf16 q, "
                    f"k, v; one run per threads a program ({commands}).\n\n" + markdown_table(
                        ["threads", "block_dv", "time (µs)", "of the copy bandwidth", "FLA graph, same run (µs)"],
                        table))


DECODE_VARIANT_LOGS = {64: "decode_variants_b64.log", 256: "decode_variants_b256.log"}


def write_decode_variants(path):
    """The archived study s07_decode_variants (archive/studies/) at each B of DECODE_VARIANT_LOGS: each
    kernel's median over rounds and its fraction of the copy bandwidth, read from the table that ends its log."""
    table = []
    for B, name in DECODE_VARIANT_LOGS.items():
        log = RESULTS / name
        if not log.exists():
            continue
        medians = log.read_text().split("medians over rounds:")[-1]
        for line in medians.splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if len(cells) == 3:
                table.append((str(B), *cells))
    if not table:
        path.write_text(f"No decode variants study is committed: {results.study_command('s07_decode_variants')} "
                        "wrote benchmarks/results/decode_variants_b64.log and _b256.log.\n")
        return
    path.write_text("Each CUDA graph replayed, H = 32, d_k = d_v = 128, a pool of 256 fp32 states, bf16 q, k, v, "
                    "`block_dv` 64, 128 threads, medians of three interleaved rounds "
                    f"({results.study_command('s07_decode_variants', '--B 64')} and `--B 256`; logs in "
                    "`benchmarks/results/decode_variants_b*.log`):\n\n"
                    + markdown_table(["B", "kernel", "time", "of the copy bandwidth"], table))


def generated_files():
    return {
        "docs/generated/backward_timings.md": write_backward_timings,
        "docs/generated/backward_timings_b8.md": lambda path: write_backward_timings(path, "backward_b8/"),
        "docs/generated/backward_timings_ours.md": lambda path: write_backward_timings(path, "backward_ours/"),
        "docs/generated/backward_timings_solve.md": lambda path: write_backward_timings(path, "backward_solve/"),
        "docs/generated/backward_timings_ours_padded.md": lambda path: write_backward_timings(
            path, "backward_ours_padded/"),
        "docs/generated/backward_timings_registers.md": lambda path: write_backward_timings(
            path, "backward_registers/"),
        "docs/generated/varlen_timings.md": write_varlen_timings,
        "docs/generated/decode_timings.md": write_decode_timings,
        "docs/generated/decode_batches.md": write_decode_batches,
        "docs/generated/decode_threads.md": write_decode_threads,
        "docs/generated/decode_variants.md": write_decode_variants,
    }
