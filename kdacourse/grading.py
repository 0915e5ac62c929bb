"""Grading a folder of exercises (instructors) and checking one's own (students).

    course grade FOLDER --out DIR    every exercise of the folder, a report in DIR
    course check [STAGE|EXERCISE]    your exercises, PASS or FAIL, and what to read next

Both run each exercise's tests, tests/exercises/<stage>/test_<file>, with pytest (kdacourse.runner)
against the folder, with a time limit per test and one per exercise: a syntax error, an exception at
import, an endless loop or an exit of the process costs that exercise, never the run. Run as the
grader (`course check`, --trust), the student's code runs in the pytest process, so each exercise
has a process of its own; in the sandbox it runs only in sandboxed children (kdacourse.remote), so
several exercises share one pytest process, its start and its analysis child (run_batch). The
folder is only read (kdacourse.targets compiles its files in memory), never written.

An exercise is passed when every one of its tests passes; it then earns its points, else none.
"""

import json
import os
import re
import sys
import textwrap
import time
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from kdacourse import REPO_ROOT
from kdacourse.catalog import Exercise, exercises, resolve_stage, stages
from kdacourse.report_cells import report_cell
from kdacourse.runner import RunResult, run_tests
from kdacourse.sitelinks import read_location, read_url  # the page and section on the site
from kdacourse.targets import TargetError, target_folder

# Exercise runs at a time: one pytest process per core.
JOBS = max(1, os.cpu_count() or 1)
# The whole test run of one exercise may take this many times the limit of one test, and
# EXERCISE_START_SECONDS more to start: pytest, and in the sandbox the child that imports the file
# (TileLang for a kernel exercise: seconds, more on a loaded machine), before any test's limit runs.
EXERCISE_LIMIT_PER_TEST_LIMIT = 5
EXERCISE_START_SECONDS = 30
# In the sandbox, tests/exercises/conftest.py stops a call of the student's code at this share of
# pytest's limit per test; grading sets pytest's limit so that the call's is the number the user gave.
SANDBOX_CALL_SHARE = 0.9
# `course check` is the student's loop: an endless loop should cost half a minute, and a correct
# solution must never fail on time, however loaded the machine. So its limit per test is CPU time,
# which load does not stretch (a test takes well under 5 s of it); the wall-clock limits are only a
# backstop for code that hangs without computing (a sleep, a deadlock).
CHECK_CPU_LIMIT_PER_TEST = 30
CHECK_WALL_LIMIT_PER_TEST = 300
CHECK_WALL_LIMIT_PER_EXERCISE = 600
# Compile-only tests (marker `compile`: lower for sm_90a, run nvcc) take 10 s to a minute and need
# no student change to pass once the program is right: `course check` runs them with --compile only.
# tests/conftest.py gives each one 600 s, so the exercise may take that much longer.
COMPILE_TEST_LIMIT = 600
# A kernel exercise's tests (kernel_program, build_kernel, tune_kernel) cost about this many times
# another's (split_by_stage): the tile interpreter's runs and the TIR analyses.
KERNEL_PROGRAM_WEIGHT = 6
# How much of a failure message the reports quote.
MESSAGE_LINES = 3
MESSAGE_LINE_CHARS = 200


