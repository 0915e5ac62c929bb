"""benchmarks.figures: the precision table reads stage by stage, whatever order the runs were merged in."""

import csv

from benchmarks import figures

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
