"""benchmarks.studies.s06_gradient_accuracy's summary and stage 6's table made from it: the 1.1 goal read on
the geometric mean over seeds, the worst seed beside it (small results written here; the study itself
needs a GPU and FLA)."""

import csv

import pytest

from benchmarks.studies import s06_gradient_accuracy as study
from kdacourse.pages import s06_backward as page

FIELDS = ["shape", "mode", "layout", "seed", "tensor", "ours_rel_l2", "fla_rel_l2", "ratio"]


def _rows(ratios_by_tensor, shape=page.GRADIENT_ACCURACY_SHAPE):
    return [{"shape": shape, "mode": "kernels", "layout": "gentle", "seed": seed, "tensor": name,
             "ours_rel_l2": "0", "fla_rel_l2": "0", "ratio": str(ratio)}
            for name, ratios in ratios_by_tensor.items() for seed, ratio in enumerate(ratios)]


def test_the_goal_is_read_on_the_geometric_mean_with_the_worst_seed_beside_it():
    groups = study.ratios_by_group(_rows({"q": [1.0, 1.44], "k": [1.21, 1.0]}))
    mean, worst, seeds = groups[(page.GRADIENT_ACCURACY_SHAPE, "kernels", "gentle", "q")]
    assert (mean, worst, seeds) == (pytest.approx(1.2), 1.44, 2)
    assert groups[(page.GRADIENT_ACCURACY_SHAPE, "kernels", "gentle", "k")][0] == pytest.approx(1.1)
    table = study.summary(_rows({"q": [1.0, 1.44], "k": [1.0, 1.0]}))
    assert "| q | 2 | 1.200 **over 1.1** | 1.440 |" in table
    assert "| k | 2 | 1.000 | 1.000 |" in table


def test_the_page_shows_the_newest_run_then_each_run_beside_the_other_and_marks_a_mean_past_the_goal(tmp_path, monkeypatch):
    runs = {}
    for label, ratio in (("before", 1.3), ("after", 1.05)):
        folder = tmp_path / label
        folder.mkdir()
        with open(folder / "gradient_accuracy.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, FIELDS)
            writer.writeheader()
            writer.writerows(_rows({name: [ratio, ratio] for name in study.NAMES}))
            writer.writerows(_rows({name: [9.0] for name in study.NAMES}, shape="1,2,3,4"))  # another shape: left out
        runs[label] = str(folder)
    monkeypatch.setattr(page, "GRADIENT_ACCURACY_RUNS", runs)
    page.write_gradient_accuracy_table(tmp_path / "table.md")
    text = (tmp_path / "table.md").read_text()
    newest, history = text.split("run by run")
    assert "| tensor | kernels, gentle |" in newest and "| q | 1.05 (1.05) |" in newest  # the last run alone
    assert "| tensor | kernels: before | kernels: after |" in history
    assert "| q | 1.30 (1.30) **over** | 1.05 (1.05) |" in history
    assert "9.00" not in text
