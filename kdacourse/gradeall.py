"""Grading a whole class at once: `course grade-all SUBMISSIONS --out DIR`.

SUBMISSIONS holds one folder per student (named as the gradebook should name the student), each laid
out like exercises/. The runs go to one pool, JOBS at a time, so the machine stays busy across
students: in the sandbox a run is one student's whole submission in one test process
(kdacourse.grading.run_batch: one start, one analysis child), as the grader (--trust) one exercise
of one student; either grades as `course grade` does (cheating scored zero). DIR receives:

- gradebook.csv: one row per student, one column per exercise graded (its points), then the total,
  the maximum (the points of what was graded: the stages --stages names, else every stage that some
  student handed in, the same for every row) and `cheating` (the exercises that scored zero for
  cheating, with the first finding of each); a plain CSV with a header row, which LMS gradebook
  imports accept (map `student` to the LMS's user identifier; an exercise of a stage the student did
  not hand in counts 0);
- <student>/report.md, report.json, junit.xml: each student's reports, as `course grade` writes them;
- with --leaderboard, a column per tune exercise in gradebook.csv with the counted cost of each
  program that passed it (kdacourse.leaderboard), and leaderboard.csv: per tune exercise, the passed
  programs ranked by global bytes, then FLOPs, then shared memory (the counts the exercise is graded on).
"""

import csv
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from datetime import datetime, timezone
from pathlib import Path

from kdacourse.catalog import exercises, resolve_stage, stages
from kdacourse.grading import JOBS, exercise_limit, grade_report, refuse, run_batch, run_exercise, write_reports
from kdacourse.leaderboard import counted_cost_of, leaderboard_cell

BAR_WIDTH = 30


def student_folders(root):
    """The student folders of `root`: sub-folders, not hidden, not links, in name order."""
    return [path for path in sorted(root.iterdir()) if path.is_dir() and not path.is_symlink()
            and not path.name.startswith(".")]


