"""Time untrusted grading: one full submission (`course grade`) and a class (`course grade-all`).

    python -m benchmarks.grading_speed [--students 30] [--trust] [--out benchmarks/results/grading_speed.csv]

The submissions are made from the course itself: the full one is a copy of solutions/ (every
exercise passes, so every test runs); the class alternates copies of solutions/ and of the shipped
exercises/ (fill exercises fail at once, fix exercises run their tests and fail some). Issue 13's
targets on 2 cores: a full submission in at most 2 minutes, 30 submissions in at most 30 minutes.

Each row records the wall-clock time, the CPU time of the whole process tree (sandboxes included),
and the load average before and after: on a shared machine the wall clock grows with other work,
the CPU time does not.
"""

import argparse
import csv
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kdacourse import REPO_ROOT

RESULTS = Path(__file__).parent / "results" / "grading_speed.csv"
FIELDS = ["command", "students", "exercise_runs", "wall_s", "cpu_s", "load_before", "load_after", "sandbox", "machine"]


def _course(*arguments):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    completed = subprocess.run([sys.executable, "-m", "kdacourse.cli", *map(str, arguments)], cwd=REPO_ROOT,
                               capture_output=True, text=True, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0:
        raise SystemExit(f"course {' '.join(map(str, arguments))} failed:\n{completed.stdout}\n{completed.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu, load_before, os.getloadavg()[0]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--students", type=int, default=30)
    parser.add_argument("--trust", action="store_true", help="grade without the sandbox, for comparison")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    trust = ["--trust"] if args.trust else []
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; Python {platform.python_version()}"
    from kdacourse.catalog import exercises

    rows = []
    with tempfile.TemporaryDirectory(prefix="grading-speed-") as work:
        work = Path(work)
        shutil.copytree(REPO_ROOT / "solutions", work / "one")
        wall, cpu, load_before, load_after = _course("grade", work / "one", "--out", work / "one-out", *trust)
        rows.append({"command": "grade", "students": 1, "exercise_runs": len(exercises()), "wall_s": round(wall, 1),
                     "cpu_s": round(cpu, 1), "load_before": load_before, "load_after": load_after})
        print(f"one full submission: {wall:.0f} s wall, {cpu:.0f} s CPU", flush=True)
        for number in range(args.students):
            source = REPO_ROOT / ("solutions" if number % 2 == 0 else "exercises")
            shutil.copytree(source, work / "class" / f"student{number:02d}", ignore=shutil.ignore_patterns("__pycache__"))
        wall, cpu, load_before, load_after = _course("grade-all", work / "class", "--out", work / "class-out", *trust)
        rows.append({"command": "grade-all", "students": args.students,
                     "exercise_runs": args.students * len(exercises()), "wall_s": round(wall, 1),
                     "cpu_s": round(cpu, 1), "load_before": load_before, "load_after": load_after})
        print(f"{args.students} submissions: {wall:.0f} s wall, {cpu:.0f} s CPU", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "sandbox": not args.trust, "machine": machine})
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
