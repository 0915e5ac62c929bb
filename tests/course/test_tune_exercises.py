"""Any program under a tuning exercise's target passes its tests, not only the course's: for every
tune exercise, tests/tuned_programs/<stage>/tune_kernel.py is a second tuned program, written apart
from the solution (other buffers, loops or scheduling), and the exercise's tests pass on it, run as
`course check` runs them (--target names the folder)."""

import subprocess
import sys

import pytest

from kdacourse import REPO_ROOT
from kdacourse.catalog import exercises

TUNE_EXERCISES = [exercise for exercise in exercises() if exercise.kind == "tune"]
SECOND_PROGRAMS = REPO_ROOT / "tests" / "tuned_programs"


@pytest.mark.parametrize("exercise", TUNE_EXERCISES, ids=[exercise.id for exercise in TUNE_EXERCISES])
def test_a_second_tuned_program_passes(exercise):
    assert (SECOND_PROGRAMS / exercise.stage / exercise.file).is_file(), (
        f"{exercise.id}: write a second tuned program in tests/tuned_programs/{exercise.stage}/{exercise.file}")
    run = subprocess.run([sys.executable, "-m", "pytest", str(exercise.test_path), "-q", "-p", "no:cacheprovider",
                          f"--target={SECOND_PROGRAMS}", "-m", "not gpu and not compile"],
                         cwd=REPO_ROOT, capture_output=True, text=True)
    assert run.returncode == 0, f"{exercise.id}'s tests fail on the second tuned program:\n{run.stdout[-3000:]}"
