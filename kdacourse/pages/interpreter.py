"""The interpreter page's speed table, from benchmarks/results/interpreter_speed.csv.

That CSV is written by `python -m benchmarks.interpreter_speed` (CPU only, one pinned core). Each row
carries the digest of its kernel module's program builders; a kernel whose builders have changed since
is marked, so the page never shows an old kernel's figure as the current one's.
"""

from kdacourse import results
from kdacourse.pages.tables import markdown_table

RESULTS = results.RESULTS / "interpreter_speed.csv"
STAGE_MODULES = {"s01": "s01_linear_attention", "s02": "s02_scalar_decay", "s03": "s03_gated_deltanet",
                 "s04": "s04_kda", "s05": "s05_fast_kda"}


def _current_digest(kernel):
    """The digest of the committed kernel module named by a row's kernel ("s03 build_program")."""
    return results.current_kernel_digest(STAGE_MODULES[kernel.split()[0]])


def write_speed_table(path):
    if not RESULTS.exists():
        path.write_text("No interpreter timings are committed yet: run `python -m benchmarks.interpreter_speed`.\n")
        return
    rows = results.read_rows(RESULTS)
    table = []
    for row in rows:
        changed = "" if _current_digest(row["kernel"]) == row["kernel_digest"] else " (kernel changed since)"
        table.append((f"`{row['kernel']}`{changed}", row["parse_s"], row["setup_s"], row["run_median_s"],
                      row["rel_l2_vs_reference_a"] or "–"))
    first = rows[0]
    shape = f"B={first['B']}, N={first['N']}, H={first['H']}, d_k = d_v = {first['d']}, {first['dtype']}"
    header = ["kernel", "parse (s)", "set-up (s)", f"run, median of {first['runs']} (s)", "rel L2 vs reference A"]
    path.write_text(f"CPU seconds at {shape}, on {first['machine']}.\n\n" + markdown_table(header, table))


def generated_files():
    return {"docs/generated/interpreter_speed.md": write_speed_table}
