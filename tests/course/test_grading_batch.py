"""Grading a submission in one test process (issue 25, item 5: 30 submissions in 10 minutes on 2 cores).

In the sandbox the student's code runs only in sandboxed children, so grading runs all of a
submission's exercises in one pytest process (kdacourse.grading.run_batch) and its TileLang files in
one child. What must still hold:

- each exercise keeps its limits: a file whose tests run past the limit per exercise fails its other
  tests at once and is reported timed out, and the next file runs as if alone;
- a run stopped at its total limit still reports the tests that ended, and the others as timed out;
- the files that import TileLang share a child (those the catalog forbids the same names), the others
  have one each, and a child killed for one file takes nothing from the next;
- grade-all starts one test process per student.
"""

import os
import textwrap

import pytest

from kdacourse.remote import RemoteSession, SandboxCallFailed, imports_tilelang
from kdacourse.runner import RunResult, run_tests
from kdacourse.sandbox import Limits, sandbox_problem

CONFTEST = '''
def pytest_addoption(parser):
    parser.addoption("--target")
    parser.addoption("--cpu-timeout")
'''


def _files(tmp_path, **tests):
    """tmp_path/test_<name>.py for each name -> test source; their paths."""
    (tmp_path / "conftest.py").write_text(CONFTEST)
    paths = []
    for name, source in tests.items():
        path = tmp_path / f"test_{name}.py"
        path.write_text(textwrap.dedent(source))
        paths.append(path)
    return paths


def _part(run, path):
    """The run's part for the file at `path` (test ids are relative to the folder pytest ran in)."""
    (test_file,) = {test.split("::")[0] for test in run.collected if test.endswith(path.name) or
                    test.split("::")[0].endswith(path.name)}
    return run.of_file(test_file)


SLOW_FILE = '''
    import time

    def test_1():
        time.sleep(0.6)

    def test_2():
        time.sleep(0.6)

    def test_3():
        pass

    def test_4():
        pass
'''
QUICK_FILE = '''
    def test_a():
        pass

    def test_b():
        pass
'''


def test_a_file_past_its_limit_fails_its_other_tests_and_the_next_file_runs(tmp_path):
    slow, quick = _files(tmp_path, slow=SLOW_FILE, quick=QUICK_FILE)
    run = run_tests("exercises", [slow, quick], timeout_per_test=30, timeout_total=120, timeout_per_file=1.0)
    slow_part, quick_part = _part(run, slow), _part(run, quick)
    names = {test.split("::")[-1]: outcome for test, outcome in slow_part.outcomes.items()}
    assert names == {"test_1": "passed", "test_2": "passed", "test_3": "failed", "test_4": "failed"}
    assert [test.split("::")[-1] for test in slow_part.timeouts] == ["test_3"]
    message = next(m for t, m in slow_part.summaries.items() if t.endswith("test_3"))
    assert "past the time limit of its file (1 s" in message
    assert slow_part.returncode == 1 and not slow_part.timed_out
    assert set(quick_part.outcomes.values()) == {"passed"} and quick_part.returncode == 0
    assert not quick_part.timeouts and not quick_part.summaries
    assert len(quick_part.seconds) == 2 and sum(slow_part.seconds.values()) >= 1.2


def test_a_stopped_run_reports_the_tests_that_ended(tmp_path):
    hangs, never = _files(tmp_path, hangs='''
        import time

        def test_ends():
            pass

        def test_hangs():
            time.sleep(600)
    ''', never=QUICK_FILE)
    run = run_tests("exercises", [hangs, never], timeout_per_test=300, timeout_total=15)
    assert run.timed_out and not run.junit_xml  # pytest was killed: only the plugin's lines tell
    hangs_part, never_part = _part(run, hangs), _part(run, never)
    assert {test.split("::")[-1]: outcome for test, outcome in hangs_part.outcomes.items()} == {"test_ends": "passed"}
    assert hangs_part.timed_out and not hangs_part.all_passed()
    assert never_part.timed_out and not never_part.outcomes


def test_a_part_of_a_run_that_went_wrong_as_a_whole_keeps_its_exit_code():
    run = RunResult(outcomes={"a.py::test_x": "passed"}, returncode=3, collected=["a.py::test_x"])
    assert run.of_file("a.py").returncode == 3
    run = RunResult(outcomes={"a.py::test_x": "passed", "b.py::test_y": "failed"}, returncode=1,
                    collected=["a.py::test_x", "b.py::test_y"])
    assert (run.of_file("a.py").returncode, run.of_file("b.py").returncode) == (0, 1)


@pytest.mark.parametrize("source, imports", [
    ("import tilelang\n", True),
    ("import tilelang.language as T\n", True),
    ("from tilelang import language as T\n", True),
    ("def f():\n    import tilelang\n", True),
    ("import numpy as np\n# import tilelang\n", False),
    ("import tilelangx\n", False),
    ("def broken(:\n", False),
])
def test_imports_tilelang_reads_the_syntax_tree(source, imports):
    assert imports_tilelang(source) is imports


STAGE = "s01_linear_attention"


@pytest.fixture
def needs_sandbox():
    problem = sandbox_problem()
    if problem and not os.environ.get("CI"):
        pytest.skip(f"no sandbox here: {problem}")
    assert problem is None, problem


