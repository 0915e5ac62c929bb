"""The three facts of the exercise model, checked on every CI run, and the shape of the exercises.

1. every exercise test passes on the solutions (`course test` runs the suite, tests/exercises
   included, with --target=solutions);
2. every exercise fails as shipped (tests/course/test_grading.py::test_shipped_exercises_score_zero grades the
   shipped files as the grader grades a submission, in the sandbox: every exercise fails a test);
3. every catalog bug is caught by at least one test (the kill matrix).
"""


import pytest

from kdacourse import REPO_ROOT
from kdacourse.catalog import exercises, load_catalog
from kdacourse.killmatrix import compute
from kdacourse.shipped import shipped_source, split_region

EXERCISES = exercises()
ids = [e.id for e in EXERCISES]


@pytest.mark.parametrize("exercise", EXERCISES, ids=ids)
def test_exercise_differs_from_solution_only_inside_its_region(exercise):
    shipped = (REPO_ROOT / "exercises" / exercise.stage / exercise.file).read_text()
    solution = (REPO_ROOT / "solutions" / exercise.stage / exercise.file).read_text()
    shipped_before, _, shipped_after = split_region(shipped, exercise.id)
    solution_before, _, solution_after = split_region(solution, exercise.id)
    assert (shipped_before, shipped_after) == (solution_before, solution_after)


@pytest.mark.parametrize("exercise", EXERCISES, ids=ids)
def test_exercises_are_as_shipped(exercise):
    """exercises/ is what `python -m kdacourse.shipped` makes from solutions/ and the catalog."""
    assert (REPO_ROOT / "exercises" / exercise.stage / exercise.file).read_text() == shipped_source(exercise)


def test_every_exercise_has_its_tests():
    for exercise in EXERCISES:
        assert exercise.test_path.is_file(), f"{exercise.id}: {exercise.test_path} is missing"


@pytest.mark.parametrize("bug_id", list(load_catalog()[1]), ids=str)
def test_every_bug_is_caught(bug_id):
    result = compute()[bug_id]
    assert result.outcomes, f"bug {bug_id}: no test ran\n{result.output[-2000:]}"
    assert result.failed(), f"bug {bug_id} is caught by no test: strengthen the tests of its stage"


def test_fix_exercises_carry_their_bug_inside_the_region():
    for exercise in EXERCISES:
        if exercise.kind == "fix":
            shipped_source(exercise)  # raises if the bug is outside the region or not found once
