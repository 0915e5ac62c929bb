"""`course grade` and `course check`, run as an instructor and a student run them.

Every grading and check runs once, as a `course` process, in the module fixture `runs`: solutions
(full marks), the shipped exercises (zero on every exercise), and folders of broken files (a syntax
error, an exception at import, endless loops, exits of the process, a missing file), each broken
file in an exercise of its own beside intact ones. The tests then read the reports, the output and
the folders, which must be byte for byte as they were.
"""

import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from kdacourse import REPO_ROOT
from kdacourse.catalog import exercises, exercises_of_stage, stages
from kdacourse.grading import (ExerciseResult, check, exercise_limit, grade, junit_tree, read_location,
                               show_check_result)
from kdacourse.runner import RunResult
from kdacourse.shipped import shipped_source, split_region
from kdacourse.sitelinks import read_url

EXERCISES = exercises()
# The broken folders use stage 1's exercises: small and fast, three of its five in NumPy (stage 0's ten
# puzzles each import TileLang).
BROKEN_STAGE = "s01_linear_attention"
# Small limits keep the hangs short: 2 s per test, so 40 s per exercise (grading.exercise_limit).
BROKEN_TIMEOUT_PER_TEST = 2


def _replace_region(source, body):
    """`source` with its exercise region replaced by `body`, indented as the region is."""
    before, region, after = split_region(source)
    indent = region[: len(region) - len(region.lstrip())]
    return before + "".join(indent + line + "\n" for line in body.splitlines()) + after


# Ways a student's file breaks: name -> the broken text made from the solution (None: no file).
BREAKAGES = {
    "syntax error": lambda solution: "def broken(:\n" + solution,
    "endless loop in the function": lambda solution: _replace_region(solution, "while True:\n    pass"),
    "intact": lambda solution: solution,
    "exception at import": lambda solution: 'raise RuntimeError("broken at import")\n' + solution,
    # pytest-timeout stops a test with SIGALRM; ignoring it leaves the limit per exercise to stop it: in
    # the sandbox, the import in the child is given that limit and no more
    "endless loop at import, deaf to the per-test limit": lambda solution: (
        "import signal, time\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\n"
        "while True:\n    time.sleep(0.1)\n" + solution),
    "sys.exit at import": lambda solution: "import sys\nsys.exit(3)\n" + solution,
    "os._exit in the function": lambda solution: _replace_region(solution, "import os\nos._exit(0)"),
    "missing file": None,
}


def broken_folders():
    """[(folder name, {exercise: breakage})]: the breakages dealt over the first stage's exercises,
    one per exercise, as many folders as that takes; exercises left over stay intact. The build
    exercise is dealt first, so that it is never left intact: its cost test builds two programs, past
    BROKEN_TIMEOUT_PER_TEST on a loaded machine (2.2 s in CI)."""
    stage_exercises = sorted(exercises_of_stage(BROKEN_STAGE), key=lambda exercise: exercise.file != "build_kernel.py")
    names = list(BREAKAGES)
    folders = []
    for start in range(0, len(names), len(stage_exercises)):
        dealt = names[start : start + len(stage_exercises)]
        dealt += ["intact"] * (len(stage_exercises) - len(dealt))
        folders.append((f"broken{len(folders)}", dict(zip(stage_exercises, dealt))))
    return folders


BROKEN_FOLDERS = broken_folders()


@dataclass
class Run:
    """One `course` command: its exit code, its output, and for grade the folder and its reports."""

    returncode: int
    stdout: str
    stderr: str
    out: Path | None = None
    folder: Path | None = None

    def report(self):
        return json.loads((self.out / "report.json").read_text())

    def entries(self):
        return {entry["id"]: entry for entry in self.report()["exercises"]}


def course(*arguments, out=None, cwd):
    command = [sys.executable, "-m", "kdacourse.cli", *map(str, arguments)]
    if out is not None:
        command += ["--out", str(out)]
    completed = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=cwd,
                               env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"), stdin=subprocess.DEVNULL)
    return Run(completed.returncode, completed.stdout, completed.stderr, out)