@dataclass
class ExerciseResult:
    """One exercise's test run, read as a grade."""

    exercise: Exercise
    run: RunResult
    seconds: float
    timeout_per_exercise: float
    cheating: tuple = ()  # kdacourse.cheating's findings: the exercise scores zero, its tests unrun

    @property
    def passed(self):
        """Every test ran and passed (skipped ones aside, but not all of them), and pytest agrees."""
        return (not self.cheating and self.run.all_passed() and self.run.returncode == 0
                and self.tests_passed > 0)

    @property
    def points(self):
        return self.exercise.points if self.passed else 0

    @property
    def tests_total(self):
        """The tests that ran (passed or failed); skipped ones are counted apart."""
        return sum(outcome != "skipped" for outcome in self.run.outcomes.values())

    @property
    def tests_passed(self):
        return sum(outcome == "passed" for outcome in self.run.outcomes.values())

    def skipped(self):
        """{test name: why it was skipped}."""
        return {_test_name(test_id): self.run.skip_reasons.get(test_id, "")
                for test_id, outcome in self.run.outcomes.items() if outcome == "skipped"}

    @property
    def timed_out(self):
        """A time limit stopped the exercise: a test's (and so the rest of its tests) or the whole run's."""
        return self.run.timed_out or bool(self.run.timeouts)

    def run_problem(self):
        """Why the run as a whole gave no verdict (time limit, process ended early), or None."""
        if self.cheating:
            return "scored zero, tests not run: " + "; ".join(str(finding) for finding in self.cheating)
        if self.run.timed_out:
            return (f"timed out: the whole test run was stopped after {self.timeout_per_exercise:g} s "
                    f"(the time limit per exercise; an endless loop?)")
        if self.run.timeouts:
            return (f"timed out: {_test_name(self.run.timeouts[0])} hit its time limit (an endless loop?), "
                    f"and the exercise's other tests failed at once without running")
        if not self.run.outcomes:
            last_lines = "\n".join(self.run.output.strip().splitlines()[-MESSAGE_LINES:])
            return (f"no test result: the test process ended with exit code {self.run.returncode} "
                    f"before reporting (did the code exit the process?)\n{last_lines}")
        if self.run.returncode != 0 and not self.run.failed():
            return f"the test process ended with exit code {self.run.returncode}"
        if self.tests_passed == 0 and not self.run.failed():
            return f"no test ran: all {self.tests_total} were skipped here"
        return None

    def deselected(self):
        """How many tests of the exercise the run left out (pytest's -m), from pytest's summary line."""
        found = re.findall(r"(\d+) deselected", self.run.output)
        return int(found[-1]) if found else 0

    def failure_messages(self):
        """The run's problem if any, then `test name: its failure message` per failed test."""
        problem = self.run_problem()
        messages = [problem] if problem else []
        for test_id in self.run.failed():
            message = self.run.summaries.get(test_id) or self.run.messages.get(test_id, "")
            messages.append(f"{_test_name(test_id)}: {message.strip()}")
        return messages

    def failures(self):
        """The failure messages, whole."""
        return [message.strip() for message in self.failure_messages()]

    def first_failure(self):
        """The first lines of the first failure message, each cut at a word ("" when passed)."""
        messages = self.failure_messages()
        if not messages:
            return ""
        lines = [_shorten(line) for line in messages[0].splitlines() if line.strip()]
        return "\n".join(lines[:MESSAGE_LINES])

    def as_json(self):
        return {
            "id": self.exercise.id,
            "stage": self.exercise.stage,
            "file": self.exercise.file,
            "kind": self.exercise.kind,
            "passed": self.passed,
            "points": self.points,
            "max_points": self.exercise.points,
            "tests_passed": self.tests_passed,
            "tests_total": self.tests_total,
            "tests_skipped": self.skipped(),
            "timed_out": self.timed_out,
            "seconds": round(self.seconds, 2),
            "failures": self.failures(),
            "cheating": [str(finding) for finding in self.cheating],
        }


def _one_line(text):
    """The first lines of a message joined into one short line ("AssertionError:" alone says little)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return _shorten(" ".join(lines[:MESSAGE_LINES]) or "(no message)")


def _shorten(line):
    """`line` cut at a word to at most MESSAGE_LINE_CHARS characters, "..." saying so."""
    return textwrap.shorten(line, MESSAGE_LINE_CHARS, placeholder=" ...") if len(line) > MESSAGE_LINE_CHARS else line


def exercise_limit(timeout_per_test):
    """The wall-clock limit on one exercise's whole test run, for a limit per test."""
    return EXERCISE_LIMIT_PER_TEST_LIMIT * timeout_per_test + EXERCISE_START_SECONDS


def pytest_timeout(timeout_per_test, sandboxed):
    """pytest's limit per test for a user's --timeout: in the sandbox, one that stops each call of the
    student's code at exactly `timeout_per_test` (tests/exercises/conftest.py stops it at
    SANDBOX_CALL_SHARE of pytest's); without it, the test function's."""
    return timeout_per_test / SANDBOX_CALL_SHARE if sandboxed else timeout_per_test


