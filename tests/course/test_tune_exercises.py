"""Any program under a tuning exercise's target passes its tests, not only the course's: for every
tune exercise, tests/tuned_programs/<stage>/tune_kernel.py is a second tuned program, written apart
from the solution (other buffers, loops or scheduling), and the exercise's tests pass on it, run as
`course check` runs them (--target names the folder)."""

import pytest

from kdacourse import REPO_ROOT
from kdacourse.catalog import exercises
from kdacourse.runner import run_tests

TUNE_EXERCISES = [exercise for exercise in exercises() if exercise.kind == "tune"]
SECOND_PROGRAMS = REPO_ROOT / "tests" / "tuned_programs"


def _test_file(exercise):
    return exercise.test_path.relative_to(REPO_ROOT).as_posix()


@pytest.fixture(scope="module")
def second_programs_run():
    """Every tune exercise's tests on tests/tuned_programs/: one pytest process (each test file loads only
    its own stage's program), which imports TileLang once."""
    return run_tests(str(SECOND_PROGRAMS), [_test_file(e) for e in TUNE_EXERCISES], timeout_per_test=600,
                     timeout_total=3600, extra_args=("-m", "not gpu and not compile"))


@pytest.mark.parametrize("exercise", TUNE_EXERCISES, ids=[exercise.id for exercise in TUNE_EXERCISES])
def test_a_second_tuned_program_passes(exercise, second_programs_run):
    assert (SECOND_PROGRAMS / exercise.stage / exercise.file).is_file(), (
        f"{exercise.id}: write a second tuned program in tests/tuned_programs/{exercise.stage}/{exercise.file}")
    run = second_programs_run.of_file(_test_file(exercise))
    assert run.returncode == 0 and run.all_passed(), (
        f"{exercise.id}'s tests fail on the second tuned program: {run.failed() or 'none ran'}\n{run.output[-3000:]}")
