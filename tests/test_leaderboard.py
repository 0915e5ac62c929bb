"""kdacourse.leaderboard: the counted cost of a graded tune exercise, for a gradebook's leaderboard column."""

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