def snapshot(folder):
    """{relative path: sha256 of the file, or "folder"}: the whole tree, to compare before and after."""
    tree = {}
    for path in sorted(folder.rglob("*")):
        relative = str(path.relative_to(folder))
        tree[relative] = "folder" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return tree


def set_read_only(folder, read_only):
    for path in [folder, *folder.rglob("*")]:
        mode = path.stat().st_mode
        write = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
        path.chmod(mode & ~write if read_only else mode | stat.S_IWUSR)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: Run} for every grading and check, run two at a time; plus the folders' snapshots."""
    root = tmp_path_factory.mktemp("grading")
    folders = {}

    solutions = root / "solutions"
    shutil.copytree(REPO_ROOT / "solutions", solutions)
    folders["solutions"] = solutions

    shipped = root / "shipped"
    for exercise in EXERCISES:
        path = shipped / exercise.stage / exercise.file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(shipped_source(exercise))
    folders["shipped"] = shipped

    for name, breakages in BROKEN_FOLDERS:
        for exercise, breakage in breakages.items():
            make = BREAKAGES[breakage]
            if make is not None:
                path = root / name / exercise.stage / exercise.file
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(make((REPO_ROOT / "solutions" / exercise.stage / exercise.file).read_text()))
        folders[name] = root / name

    before = {name: snapshot(folder) for name, folder in folders.items()}
    for folder in folders.values():
        set_read_only(folder, True)

    short_stage = BROKEN_STAGE.split("_")[0]
    commands = {  # the broken ones first: their hangs overlap with the others' work
        **{name: ("grade", root / name, "--timeout", BROKEN_TIMEOUT_PER_TEST) for name, _ in BROKEN_FOLDERS},
        "grade solutions": ("grade", solutions),
        "grade shipped": ("grade", shipped),
        "check solutions": ("check", short_stage, "--target", solutions),
        "check shipped": ("check", short_stage, "--target", shipped),
    }
    reports = root / "reports"

    def run(name):
        if commands[name][0] != "grade":
            return course(*commands[name], cwd=root)
        result = course(*commands[name], out=reports / name.replace(" ", "-"), cwd=root)
        result.folder = commands[name][1]
        return result

    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            results = dict(zip(commands, pool.map(run, commands)))
    finally:
        for folder in folders.values():
            set_read_only(folder, False)
    results["snapshots"] = {name: (before[name], snapshot(folder)) for name, folder in folders.items()}
    return results


def test_solutions_score_full_marks(runs):
    run = runs["grade solutions"]
    assert run.returncode == 0, run.stderr
    report = run.report()
    assert report["score"] == report["max_score"] == sum(e.points for e in EXERCISES)
    assert {entry["id"] for entry in report["exercises"] if entry["passed"]} == {e.id for e in EXERCISES}
    assert all(entry["tests_passed"] > 0 and not entry["failures"] for entry in report["exercises"])
    assert f"[{len(EXERCISES)}/{len(EXERCISES)}]" in run.stdout


def test_shipped_exercises_score_zero(runs):
    run = runs["grade shipped"]
    assert run.returncode == 0, run.stderr
    entries = run.entries()
    assert set(entries) == {e.id for e in EXERCISES}
    for exercise in EXERCISES:
        entry = entries[exercise.id]
        assert (entry["passed"], entry["points"], entry["kind"]) == (False, 0, exercise.kind), exercise.id
        assert entry["failures"], f"{exercise.id} failed with no message"
    fill = [entries[e.id]["failures"] for e in EXERCISES if e.kind == "fill"]
    assert all(any("NotImplementedError" in message for message in messages) for messages in fill)
    assert run.report()["score"] == 0


@pytest.mark.parametrize("name", [name for name, _ in BROKEN_FOLDERS])
def test_broken_files_cost_their_exercise_only(runs, name):
    run = runs[name]
    assert run.returncode == 0, run.stderr
    entries = run.entries()
    for exercise, breakage in dict(BROKEN_FOLDERS)[name].items():
        entry = entries[exercise.id]
        if breakage == "intact":
            assert entry["passed"] and entry["points"] == exercise.points, f"intact {exercise.id}: {entry['failures']}"
        else:
            assert not entry["passed"] and entry["points"] == 0, f"{breakage} in {exercise.id} passes"
            assert entry["failures"] and entry["first_failure"], f"{breakage}: no message"