def _test_name(test_id):
    """'tests/exercises/s01/test_x.py::test_y[8-8]' -> 'test_y[8-8]'."""
    return test_id.split("::", 1)[-1]


def run_exercise(target, exercise, timeout_per_test, timeout_per_exercise, extra_args=(), cpu_timeout_per_test=0,
                 cheating=None):
    """Run one exercise's tests against `target`; with cheating findings, score zero without running them."""
    started = time.monotonic()
    if cheating:
        return ExerciseResult(exercise, RunResult(), 0.0, timeout_per_exercise, tuple(cheating))
    sandboxed = "--sandbox" in extra_args
    run = run_tests(target, [exercise.test_path.relative_to(REPO_ROOT)],
                    timeout_per_test=pytest_timeout(timeout_per_test, sandboxed), timeout_total=timeout_per_exercise,
                    extra_args=extra_args, cpu_timeout_per_test=cpu_timeout_per_test)
    return ExerciseResult(exercise, run, time.monotonic() - started, timeout_per_exercise)


def run_batch(target, batch, timeout_per_test, timeout_per_exercise, cheating=None):
    """Run the tests of several exercises against `target` in the sandbox, in one pytest process.

    The student's code runs only in sandboxed children (one per file, started as its tests begin), so
    nothing it does can end that process: the exercises share its start, the library's import and the
    analysis child of their kernel programs. Each keeps its limits: each test's, and
    timeout_per_exercise for its tests together (kdacourse.runner's limit per file). Exercises with
    cheating findings (exercise id -> findings) score zero unrun. Returns the results in batch order.
    """
    cheating = cheating or {}
    to_run = [exercise for exercise in batch if not cheating.get(exercise.id)]
    run = RunResult()
    if to_run:
        run = run_tests(target, [exercise.test_path.relative_to(REPO_ROOT) for exercise in to_run],
                        timeout_per_test=pytest_timeout(timeout_per_test, sandboxed=True),
                        # a file may pass its limit by the test that was running when it did
                        timeout_total=EXERCISE_START_SECONDS + len(to_run) * (timeout_per_exercise
                                                                              + 2 * timeout_per_test),
                        extra_args=("--sandbox",), timeout_per_file=timeout_per_exercise)
    results = []
    for exercise in batch:
        if cheating.get(exercise.id):
            results.append(ExerciseResult(exercise, RunResult(), 0.0, timeout_per_exercise,
                                          tuple(cheating[exercise.id])))
            continue
        part = run.of_file(exercise.test_path.relative_to(REPO_ROOT))
        results.append(ExerciseResult(exercise, part, sum(part.seconds.values()), timeout_per_exercise))
    return results


def split_by_stage(selected, parts):
    """`selected` (catalog order) in at most `parts` batches of whole stages, about equal in work: the
    tests of a kernel exercise (its solution imports TileLang: the interpreter's runs, the analyses)
    weigh as much as several others'."""
    from kdacourse.remote import imports_tilelang

    work = {}
    for exercise in selected:
        solution = (REPO_ROOT / "solutions" / exercise.stage / exercise.file).read_text(encoding="utf-8")
        weight = KERNEL_PROGRAM_WEIGHT if imports_tilelang(solution) else 1
        work[exercise.stage] = work.get(exercise.stage, 0) + weight
    batches = [[] for _ in range(min(parts, len(work)))]
    loads = [0] * len(batches)
    for stage in sorted(work, key=work.get, reverse=True):
        lightest = loads.index(min(loads))
        batches[lightest].append(stage)
        loads[lightest] += work[stage]
    return [[exercise for exercise in selected if exercise.stage in stages_of_batch] for stages_of_batch in batches]


