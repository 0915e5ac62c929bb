"""Fold the results of one or more benchmark runs into the committed ones.

    python -m benchmarks.merge RUN_DIR [RUN_DIR ...]

Each RUN_DIR is a `python -m benchmarks.bench --out RUN_DIR` folder. A stage found in a run's
bench.csv (or precision.csv) replaces that stage's rows in benchmarks/results/bench.csv (or
precision.csv); the other stages keep theirs. benchmarks/results/meta.json keeps one entry per run
that still provides rows, with the stages it provides, so the page can say which run measured what.
Within a run every ratio is measured in one process; across runs only the ratios are compared.
"""

import csv
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # benchmarks/results, the committed results
TABLES = {"bench.csv": "timed", "precision.csv": "precision"}  # file -> the meta key naming its stages


def read_rows(path):
    if not path.exists():
        return None, []
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def write_rows(path, fields, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(rows)


def load_runs():
    """The committed runs; a meta.json from before this tool is one run providing every stage present."""
    path = RESULTS / "meta.json"
    if not path.exists():
        return []
    meta = json.loads(path.read_text())
    if "runs" in meta:
        return meta["runs"]
    for name, key in TABLES.items():
        meta[key] = sorted({row["stage"] for row in read_rows(RESULTS / name)[1]})
    return [meta]


def merge(run_dirs):
    runs = load_runs()
    for run_dir in map(Path, run_dirs):
        if not (run_dir / "meta.json").exists():
            raise SystemExit(f"{run_dir} holds no meta.json: give the --out folder of `python -m benchmarks.bench`")
        run = json.loads((run_dir / "meta.json").read_text())
        for name, key in TABLES.items():
            fields, new_rows = read_rows(run_dir / name)
            new_stages = {row["stage"] for row in new_rows}
            run[key] = sorted(new_stages)
            if not new_rows:
                continue
            old_fields, old_rows = read_rows(RESULTS / name)
            kept = [row for row in old_rows if row["stage"] not in new_stages]
            all_fields = (old_fields or []) + [field for field in fields if field not in (old_fields or [])]
            write_rows(RESULTS / name, all_fields, kept + new_rows)
            for earlier in runs:
                earlier[key] = [stage for stage in earlier.get(key, []) if stage not in new_stages]
        runs.append(run)
    runs = [run for run in runs if any(run.get(key) for key in TABLES.values())]
    (RESULTS / "meta.json").write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    return runs


def main(argv=None):
    run_dirs = sys.argv[1:] if argv is None else argv
    if not run_dirs:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    for run in merge(run_dirs):
        print(f"{run['date']}: timed {', '.join(run.get('timed', [])) or '-'}; "
              f"precision {', '.join(run.get('precision', [])) or '-'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
