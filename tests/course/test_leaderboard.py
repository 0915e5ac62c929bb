"""kdacourse.leaderboard: the counted cost of a graded tune exercise, for a gradebook's leaderboard column."""

from pathlib import Path
from types import SimpleNamespace

import pytest

from kdacourse import REPO_ROOT
from kdacourse.catalog import exercises
from kdacourse.leaderboard import counted_cost_of, leaderboard_cell

TUNE = {exercise.stage: exercise for exercise in exercises() if exercise.kind == "tune"}


def _result(exercise, passed):
    return SimpleNamespace(exercise=exercise, passed=passed)  # the two fields of an ExerciseResult it reads


@pytest.mark.parametrize("trust", [True, False], ids=["trusted", "sandboxed"])
def test_counts_the_submitted_program_not_the_course_kernel(trust):
    """The second tuned program of stage 2 (tests/tuned_programs) has one shared buffer fewer than the
    solution: the two counts differ by exactly that buffer, so the count is of the submission's file."""
    if not trust:
        from kdacourse.sandbox import sandbox_problem

        if sandbox_problem():
            pytest.skip(sandbox_problem())
    exercise = TUNE["s02_scalar_decay"]
    solution = counted_cost_of(_result(exercise, True), REPO_ROOT / "solutions", trust=True)
    second = counted_cost_of(_result(exercise, True), REPO_ROOT / "tests" / "tuned_programs", trust=trust)
    assert solution.global_bytes == second.global_bytes
    assert solution.shared_bytes - second.shared_bytes == 64 * 32 * 2  # V_decayed_s: (C, block_dv) fp16
    assert leaderboard_cell(second).endswith(f"{second.shared_bytes:,} B shared")


def test_no_cost_for_a_failed_or_other_exercise():
    failed = _result(TUNE["s02_scalar_decay"], False)
    other = _result(next(e for e in exercises() if e.kind != "tune"), True)
    assert counted_cost_of(failed, REPO_ROOT / "solutions") is None
    assert counted_cost_of(other, REPO_ROOT / "solutions") is None
    assert leaderboard_cell(None) == ""


def test_grade_all_ranks_the_class_by_counted_cost(tmp_path, monkeypatch):
    """--leaderboard: a gradebook column per tune exercise, and leaderboard.csv ranking the programs that
    passed (fewer global bytes first, then FLOPs; equal counts share a rank; a failed one is left out)."""
    import csv

    import kdacourse.gradeall as gradeall
    import kdacourse.sandbox as sandbox
    from kdacourse.catalog import exercises
    from kdacourse.grading import ExerciseResult
    from kdacourse.runner import RunResult
    from stages.common.program_cost import CountedCost

    tune = next(e for e in exercises() if e.kind == "tune")
    for student in ("ada", "bob", "cy", "dee"):
        (tmp_path / "class" / student / tune.stage).mkdir(parents=True)
    counts = {"ada": CountedCost(200, 10, 5, 64), "bob": CountedCost(100, 10, 5, 64),
              "cy": CountedCost(200, 10, 5, 64), "dee": None}

    def graded(student, batch, *arguments):
        passed = RunResult(outcomes={"t.py::test_a": "passed"})
        return [ExerciseResult(e, passed if e.id == tune.id and counts[Path(student).name] else RunResult(), 1.0, 10)
                for e in batch]

    monkeypatch.setattr(sandbox, "sandbox_problem", lambda: None)
    monkeypatch.setattr(gradeall, "run_batch", graded)
    monkeypatch.setattr(gradeall, "counted_cost_of", lambda result, folder, trust: counts[Path(folder).name]
                        if result.passed else None)
    assert gradeall.grade_all(tmp_path / "class", tmp_path / "out", leaderboard=True) == 0
    with open(tmp_path / "out" / "gradebook.csv", newline="") as f:
        book = {row["student"]: row for row in csv.DictReader(f)}
    assert book["bob"][f"{tune.id} counted cost"] == leaderboard_cell(counts["bob"])
    assert book["dee"][f"{tune.id} counted cost"] == ""
    with open(tmp_path / "out" / "leaderboard.csv", newline="") as f:
        ranked = [(row["rank"], row["student"]) for row in csv.DictReader(f) if row["exercise"] == tune.id]
    assert ranked == [("1", "bob"), ("2", "ada"), ("2", "cy")]
    assert gradeall.grade_all(tmp_path / "class", tmp_path / "plain") == 0  # without it: no column, no file
    assert "counted cost" not in (tmp_path / "plain" / "gradebook.csv").read_text()
    assert not (tmp_path / "plain" / "leaderboard.csv").exists()