def run_exercises(target, selected, timeout_per_test, timeout_per_exercise, on_result, extra_args=(),
                  cpu_timeout_per_test=0, cheating=None):
    """Run each exercise's tests against `target`, JOBS processes at a time: in the sandbox
    ("--sandbox" in extra_args) JOBS batches of whole stages (run_batch), else a process per exercise.

    Calls on_result(position, result) in catalog order as results come in; returns the results.
    """
    cheating = cheating or {}
    if "--sandbox" in extra_args:
        batches = split_by_stage(selected, JOBS)
        work = [lambda batch=batch: run_batch(target, batch, timeout_per_test, timeout_per_exercise, cheating)
                for batch in batches]
    else:
        batches = [[exercise] for exercise in selected]
        work = [lambda exercise=exercise: [run_exercise(target, exercise, timeout_per_test, timeout_per_exercise,
                                                        extra_args, cpu_timeout_per_test, cheating.get(exercise.id))]
                for exercise in selected]
    done = {}
    results = []
    with ThreadPoolExecutor(max_workers=JOBS) as pool:
        futures = {pool.submit(job): batch for job, batch in zip(work, batches)}
        for future in as_completed(futures):
            for exercise, result in zip(futures[future], future.result()):
                done[exercise.id] = result
            while len(results) < len(selected) and selected[len(results)].id in done:  # in catalog order
                results.append(done[selected[len(results)].id])
                on_result(len(results), results[-1])
    return results


def refuse(message):
    """Say why a command cannot run (on stderr, as `course: ...`); the exit code 2."""
    print(f"course: {message}", file=sys.stderr)
    return 2


def _unknown_stage(name):
    known = ", ".join(f"{stage.split('_')[0]} ({stage})" for stage in stages())
    return refuse(f"unknown stage {name!r}; the stages are: {known}; or name one exercise, as "
                  f"{exercises()[0].id!r} (an exercise's id heads its section on its stage's page)")


def _count_exercises(count):
    return "1 exercise" if count == 1 else f"{count} exercises"


# ---------------------------------------------------------------------------------------- grade


def grade(folder, out, timeout_per_test=60, trust=False):
    """Grade `folder` (laid out like exercises/) and write report.md, report.json, junit.xml to `out`.

    The folder's code is untrusted: it runs only in the sandbox (kdacourse.sandbox, kdacourse.remote),
    and grading refuses where there is none, unless trust=True (--trust: a student's own machine),
    which runs it as `course check` does. Either way an exercise whose file shows cheating
    (kdacourse.cheating) scores zero and its tests are not run.

    Grades every exercise of the stages whose folders `folder` has: a student who hands in stage 1
    only is graded on stage 1 (the report names the stages left out); a file missing from a stage
    folder costs its exercise. Each exercise's whole test run may take exercise_limit(timeout_per_test).
    Returns the exit code: 0 once graded, whatever the score; 2 when there is nothing to grade.
    """
    folder_path = Path(folder).expanduser().resolve()
    if not folder_path.is_dir():
        return refuse(f"cannot grade {folder}: no such folder")
    graded_stages = [stage for stage in stages() if (folder_path / stage).is_dir()]
    if not graded_stages:
        return refuse(f"cannot grade {folder}: it has no stage folder; expected one of: {', '.join(stages())}")
    out_path = Path(out).expanduser().resolve()
    if out_path == folder_path or folder_path in out_path.parents:
        return refuse(f"the reports would go inside the graded folder {folder}; choose --out elsewhere")
    timeout_per_exercise = exercise_limit(timeout_per_test)
    if not trust:
        from kdacourse.sandbox import sandbox_problem

        problem = sandbox_problem()
        if problem:
            return refuse(f"cannot grade untrusted code here: {problem}")

    selected = [exercise for exercise in exercises() if exercise.stage in graded_stages]
    from kdacourse.cheating import check_exercise

    cheating = {exercise.id: check_exercise(str(folder_path), exercise) for exercise in selected}
    not_graded = [stage for stage in stages() if stage not in graded_stages]
    print(f"grading {folder_path}: {len(selected)} exercises of {', '.join(graded_stages)} "
          f"({timeout_per_test:g} s per test{' call' if not trust else ''}, {timeout_per_exercise:g} s per exercise; "
          f"{'trusted: run as the grader' if trust else 'untrusted: in the sandbox'})", flush=True)
    if not_graded:
        print(f"not in the folder, not graded: {', '.join(not_graded)}", flush=True)

    def show_progress(position, result):
        verdict = "passed" if result.passed else "FAILED"
        line = (f"[{position}/{len(selected)}] {result.exercise.id} ... {verdict} "
                f"({result.points}/{result.exercise.points} points, {result.seconds:.1f} s)")
        if not result.passed:
            line += f": {_one_line(result.failures()[0])}"
        print(line, flush=True)

    started_at = datetime.now(timezone.utc)
    started = time.monotonic()
    results = run_exercises(str(folder_path), selected, timeout_per_test, timeout_per_exercise, show_progress,
                            extra_args=() if trust else ("--sandbox",), cheating=cheating)
    report = grade_report(folder_path, results, not_graded, started_at, time.monotonic() - started,
                          timeout_per_test, timeout_per_exercise)
    report["sandbox"] = not trust
    if not trust:
        from kdacourse.sandbox import chosen_isolation, describe

        report["isolation"] = chosen_isolation()
        report["isolation_described"] = describe(report["isolation"])

    write_reports(out_path, report, results)
    print(f"score: {report['score']}/{report['max_score']} points; "
          f"{out_path / 'report.md'}, report.json, junit.xml", flush=True)
    return 0


