"""benchmarks.figures: the precision table reads stage by stage, whatever order the runs were merged in;
the runs table says which runs measured a kernel that has changed since."""

import csv
import dataclasses
import hashlib
import json

from benchmarks import figures
from benchmarks.bench import STAGES

FIELDS = ["stage", "N", "dtype", "impl", "gate_lower", "gate_upper", "rel_l2_vs_float64", "error"]


def precision_row(stage, N, value, error=""):
    return dict(stage=stage, N=N, dtype="float16", impl="ours", gate_lower="0.9", gate_upper="0.999",
                rel_l2_vs_float64=value, error=error)


def test_precision_table_is_in_stage_order_with_gaps_and_failures_shown(tmp_path, monkeypatch):
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    with open(tmp_path / "precision.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows([
            precision_row("s03_gated_deltanet", 4096, "5e-04"),
            precision_row("s03_gated_deltanet", 65536, "", error="RuntimeError: out of memory"),
            precision_row("s01_linear_attention", 4096, "4e-04"),
            precision_row("s01_linear_attention", 16384, "4e-04"),  # a length the s03 run did not reach
            precision_row("s01_linear_attention", 65536, "5e-04"),
        ])

    figures.write_precision_table(tmp_path / "table.md")

    body = [line.split("|")[1:-1] for line in (tmp_path / "table.md").read_text().splitlines()[2:]]
    cells = [[cell.strip() for cell in line] for line in body]
    assert cells == [
        ["s01 linear attention", "no gates", "float16", "ours", "4e-04", "4e-04", "5e-04"],
        ["s03 Gated DeltaNet", "[0.9, 0.999]", "float16", "ours", "5e-04", "–", "failed"],
    ]


def test_runs_table_flags_results_of_a_kernel_changed_since(tmp_path, monkeypatch):
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    current = STAGES["s05"].kernel_digest()
    run = dict(device="H200", date="d", seconds=1, command="bench", timed=["s05_fast_kda"], precision=[])
    runs = [dict(run, kernels={"s05_fast_kda": current}), dict(run, kernels={"s05_fast_kda": "0" * 12}), run]
    (tmp_path / "meta.json").write_text(json.dumps({"runs": runs}))

    figures.write_meta(tmp_path / "meta.md")

    rows = [line for line in (tmp_path / "meta.md").read_text().splitlines() if line.startswith("| ") and "bench" in line]
    assert [row.split("|")[5].strip() for row in rows] == [
        "as committed", "changed since: s05 fast KDA", "not recorded"]


def test_kernel_digest_follows_the_source(tmp_path, monkeypatch):
    (tmp_path / "probe_kernel.py").write_text("WIDTH = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    stage = dataclasses.replace(STAGES["s05"], kernel_module="probe_kernel")
    before = stage.kernel_digest()
    assert before == hashlib.sha256(b"WIDTH = 1\n").hexdigest()[:12]
    (tmp_path / "probe_kernel.py").write_text("WIDTH = 2\n")
    assert stage.kernel_digest() != before