def _entries_by_breakage():
    """{breakage: (folder name, exercise)} for every breakage but intact."""
    return {breakage: (name, exercise) for name, breakages in BROKEN_FOLDERS
            for exercise, breakage in breakages.items() if breakage != "intact"}


@pytest.mark.parametrize("breakage, any_of", [
    ("syntax error", ["SyntaxError"]),
    ("exception at import", ["RuntimeError: broken at import"]),
    ("sys.exit at import", ["SystemExit: 3"]),
    ("missing file", ["is missing"]),
    # each test stopped by pytest-timeout, or the run by the limit per exercise if the tests add up to it
    ("endless loop in the function", ["Timeout", "timed out"]),
    ("endless loop at import, deaf to the per-test limit",
     [f"does not import: SandboxCallFailed: timed out: the call did not return within "
      f"{exercise_limit(BROKEN_TIMEOUT_PER_TEST):g} s"]),
    # graded in the sandbox, the exit ends the child, not the test process: that call fails
    ("os._exit in the function", ["no test result", "sandboxed process ended with exit code 0"]),
])
def test_failure_messages_say_what_broke(runs, breakage, any_of):
    name, exercise = _entries_by_breakage()[breakage]
    entry = runs[name].entries()[exercise.id]
    assert any(words in message for words in any_of for message in [entry["first_failure"], *entry["failures"]]), entry
    if "endless loop" in breakage:
        assert entry["timed_out"]


@pytest.mark.parametrize("name", ["grade solutions", "grade shipped", *[name for name, _ in BROKEN_FOLDERS]])
def test_reports_are_well_formed_and_agree(runs, name):
    run = runs[name]
    report = run.report()
    entries = report["exercises"]

    # report.json: the totals are the sums of the parts, and an exercise is all or nothing
    assert report["score"] == sum(entry["points"] for entry in entries)
    assert report["max_score"] == sum(entry["max_points"] for entry in entries)
    for stage, totals in report["stages"].items():
        in_stage = [entry for entry in entries if entry["stage"] == stage]
        assert totals["score"] == sum(entry["points"] for entry in in_stage)
        assert totals["max_score"] == sum(entry["max_points"] for entry in in_stage)
        assert totals["exercises_passed"] == sum(entry["passed"] for entry in in_stage)
    assert sum(totals["score"] for totals in report["stages"].values()) == report["score"]
    for entry in entries:
        assert entry["points"] == (entry["max_points"] if entry["passed"] else 0)
        assert entry["passed"] == (not entry["failures"])
        assert entry["tests_passed"] <= entry["tests_total"]
        if entry["passed"]:
            assert entry["tests_passed"] > 0
    assert report["folder"] == str(run.folder.resolve())
    assert report["graded_at"]

    # report.md: one row per exercise with its points, and the total
    markdown = (run.out / "report.md").read_text()
    assert f"**Score: {report['score']} / {report['max_score']} points**" in markdown
    for entry in entries:
        row = next(line for line in markdown.splitlines() if line.startswith(f"| `{entry['id']}` |"))
        assert f"| {entry['points']}/{entry['max_points']} |" in row
        assert ("| **no** |" in row) != entry["passed"]

    # junit.xml: one testsuite per exercise, one testcase per test, the failures where they belong
    suites = ElementTree.parse(run.out / "junit.xml").getroot()
    assert suites.tag == "testsuites"
    assert [suite.get("name") for suite in suites] == [entry["id"] for entry in entries]
    for suite, entry in zip(suites, entries):
        cases = suite.findall("testcase")
        problems = [problem for case in cases for problem in [case.find("failure"), case.find("error")]
                    if problem is not None]
        assert int(suite.get("tests")) == len(cases) >= max(entry["tests_total"], 1)
        assert int(suite.get("failures")) + int(suite.get("errors")) == len(problems)
        assert bool(problems) == (not entry["passed"]), entry["id"]
        assert all(problem.get("message") for problem in problems)
    assert int(suites.get("tests")) == sum(int(suite.get("tests")) for suite in suites)


