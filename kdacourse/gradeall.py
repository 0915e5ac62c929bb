"""Grading a whole class at once: `course grade-all SUBMISSIONS --out DIR`.

SUBMISSIONS holds one folder per student (named as the gradebook should name the student), each laid
out like exercises/. The runs go to one pool, JOBS at a time, so the machine stays busy across
students: in the sandbox a run is one student's whole submission in one test process
(kdacourse.grading.run_batch: one start, one analysis child), as the grader (--trust) one exercise
of one student; either grades as `course grade` does (cheating scored zero). DIR receives:

- gradebook.csv: one row per student, one column per exercise (its points), then the total and the
  maximum; a plain CSV with a header row, which LMS gradebook imports accept (map `student` to the
  LMS's user identifier; an exercise of a stage the student did not hand in counts 0);
- <student>/report.md, report.json, junit.xml: each student's reports, as `course grade` writes them.
"""

import csv
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone
from pathlib import Path

from kdacourse.catalog import exercises, stages
from kdacourse.grading import JOBS, exercise_limit, grade_report, refuse, run_batch, run_exercise, write_reports

BAR_WIDTH = 30


def student_folders(root):
    """The student folders of `root`: sub-folders, not hidden, not links, in name order."""
    return [path for path in sorted(root.iterdir()) if path.is_dir() and not path.is_symlink()
            and not path.name.startswith(".")]


def grade_all(submissions, out, timeout_per_test=60, trust=False, jobs=JOBS):
    """Grade every student folder of `submissions`; write gradebook.csv and per-student reports to `out`.

    Returns the exit code: 0 once graded, 2 when there is nothing to grade or no sandbox."""
    root = Path(submissions).expanduser().resolve()
    if not root.is_dir():
        return refuse(f"cannot grade {submissions}: no such folder")
    out_path = Path(out).expanduser().resolve()
    if out_path == root or root in out_path.parents:
        return refuse(f"the reports would go inside the submissions folder {submissions}; choose --out elsewhere")
    students = [folder for folder in student_folders(root) if any((folder / stage).is_dir() for stage in stages())]
    if not students:
        return refuse(f"cannot grade {submissions}: no student folder in it has a stage folder "
                      f"({', '.join(stages())})")
    if not trust:
        from kdacourse.sandbox import sandbox_problem

        problem = sandbox_problem()
        if problem:
            return refuse(f"cannot grade untrusted code here: {problem}")
    from kdacourse.cheating import check_exercise

    timeout_per_exercise = exercise_limit(timeout_per_test)
    plan = {student: [exercise for exercise in exercises() if (student / exercise.stage).is_dir()]
            for student in students}
    total = sum(len(selected) for selected in plan.values())
    print(f"grading {len(students)} students in {root}: {total} exercise runs, {jobs} at a time "
          f"({'trusted: run as the grader' if trust else 'untrusted: in the sandbox'})", flush=True)

    progress = _Progress(total, len(students))
    results = {student: {} for student in students}
    started_at, started = datetime.now(timezone.utc), time.monotonic()
    student_started = {}
    lock = threading.Lock()

    def run(student, batch):
        """The results of `batch`, exercises of `student`: in the sandbox all of a student's exercises
        run in one test process (run_batch); as the grader, each in a process of its own."""
        with lock:
            student_started.setdefault(student, time.monotonic())
        cheating = {exercise.id: check_exercise(str(student), exercise) for exercise in batch}
        if not trust:
            return run_batch(str(student), batch, timeout_per_test, timeout_per_exercise, cheating)
        (exercise,) = batch
        return [run_exercise(str(student), exercise, timeout_per_test, timeout_per_exercise,
                             cheating=cheating[exercise.id])]

    batches = [(student, selected) for student, selected in plan.items() if selected] if not trust else [
        (student, [exercise]) for student, selected in plan.items() for exercise in selected]
    rows = {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run, student, batch): (student, batch) for student, batch in batches}
        for future in as_completed(futures):
            student, batch = futures[future]
            for exercise, result in zip(batch, future.result()):
                results[student][exercise.id] = result
            done_student = len(results[student]) == len(plan[student])
            if done_student:
                ordered = [results[student][e.id] for e in plan[student]]
                not_graded = [stage for stage in stages() if not (student / stage).is_dir()]
                report = grade_report(student, ordered, not_graded, started_at,
                                      time.monotonic() - student_started[student], timeout_per_test,
                                      timeout_per_exercise)
                report["sandbox"] = not trust
                write_reports(out_path / student.name, report, ordered)
                rows[student.name] = {e.id: results[student][e.id].points for e in plan[student]}
            progress.advance(student.name if done_student else None,
                             f"{report['score']}/{report['max_score']}" if done_student else "", len(batch))
    progress.finish()
    write_gradebook(out_path / "gradebook.csv", rows)
    print(f"graded {len(students)} students in {time.monotonic() - started:.0f} s; "
          f"{out_path / 'gradebook.csv'} and one report folder per student", flush=True)
    return 0


def write_gradebook(path, rows):
    """gradebook.csv: student, one column per catalog exercise (its points, 0 if not handed in), total, max."""
    catalog = exercises()
    maximum = sum(exercise.points for exercise in catalog)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["student", *[exercise.id for exercise in catalog], "total", "max"])
        for student in sorted(rows):
            points = [rows[student].get(exercise.id, 0) for exercise in catalog]
            writer.writerow([_csv_safe(student), *points, sum(points), maximum])


def _csv_safe(text):
    """A folder name as a spreadsheet cell: one that starts a formula (=, +, -, @) gets a quote first."""
    return "'" + text if text[:1] in ("=", "+", "-", "@", "\t", "\r") else text


class _Progress:
    """A progress bar on a terminal (one line, redrawn); elsewhere one line per student graded."""

    def __init__(self, runs, students):
        self.runs, self.students = runs, students
        self.done_runs = self.done_students = 0
        self.started = time.monotonic()
        self.tty = sys.stdout.isatty()

    def advance(self, student, score, runs=1):
        self.done_runs += runs
        elapsed = time.monotonic() - self.started
        if student is not None:
            self.done_students += 1
            line = (f"[{self.done_students}/{self.students}] {student}: {score} points "
                    f"({self.done_runs}/{self.runs} runs, {elapsed:.0f} s)")
            print(("\r\033[K" if self.tty else "") + line, flush=True)
        if self.tty:
            filled = BAR_WIDTH * self.done_runs // max(1, self.runs)
            left = elapsed / self.done_runs * (self.runs - self.done_runs)
            print(f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {self.done_runs}/{self.runs} runs, "
                  f"{self.done_students}/{self.students} students, {elapsed:.0f} s, about {left:.0f} s left",
                  end="", flush=True)

    def finish(self):
        if self.tty:
            print("\r\033[K", end="", flush=True)
