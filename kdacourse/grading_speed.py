"""Time untrusted grading: one full submission (`course grade`) and a class (`course grade-all`).

    python -m kdacourse.grading_speed [--students 30] [--endless 5] [--stages s01 ...] [--trust]
                                      [--out benchmarks/results/grading_speed.csv]

It lives in the grader's package, not in benchmarks/ (which never imports the course's tooling), and
writes its figures beside the other benchmarks' in benchmarks/results/.

The submissions are made from the course itself: the full one is a copy of solutions/ (every
exercise passes, so every test runs); the class alternates copies of solutions/ and of the shipped
exercises/ (fill exercises fail at once, fix exercises run their tests and fail some), and --endless
of its solution copies loop forever in one exercise (each stage's first, reference A), graded at the
default limit (60 s a call). --stages keeps only those stages in every submission. Issue 13's targets
on 2 cores: a full submission in at most 2 minutes, 30 submissions in at most 30 minutes; issue 25's:
30 submissions, 5 of them with an endless loop, in at most 10 minutes.

Each row records the wall-clock time, the CPU time of the whole process tree, and the load average
before and after: on a shared machine the wall clock grows with other work, the CPU time does not.
The CPU time is read from a cgroup of its own where the machine lets us make one (cgroup v1's
cpuacct, as root): it then counts the sandboxed children too, which grading kills rather than waits
for, so that the rusage of waited children (the fallback, column cpu_from) misses them.
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
from kdacourse.catalog import resolve_stage
from kdacourse.shipped import split_region

RESULTS = REPO_ROOT / "benchmarks" / "results" / "grading_speed.csv"
CPUACCT = Path("/sys/fs/cgroup/cpuacct")
FIELDS = ["command", "students", "endless", "stages", "exercise_runs", "wall_s", "cpu_s", "slowest_endless_s",
          "load_before", "load_after", "sandbox", "machine", "cpu_from"]
ENDLESS_LOOP = "while True:\n    pass"


def _copy(source, destination, stages):
    """source's folders of `stages` (every stage when None) into destination."""
    for folder in sorted(source.iterdir()):
        if folder.is_dir() and (stages is None or folder.name in stages):
            shutil.copytree(folder, destination / folder.name, ignore=shutil.ignore_patterns("__pycache__"))


def _loop_forever(submission, exercise):
    """The exercise's region of the submission's file replaced by an endless loop."""
    path = submission / exercise.stage / exercise.file
    before, region, after = split_region(path.read_text())
    indent = region[: len(region) - len(region.lstrip())]
    path.write_text(before + "".join(indent + line + "\n" for line in ENDLESS_LOOP.splitlines()) + after)


def _cgroup():
    """A fresh cpuacct cgroup folder for the grading process tree, or None where none can be made."""
    try:
        folder = CPUACCT / f"grading-speed-{os.getpid()}-{time.monotonic_ns()}"
        folder.mkdir()
        return folder
    except OSError:
        return None


def _course(*arguments):
    """Run `course ARGUMENTS`: (wall s, CPU s, load before, load after, where the CPU time came from)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load_before = os.getloadavg()[0]
    cgroup = _cgroup()
    # the child joins the cgroup before it starts anything, so every process it starts is counted
    join = (lambda: (cgroup / "cgroup.procs").write_text(str(os.getpid()))) if cgroup else None
    started = time.monotonic()
    completed = subprocess.run([sys.executable, "-m", "kdacourse.cli", *map(str, arguments)], cwd=REPO_ROOT,
                               capture_output=True, text=True, stdin=subprocess.DEVNULL, preexec_fn=join)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if completed.returncode != 0:
        raise SystemExit(f"course {' '.join(map(str, arguments))} failed:\n{completed.stdout}\n{completed.stderr}")
    if cgroup is not None:
        cpu, source = int((cgroup / "cpuacct.usage").read_text()) / 1e9, "cgroup"
        _remove_when_empty(cgroup)
    else:
        cpu, source = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), "rusage"
    return wall, cpu, load_before, os.getloadavg()[0], source


def _remove_when_empty(cgroup):
    for _ in range(50):  # a killed sandbox's processes may take a moment to leave
        try:
            cgroup.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--students", type=int, default=30)
    parser.add_argument("--endless", type=int, default=5, help="submissions with an endless loop in one exercise")
    parser.add_argument("--stages", nargs="*", help="only these stages in every submission (default: all)")
    parser.add_argument("--skip-one", action="store_true", help="time the class only, not one full submission")
    parser.add_argument("--trust", action="store_true", help="grade without the sandbox, for comparison")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    trust = ["--trust"] if args.trust else []
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; Python {platform.python_version()}"
    from kdacourse.catalog import exercises

    stages = {resolve_stage(stage) for stage in args.stages} if args.stages else None
    graded = [exercise for exercise in exercises() if stages is None or exercise.stage in stages]
    looping = [next(e for e in graded if e.stage == stage) for stage in dict.fromkeys(e.stage for e in graded)]
    stage_names = " ".join(sorted({e.stage for e in graded}))
    rows = []
    with tempfile.TemporaryDirectory(prefix="grading-speed-") as work:
        work = Path(work)
        if not args.skip_one:
            _copy(REPO_ROOT / "solutions", work / "one", stages)
            wall, cpu, load_before, load_after, source = _course("grade", work / "one", "--out", work / "one-out",
                                                                 *trust)
            rows.append({"command": "grade", "students": 1, "endless": 0, "stages": stage_names,
                         "exercise_runs": len(graded), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                         "load_before": load_before, "load_after": load_after, "cpu_from": source})
            print(f"one full submission: {wall:.0f} s wall, {cpu:.0f} s CPU", flush=True)
        endless = []
        for number in range(args.students):
            student = work / "class" / f"student{number:02d}"
            _copy(REPO_ROOT / ("solutions" if number % 2 == 0 else "exercises"), student, stages)
            if number % 2 == 0 and len(endless) < args.endless:
                exercise = looping[len(endless) % len(looping)]
                _loop_forever(student, exercise)
                endless.append((student.name, exercise.id))
        wall, cpu, load_before, load_after, source = _course("grade-all", work / "class", "--out",
                                                             work / "class-out", *trust)
        slowest = max((_seconds(work / "class-out" / name, exercise_id) for name, exercise_id in endless), default=0)
        rows.append({"command": "grade-all", "students": args.students, "endless": len(endless), "stages": stage_names,
                     "exercise_runs": args.students * len(graded), "wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
                     "slowest_endless_s": slowest, "load_before": load_before, "load_after": load_after,
                     "cpu_from": source})
        print(f"{args.students} submissions ({len(endless)} with an endless loop): {wall:.0f} s wall, {cpu:.0f} s CPU; "
              f"the slowest endless exercise took {slowest:.0f} s", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({**row, "sandbox": not args.trust, "machine": machine})
    print(f"written to {args.out}")


def _seconds(report_folder, exercise_id):
    """How long grading took for one exercise, from a student's report.json."""
    import json

    report = json.loads((report_folder / "report.json").read_text())
    return next(entry["seconds"] for entry in report["exercises"] if entry["id"] == exercise_id)


if __name__ == "__main__":
    main()