@pytest.mark.parametrize("name", ["solutions", "shipped", *[name for name, _ in BROKEN_FOLDERS]])
def test_graded_folders_are_untouched(runs, name):
    before, after = runs["snapshots"][name]
    assert after == before, f"{name}: grading changed {sorted(set(after.items()) ^ set(before.items()))}"


def test_check_passes_on_solutions(runs):
    run = runs["check solutions"]
    assert run.returncode == 0, run.stdout + run.stderr
    for exercise in exercises_of_stage(BROKEN_STAGE):
        assert f"PASS  {exercise.id}" in run.stdout
    assert "FAIL" not in run.stdout


def test_check_on_shipped_exercises_says_what_to_read(runs):
    run = runs["check shipped"]
    assert run.returncode == 1, run.stdout + run.stderr
    for exercise in exercises_of_stage(BROKEN_STAGE):
        assert re.search(rf"^FAIL  {re.escape(exercise.id)} \(\d+ of \d+ tests fail\): ", run.stdout, re.M), run.stdout
        assert f"read: {read_location(exercise.read)}" in run.stdout
        assert read_url(exercise.read) in run.stdout  # the section on the served site
        # short tracebacks: the tests' own messages, no screens of source and arrays
        assert f"pytest tests/exercises/{exercise.stage}/test_{exercise.file} -q --tb=short" in run.stdout
    # each first failure in full: no line cut off, and a numeric one says where the error first appears
    assert "more line" not in run.stdout and not re.search(r"\.\.\.$", run.stdout, re.M), run.stdout
    assert "first wrong entry at batch" in run.stdout, run.stdout


def test_check_prints_a_message_of_several_lines_in_full(capsys):
    """A message of several lines (assert_close's) comes out whole, indented under its FAIL line."""
    message = "AssertionError: the output, shape (batch=1)\nlargest error 1.00e+00 at batch 0\nfirst wrong entry at batch 0"
    exercise = exercises_of_stage(BROKEN_STAGE)[0]
    run = RunResult(outcomes={"t.py::test_a": "failed", "t.py::test_b": "passed"},
                    summaries={"t.py::test_a": message}, returncode=1)
    show_check_result(ExerciseResult(exercise, run, seconds=1.0, timeout_per_exercise=10), "exercises")
    out = capsys.readouterr().out
    assert f"FAIL  {exercise.id} (1 of 2 tests fail): test_a: AssertionError: the output, shape (batch=1)\n" in out
    assert "\n      largest error 1.00e+00 at batch 0\n      first wrong entry at batch 0\n" in out


def test_check_lists_every_failing_test_the_first_in_full(capsys):
    """The first failure's message whole, then the first line of each other failed test's."""
    exercise = exercises_of_stage(BROKEN_STAGE)[0]
    failing = {"t.py::test_a": "AssertionError: the output\nlargest error 1.00e+00 at batch 0",
               "t.py::test_b": "ValueError: shapes differ\n(1, 2) vs (2, 1)", "t.py::test_c": "IndexError: out of range"}
    run = RunResult(outcomes={**dict.fromkeys(failing, "failed"), "t.py::test_d": "passed"}, summaries=failing,
                    returncode=1)
    show_check_result(ExerciseResult(exercise, run, seconds=1.0, timeout_per_exercise=10), "exercises")
    out = capsys.readouterr().out
    assert (f"FAIL  {exercise.id} (3 of 4 tests fail): test_a: AssertionError: the output\n"
            "      largest error 1.00e+00 at batch 0\n"
            "      2 more fail:\n"
            "        test_b: ValueError: shapes differ\n"
            "        test_c: IndexError: out of range\n") in out, out


def test_grading_does_not_import_the_site():
    """What grades (course grade, grade-all, the autograder) reaches no module of the site, kdacourse.pages,
    by any chain of imports (those inside functions too)."""
    from tests.course.test_import_rules import import_graph

    graph, _ = import_graph()
    reached, chains = set(), [[module] for module in ("kdacourse.grading", "kdacourse.gradeall", "kdacourse.autograder")]
    while chains:
        chain = chains.pop()
        if chain[-1].startswith("kdacourse.pages"):
            pytest.fail(f"grading imports the site: {' -> '.join(chain)}")
        if chain[-1] not in reached:
            reached.add(chain[-1])
            chains += [[*chain, module] for module in graph.get(chain[-1], {})]


