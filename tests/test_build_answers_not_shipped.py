"""No build exercise is answered by a program the handout ships.

A build exercise (exercises/<stage>/build_kernel.py) asks for the stage's kernel written from an empty
body. Two other exercises of its stage ship a whole program of the same kernel: the fix exercise
(kernel_program.py: a program with one seeded bug) and the tune exercise (tune_kernel.py: a right but
wasteful program). Each is put in the build answer's place, the fix exercise's with its bug repaired
(its solution), the tune exercise's as shipped, and the build exercise's tests must fail on it: they
ask for the course kernel's counted global bytes and GEMM FLOPs (within BUILD_COST_FACTOR,
tests/exercises/build_checks.py), and both shipped programs move more bytes than that. A fill
exercise's program is not a candidate: its region is what the student writes.
"""

import subprocess
import sys

import pytest

from kdacourse import REPO_ROOT
from kdacourse.catalog import exercises

BUILD_FILE = "build_kernel.py"
BUILD_EXERCISES = {e.stage: e for e in exercises() if e.file == BUILD_FILE}
COST_TEST = "test_cost_near_the_course_kernel"


def shipped_programs():
    """(stage, description, path) of every whole program of a build exercise's kernel that the handout
    ships: a fix exercise's, repaired (its solution), and a tune exercise's start program."""
    programs = []
    for exercise in exercises():
        if exercise.stage not in BUILD_EXERCISES:
            continue
        if exercise.kind == "fix" and exercise.file == "kernel_program.py":
            programs.append((exercise.stage, f"{exercise.id}, its bug repaired",
                             REPO_ROOT / "solutions" / exercise.stage / exercise.file))
        elif exercise.kind == "tune":
            programs.append((exercise.stage, f"{exercise.id} as shipped",
                             REPO_ROOT / "exercises" / exercise.stage / exercise.file))
    return programs


PROGRAMS = shipped_programs()


def _builder_name(source):
    """The build exercise's builder that `source` defines under this name or another one."""
    return next(line.split("(")[0].removeprefix("def ") for line in source.splitlines()
                if line.startswith("def build_") and "program(" in line)


@pytest.mark.parametrize("stage, description, path", PROGRAMS, ids=[d.split(",")[0].split(" ")[0] for _, d, _ in PROGRAMS])
def test_a_shipped_program_fails_the_build_exercise(stage, description, path, tmp_path):
    """The shipped program, renamed to the build exercise's builder if need be, fails the build
    exercise's cost test. Only that test runs (a few seconds, not the whole file's interpreter runs):
    the value tests pass on these programs, which are right; their cost is what gives them away."""
    exercise = BUILD_EXERCISES[stage]
    wanted = _builder_name((REPO_ROOT / "solutions" / stage / BUILD_FILE).read_text())
    source = path.read_text()
    if (given := _builder_name(source)) != wanted:
        source += f"\n\n{wanted} = {given}\n"
    (tmp_path / stage).mkdir()
    (tmp_path / stage / BUILD_FILE).write_text(source)
    run = subprocess.run([sys.executable, "-m", "pytest", str(exercise.test_path), "-q", "-p", "no:cacheprovider",
                          f"--target={tmp_path}", "-k", COST_TEST, "-rf"],
                         cwd=REPO_ROOT, capture_output=True, text=True)
    assert run.returncode == 1, f"{description} passes the tests of {exercise.id}:\n{run.stdout[-3000:]}"
    assert f"::{COST_TEST}" in run.stdout, (
        f"{description} fails {exercise.id}, but not by its cost test:\n{run.stdout[-3000:]}")