def write_reports(out_path, report, results):
    """report.json, report.md and junit.xml in out_path."""
    out_path.mkdir(parents=True, exist_ok=True)
    (out_path / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    (out_path / "report.md").write_text(markdown_report(report), encoding="utf-8")
    junit_tree(results).write(out_path / "junit.xml", encoding="utf-8", xml_declaration=True)


def grade_report(folder_path, results, not_graded, started_at, seconds, timeout_per_test, timeout_per_exercise):
    """The content of report.json: totals, per-stage totals and one entry per exercise."""
    per_stage = {}
    for result in results:
        totals = per_stage.setdefault(result.exercise.stage, {
            "score": 0, "max_score": 0, "exercises_passed": 0, "exercises_total": 0})
        totals["score"] += result.points
        totals["max_score"] += result.exercise.points
        totals["exercises_passed"] += result.passed
        totals["exercises_total"] += 1
    return {
        "folder": str(folder_path),
        "graded_at": started_at.isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "timeout_per_test": timeout_per_test,
        "timeout_per_exercise": timeout_per_exercise,
        "score": sum(result.points for result in results),
        "max_score": sum(result.exercise.points for result in results),
        "stages": per_stage,
        "stages_not_graded": not_graded,
        "exercises": [{**result.as_json(), "first_failure": result.first_failure()} for result in results],
    }


def markdown_report(report):
    """report.md: the totals, then per stage a table of its exercises."""
    passed = sum(entry["passed"] for entry in report["exercises"])
    lines = [
        f"# Grade of `{report['folder']}`",
        "",
        f"**Score: {report['score']} / {report['max_score']} points**, "
        f"{passed} of {len(report['exercises'])} exercises passed. "
        f"Graded {report['graded_at']} in {report['seconds']:g} s; time limits "
        f"{report['timeout_per_test']:g} s per test (in the sandbox: per call of the graded code), "
        f"{report['timeout_per_exercise']:g} s per exercise.",
        "",
        "An exercise earns its points when all of its tests pass, else none; an exercise whose file "
        "shows cheating (an import of the answers, a symlink, a forbidden call) scores zero. "
        "Tests passed counts the tests that ran; skipped ones are listed under each table. An exercise "
        "that timed out had a test stopped by its time limit, and its other tests failed at once.",
        "",
        (f"The code ran in the sandbox (untrusted grading), isolated by {report.get('isolation_described', 'bubblewrap')}."
         if report.get("sandbox", True) else "The code ran as the grader (--trust)."),
        "",
    ]
    if report["stages_not_graded"]:
        lines += [f"Stages not in the folder, not graded: {', '.join(report['stages_not_graded'])}.", ""]
    for stage, totals in report["stages"].items():
        lines += [f"## {stage}: {totals['score']} / {totals['max_score']} points", "",
                  "| exercise | kind | passed | points | tests passed | first failure |",
                  "|---|---|---|---|---|---|"]
        for entry in report["exercises"]:
            if entry["stage"] == stage:
                lines.append(f"| `{entry['id']}` | {entry['kind']} | {'yes' if entry['passed'] else '**no**'} "
                             f"| {entry['points']}/{entry['max_points']} "
                             f"| {_tests_cell(entry)} "
                             f"| {report_cell(entry['first_failure'])} |")
        lines.append("")
        lines += _skipped_lines([entry for entry in report["exercises"] if entry["stage"] == stage])
    lines += ["## Totals", "", "| stage | points | exercises passed |", "|---|---|---|"]
    for stage, totals in report["stages"].items():
        lines.append(f"| {stage} | {totals['score']}/{totals['max_score']} "
                     f"| {totals['exercises_passed']}/{totals['exercises_total']} |")
    lines.append(f"| **all** | **{report['score']}/{report['max_score']}** | {passed}/{len(report['exercises'])} |")
    return "\n".join(lines) + "\n"


def _tests_cell(entry):
    """Passed of those that ran, the skipped ones apart (their reasons are listed under the table)."""
    skipped = len(entry.get("tests_skipped", {}))
    if entry["tests_total"] == 0 and not skipped:  # the run ended or was stopped before pytest reported
        return "no result"
    cell = f"{entry['tests_passed']}/{entry['tests_total']}"
    cell += f" ({skipped} skipped)" if skipped else ""
    return cell + (", **timed out**" if entry["timed_out"] else "")


def _skipped_lines(entries):
    """Under a stage's table: per exercise, the tests that did not run and why."""
    lines = []
    for entry in entries:
        reasons = {}
        for name, reason in entry.get("tests_skipped", {}).items():
            reasons.setdefault(reason or "no reason given", []).append(name)
        for reason, names in reasons.items():
            lines.append(f"- `{entry['id']}`: {len(names)} skipped ({', '.join(f'`{n}`' for n in names)}): "
                         f"{report_cell(reason)}")
    return ["Tests skipped, not counted:", "", *lines, ""] if lines else []


def junit_tree(results):
    """junit.xml: one <testsuite> per exercise holding pytest's own <testcase> elements.

    A run that gave no verdict as a whole (time limit per exercise, process ended early) adds one
    failed testcase that says so, so that CI shows the exercise as failed.
    """
    suites = ElementTree.Element("testsuites", name="course grade")
    for result in results:
        cases = list(ElementTree.fromstring(result.run.junit_xml).iter("testcase")) if result.run.junit_xml else []
        problem = result.run_problem()
        if problem:
            case = ElementTree.Element("testcase", classname=result.exercise.id, name="test run",
                                       time=f"{result.seconds:.3f}")
            failure = ElementTree.SubElement(case, "failure", message=_xml_text(_one_line(problem)))
            failure.text = _xml_text(problem + ("\n\n" + result.run.output[-4000:] if result.run.output else ""))
            cases.append(case)
        counts = {kind: sum(case.find(kind) is not None for case in cases) for kind in ("failure", "error", "skipped")}
        suite = ElementTree.SubElement(suites, "testsuite", name=result.exercise.id, tests=str(len(cases)),
                                       failures=str(counts["failure"]), errors=str(counts["error"]),
                                       skipped=str(counts["skipped"]), time=f"{result.seconds:.3f}")
        properties = ElementTree.SubElement(suite, "properties")
        for name, value in (("stage", result.exercise.stage), ("kind", result.exercise.kind),
                            ("points", result.points), ("max_points", result.exercise.points)):
            ElementTree.SubElement(properties, "property", name=name, value=str(value))
        suite.extend(cases)
    for total in ("tests", "failures", "errors", "skipped"):
        suites.set(total, str(sum(int(suite.get(total)) for suite in suites)))
    return ElementTree.ElementTree(suites)


def _xml_text(text):
    """`text` without the characters XML 1.0 cannot hold (a student's output may print any)."""
    return re.sub("[^\t\n\r\x20-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]", "?", text)


# ---------------------------------------------------------------------------------------- check


def check(stage=None, target="exercises", compile=False):
    """Run the student's exercises of one stage (or all, or the one exercise whose id `stage` is, as
    "s02.build_kernel") and say what to read next.

    For each failing exercise: the first failure's message in full (the tests' messages are a few
    lines: shapes, the error, where it first appears), the page section to read, and a pytest
    command that re-runs its tests with short tracebacks. compile=True also runs the compile-only
    tests (lowering for sm_90a with nvcc), which are slow and left out otherwise.

    Returns the exit code: 0 when every exercise passes, 1 otherwise, 2 for an unknown stage or
    target.
    """
    by_id = {exercise.id: exercise for exercise in exercises()}
    if stage in by_id:
        selected = [by_id[stage]]
    else:
        try:
            checked_stages = [resolve_stage(stage)] if stage else stages()
        except ValueError:
            return _unknown_stage(stage)
        selected = [exercise for exercise in exercises() if exercise.stage in checked_stages]
    try:
        folder_path = target_folder(target)
    except TargetError as error:
        return refuse(str(error))
    # "exercises", "solutions" and "bug:<id>" mean what they mean to the tests; a folder goes absolute.
    run_target = target if target in ("exercises", "solutions") or target.startswith("bug:") else str(folder_path)
    print(f"checking {_count_exercises(len(selected))} in {folder_path}", flush=True)

    def show_result(position, result):
        show_check_result(result, run_target)

    extra_args = () if compile else ("-m", "not compile")
    limit_per_exercise = CHECK_WALL_LIMIT_PER_EXERCISE + (COMPILE_TEST_LIMIT if compile else 0)
    results = run_exercises(run_target, selected, CHECK_WALL_LIMIT_PER_TEST, limit_per_exercise, show_result,
                            extra_args=extra_args, cpu_timeout_per_test=CHECK_CPU_LIMIT_PER_TEST)
    passed = [result for result in results if result.passed]
    points = sum(result.points for result in results)
    print(f"{len(passed)} of {len(results)} exercises pass "
          f"({points}/{sum(result.exercise.points for result in results)} points)", flush=True)
    left_out = sum(result.deselected() for result in results)
    if left_out:
        print(f"{left_out} compile-only test{'s' if left_out > 1 else ''} left out (they lower the kernels "
              f"for sm_90a with nvcc, a minute or more): add --compile to run them", flush=True)
    return 0 if len(passed) == len(results) else 1


def show_check_result(result, run_target):
    """PASS, or FAIL with the first failure's message in full, the first line of each other failure's,
    the section to read and how to re-run."""
    if result.passed:
        print(f"PASS  {result.exercise.id}", flush=True)
        return
    failed = len(result.run.failed())
    tally = f" ({failed} of {result.tests_total} tests fail)" if failed else ""
    messages = result.failure_messages() or ["(no message)"]
    first, *rest = messages[0].strip().splitlines() or ["(no message)"]
    print(f"FAIL  {result.exercise.id}{tally}: {first}", flush=True)
    for line in rest:
        print(f"      {line}", flush=True)
    if len(messages) > 1:
        print(f"      {'also fails' if len(messages) == 2 else f'{len(messages) - 1} more fail'}:", flush=True)
        for message in messages[1:]:  # the first line of each: its headline, whole
            print(f"        {(message.strip().splitlines() or ['(no message)'])[0]}", flush=True)
    print(f"      read: {read_location(result.exercise.read)}", flush=True)
    print(f"            {read_url(result.exercise.read)} (with `course serve` running)", flush=True)
    rerun = f"pytest {result.exercise.test_path.relative_to(REPO_ROOT)} -q --tb=short"
    if result.deselected():
        rerun += " -m 'not compile'"
    if run_target != "exercises":
        rerun += f" --target={run_target}"
    print(f"      re-run its tests: {rerun}", flush=True)