def grade_all(submissions, out, timeout_per_test=60, trust=False, jobs=JOBS, leaderboard=False, only_stages=None):
    """Grade every student folder of `submissions` (on the stages `only_stages` names, s01, 1 or
    s01_linear_attention; default every stage); write gradebook.csv and per-student reports to `out`.

    Returns the exit code: 0 once graded, 2 when there is nothing to grade, an unknown stage or no sandbox."""
    root = Path(submissions).expanduser().resolve()
    if not root.is_dir():
        return refuse(f"cannot grade {submissions}: no such folder")
    out_path = Path(out).expanduser().resolve()
    if out_path == root or root in out_path.parents:
        return refuse(f"the reports would go inside the submissions folder {submissions}; choose --out elsewhere")
    try:
        chosen = {resolve_stage(name) for name in only_stages} if only_stages else set(stages())
    except ValueError as error:
        return refuse(str(error))
    assignment = [stage for stage in stages() if stage in chosen]
    students = [folder for folder in student_folders(root) if any((folder / stage).is_dir() for stage in assignment)]
    if not students:
        return refuse(f"cannot grade {submissions}: no student folder in it has a stage folder "
                      f"({', '.join(assignment)})")
    if not trust:
        from kdacourse.sandbox import sandbox_problem

        problem = sandbox_problem()
        if problem:
            return refuse(f"cannot grade untrusted code here: {problem}")
    from kdacourse.cheating import check_exercise
    from kdacourse.sandbox import chosen_isolation, describe

    timeout_per_exercise = exercise_limit(timeout_per_test)
    plan = {student: [exercise for exercise in exercises() if exercise.stage in chosen and (student / exercise.stage).is_dir()]
            for student in students}
    # what the gradebook's max counts: the stages graded, those of the assignment that some student handed in
    graded_stages = [stage for stage in assignment if any((student / stage).is_dir() for student in students)]
    graded = [exercise for exercise in exercises() if exercise.stage in graded_stages]
    total = sum(len(selected) for selected in plan.values())
    print(f"grading {len(students)} students in {root} on {', '.join(graded_stages)}: {total} exercise runs, {jobs} at a time "
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
    rows, costs = {}, {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(run, student, batch): (student, batch) for student, batch in batches}
        for future in as_completed(futures):
            student, batch = futures[future]
            for exercise, result in zip(batch, future.result()):
                results[student][exercise.id] = result
            done_student = len(results[student]) == len(plan[student])
            if done_student:
                ordered = [results[student][e.id] for e in plan[student]]
                not_graded = [stage for stage in graded_stages if not (student / stage).is_dir()]
                report = grade_report(student, ordered, not_graded, started_at,
                                      time.monotonic() - student_started[student], timeout_per_test,
                                      timeout_per_exercise)
                report["sandbox"] = not trust
                if not trust:
                    report["isolation"] = chosen_isolation()
                    report["isolation_described"] = describe(report["isolation"])
                write_reports(out_path / student.name, report, ordered)
                rows[student.name] = {e.id: results[student][e.id] for e in plan[student]}
                if leaderboard:
                    costs[student.name] = {e.id: counted_cost_of(results[student][e.id], student, trust)
                                           for e in plan[student] if e.kind == "tune"}
            progress.advance(student.name if done_student else None,
                             f"{report['score']}/{report['max_score']}" if done_student else "", len(batch))
    progress.finish()
    write_gradebook(out_path / "gradebook.csv", graded, rows, costs if leaderboard else None)
    if leaderboard:
        write_leaderboard(out_path / "leaderboard.csv", costs)
    print(f"graded {len(students)} students in {time.monotonic() - started:.0f} s; "
          f"{out_path / 'gradebook.csv'} and one report folder per student", flush=True)
    return 0


def write_gradebook(path, graded, rows, costs=None):
    """gradebook.csv: student, one column per exercise of `graded` (its points, 0 if not handed in), total,
    max (the points of `graded`), cheating (the exercises scored zero for it: `id: first finding`, `; `
    between them); with costs ({student: {tune exercise id: CountedCost or None}}), a column per tune
    exercise after them. rows: {student: {exercise id: ExerciseResult}}."""
    maximum = sum(exercise.points for exercise in graded)
    tuned = [exercise.id for exercise in graded if exercise.kind == "tune"] if costs is not None else []
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["student", *[exercise.id for exercise in graded], "total", "max", "cheating",
                         *[f"{exercise_id} counted cost" for exercise_id in tuned]])
        for student in sorted(rows):
            results = rows[student]
            points = [results[exercise.id].points if exercise.id in results else 0 for exercise in graded]
            cheating = "; ".join(f"{exercise.id}: {_finding_text(results[exercise.id].cheating[0])}" for exercise in graded
                                 if exercise.id in results and results[exercise.id].cheating)
            cells = [leaderboard_cell(costs.get(student, {}).get(exercise_id)) for exercise_id in tuned]
            writer.writerow([_csv_safe(student), *points, sum(points), maximum, _csv_safe(cheating), *cells])


def _finding_text(finding):
    """A cheating finding without the grader's path to the student's folder: `file:line: reason`."""
    return f"{Path(finding.path).name}:{finding.line}: {finding.reason}"


def write_leaderboard(path, costs):
    """leaderboard.csv: per tune exercise, the students whose program passed, ranked by its counts (global
    bytes, then GEMM and element-wise FLOPs, then shared memory: fewer is better; ties share a rank)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["exercise", "rank", "student", "global_bytes", "gemm_flops", "elementwise_flops",
                         "shared_bytes"])
        for exercise in (e for e in exercises() if e.kind == "tune"):
            passed = sorted((cost.global_bytes, cost.gemm_flops + cost.elementwise_flops, cost.shared_bytes,
                             student, cost) for student, by_exercise in costs.items()
                            if (cost := by_exercise.get(exercise.id)) is not None)
            rank, previous = 0, None
            for position, (*key, student, cost) in enumerate(passed, 1):
                if key != previous:
                    rank, previous = position, key
                writer.writerow([exercise.id, rank, _csv_safe(student), cost.global_bytes, cost.gemm_flops,
                                 cost.elementwise_flops, cost.shared_bytes])


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
