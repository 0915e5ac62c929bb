"""benchmarks.merge: a run's stages replace those stages' rows; the other stages and runs stay."""

import csv
import json

import pytest

from benchmarks import merge

FIELDS = ["stage", "impl", "time_ms"]


def write_run(folder, rows, meta, name="bench.csv"):
    folder.mkdir(parents=True)
    with open(folder / name, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (folder / "meta.json").write_text(json.dumps(meta))


def read(path):
    with open(path, newline="") as f:
        return [(row["stage"], row["impl"], row["time_ms"]) for row in csv.DictReader(f)]


def test_merge_replaces_the_stages_a_run_measured(tmp_path, monkeypatch):
    results = tmp_path / "results"
    monkeypatch.setattr(merge, "RESULTS", results)
    write_run(results, [dict(stage="a", impl="ours", time_ms="1"), dict(stage="b", impl="ours", time_ms="2")],
              dict(date="d0", command="old", seconds=1))
    write_run(tmp_path / "run", [dict(stage="b", impl="ours", time_ms="3")], dict(date="d1", command="new", seconds=1))

    runs = merge.merge([tmp_path / "run"])

    assert read(results / "bench.csv") == [("a", "ours", "1"), ("b", "ours", "3")]
    assert [(run["command"], run["timed"]) for run in runs] == [("old", ["a"]), ("new", ["b"])]
    assert json.loads((results / "meta.json").read_text())["runs"] == runs


def test_a_run_whose_stages_were_all_replaced_is_dropped(tmp_path, monkeypatch):
    results = tmp_path / "results"
    monkeypatch.setattr(merge, "RESULTS", results)
    write_run(results, [dict(stage="a", impl="ours", time_ms="1")], dict(date="d0", command="old", seconds=1))
    write_run(tmp_path / "timings", [dict(stage="a", impl="ours", time_ms="2")],
              dict(date="d1", command="t", seconds=1))
    write_run(tmp_path / "precision", [dict(stage="a", impl="ours", time_ms="")],
              dict(date="d2", command="p", seconds=1), name="precision.csv")

    runs = merge.merge([tmp_path / "timings", tmp_path / "precision"])

    assert [(run["command"], run["timed"], run["precision"]) for run in runs] == [("t", ["a"], []), ("p", [], ["a"])]
    assert read(results / "bench.csv") == [("a", "ours", "2")]
    assert read(results / "precision.csv") == [("a", "ours", "")]


def test_a_folder_without_meta_is_refused_with_what_to_give(tmp_path, monkeypatch):
    monkeypatch.setattr(merge, "RESULTS", tmp_path / "results")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="holds no meta.json"):
        merge.merge([tmp_path / "empty"])