def _submission(tmp_path, **files):
    folder = tmp_path / "submission" / STAGE
    folder.mkdir(parents=True)
    for name, source in files.items():
        (folder / f"{name}.py").write_text(source)
    return tmp_path / "submission"


LOADED = textwrap.dedent('''
    import sys
    def loaded():
        return sorted(name for name in sys.modules if name.startswith("course_target."))
''')


def test_tilelang_files_share_a_child_and_a_killed_child_takes_nothing_from_the_next(tmp_path, needs_sandbox):
    submission = _submission(
        tmp_path,
        first="import tilelang\n" + LOADED + "def loop():\n    while True:\n        pass\n",
        second="import tilelang\n" + LOADED,
        forbidding="import tilelang\n" + LOADED,
        plain=LOADED,
    )
    session = RemoteSession(submission, limits=Limits(call_seconds=5),
                            forbidden={(STAGE, "forbidding.py"): ("np.linalg.inv",)})
    try:
        first, second = session.module(STAGE, "first.py"), session.module(STAGE, "second.py")
        both = [f"course_target.{STAGE}.first", f"course_target.{STAGE}.second"]
        assert first.loaded() == second.loaded() == both
        assert session.module(STAGE, "forbidding.py").loaded() == [f"course_target.{STAGE}.forbidding"]
        assert session.module(STAGE, "plain.py").loaded() == [f"course_target.{STAGE}.plain"]
        with pytest.raises(SandboxCallFailed, match="timed out"):
            first.loop()
        assert second.loaded() == [f"course_target.{STAGE}.second"]  # imported again in a fresh child
        session.release(STAGE, "second.py")
        assert first.loaded() == both  # the shared child lives on, second's module in it
    finally:
        session.close()


def test_grade_all_starts_one_test_process_per_student(tmp_path, monkeypatch):
    import kdacourse.grading as grading
    import kdacourse.sandbox as sandbox
    from kdacourse.catalog import exercises
    from kdacourse.gradeall import grade_all

    for student in ("ada", "bob", "cy"):
        (tmp_path / "class" / student / STAGE).mkdir(parents=True)
    (tmp_path / "class" / "cy" / "s02_scalar_decay").mkdir()
    runs = []
    monkeypatch.setattr(sandbox, "sandbox_problem", lambda: None)
    monkeypatch.setattr(grading, "run_tests", lambda target, paths, **options: runs.append((target, paths))
                        or RunResult())
    assert grade_all(tmp_path / "class", tmp_path / "out") == 0
    assert sorted(os.path.basename(target) for target, _ in runs) == ["ada", "bob", "cy"]
    per_student = {os.path.basename(target): len(paths) for target, paths in runs}
    stage_1, stage_2 = (sum(e.stage == stage for e in exercises()) for stage in (STAGE, "s02_scalar_decay"))
    assert per_student == {"ada": stage_1, "bob": stage_1, "cy": stage_1 + stage_2}


def test_grade_all_grades_the_stages_asked_and_its_gradebook_counts_them(tmp_path, monkeypatch):
    """--stages 1: a student's stage 2 is not run, and the gradebook's columns and max are stage 1's."""
    import csv
    import json

    import kdacourse.grading as grading
    import kdacourse.sandbox as sandbox
    from kdacourse import REPO_ROOT
    from kdacourse.catalog import exercises
    from kdacourse.gradeall import grade_all

    for stage in (STAGE, "s02_scalar_decay"):
        (tmp_path / "class" / "ada" / stage).mkdir(parents=True)
    runs = []
    monkeypatch.setattr(sandbox, "sandbox_problem", lambda: None)
    monkeypatch.setattr(grading, "run_tests", lambda target, paths, **options: runs.append(paths) or RunResult())
    assert grade_all(tmp_path / "class", tmp_path / "out", only_stages=["1"]) == 0
    stage_1 = [exercise for exercise in exercises() if exercise.stage == STAGE]
    assert [str(path) for paths in runs for path in paths] == [str(e.test_path.relative_to(REPO_ROOT)) for e in stage_1]
    with open(tmp_path / "out" / "gradebook.csv", newline="") as f:
        (row,) = csv.DictReader(f)
    assert list(row)[1:-3] == [exercise.id for exercise in stage_1]
    assert row["max"] == str(sum(exercise.points for exercise in stage_1))
    report = json.loads((tmp_path / "out" / "ada" / "report.json").read_text())
    assert report["max_score"] == int(row["max"]) and report["stages_not_graded"] == []
    assert grade_all(tmp_path / "class", tmp_path / "other", only_stages=["s99"]) == 2


def test_a_submission_splits_into_whole_stages():
    """course grade's batches: one per core, every exercise once, whole stages, catalog order within
    each. (How the work is weighed is a speed choice, measured by kdacourse.grading_speed, not checked.)"""
    from kdacourse.catalog import exercises
    from kdacourse.grading import split_by_stage

    selected = exercises()
    batches = split_by_stage(selected, 2)
    assert len(batches) == 2
    assert sorted(e.id for batch in batches for e in batch) == sorted(e.id for e in selected)
    for batch in batches:
        assert batch == [e for e in selected if e in batch]
        assert not {e.stage for e in batch} & {e.stage for other in batches if other is not batch for e in other}