def test_report_cells_keep_a_pipe_as_an_escape_that_renders():
    """report.md's cells: `\\|` and `\\\\`, no HTML entity for "|"; the table still renders the message."""
    import markdown

    from kdacourse.report_cells import report_cell

    message = "expected a | b, got a \\| b <script>\nsecond line"
    cell = report_cell(message)
    assert cell == "expected a \\| b, got a \\\\\\| b &lt;script&gt;<br>second line"
    assert "&#124;" not in cell
    html = markdown.markdown(f"| test | failure |\n|---|---|\n| t | {cell} |\n", extensions=["tables"])
    assert "<td>expected a | b, got a \\| b &lt;script&gt;<br>second line</td>" in html, html


@pytest.mark.parametrize("name", ["s01", "s1", "01", "1", "s01_linear_attention"])
def test_a_stage_is_named_as_a_student_would(name):
    from kdacourse.catalog import resolve_stage

    assert resolve_stage(name) == "s01_linear_attention"


def test_check_of_an_unknown_stage_lists_the_stages(capsys):
    assert check("s99") == 2
    error = capsys.readouterr().err
    assert "unknown stage 's99'" in error
    assert all(stage in error for stage in stages())


def test_check_of_one_exercise_runs_that_exercise_alone(capsys):
    """`course check s01.recurrent`: one exercise's tests, not its stage's (the trial's first guess)."""
    assert check("s01.recurrent", target="solutions") == 0
    out = capsys.readouterr().out
    assert "checking 1 exercise in" in out and "PASS  s01.recurrent" in out
    assert "s01.chunkwise" not in out and "1 of 1 exercises pass" in out


def test_grade_refuses_a_missing_or_empty_folder(tmp_path, capsys):
    assert grade(tmp_path / "nowhere", tmp_path / "out") == 2
    assert "no such folder" in capsys.readouterr().err
    (tmp_path / "empty" / "notes").mkdir(parents=True)
    assert grade(tmp_path / "empty", tmp_path / "out") == 2
    assert "no stage folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_grade_refuses_to_write_inside_the_graded_folder(tmp_path, capsys):
    (tmp_path / BROKEN_STAGE).mkdir()
    assert grade(tmp_path, tmp_path / "out") == 2
    assert "inside the graded folder" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_read_location_names_the_page_and_heading_of_the_anchor(tmp_path):
    """The site's page title and section, not a docs/*.md file (tests/course/test_sitelinks.py: the URL)."""
    (tmp_path / "page.md").write_text("# Page\n\n## Reference B: chunk by chunk\n\ntext\n")
    assert read_location("page.md#reference-b-chunk-by-chunk", tmp_path) == \
        "page 'Page', section 'Reference B: chunk by chunk'"
    assert read_location("page.md#no-such-heading", tmp_path) == "page 'Page', section '#no-such-heading'"
    assert read_location("page.md", tmp_path) == "page 'Page'"


def test_junit_survives_a_run_that_gave_no_result():
    """A run stopped or ended early becomes one failed testcase, its output made fit for XML."""
    exercise = EXERCISES[0]
    stopped = ExerciseResult(exercise, RunResult(returncode=-1, timed_out=True, output="dots\x00\x1b[31m..."),
                             seconds=10.0, timeout_per_exercise=10)
    exited = ExerciseResult(exercise, RunResult(returncode=0, output=""), seconds=1.0, timeout_per_exercise=10)
    written = ElementTree.tostring(junit_tree([stopped, exited]).getroot(), encoding="unicode")
    suites = ElementTree.fromstring(written)
    failures = [suite.find("testcase/failure") for suite in suites]
    assert "timed out" in failures[0].get("message") and "dots?" in failures[0].text
    assert "no test result" in failures[1].get("message")
    assert suites.get("tests") == suites.get("failures") == "2"
    assert (stopped.points, exited.points) == (0, 0)
