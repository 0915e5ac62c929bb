"""The build exercises (exercises/<stage>/build_kernel.py) grade behaviour and budgets, never the
course's text: each one's tests pass on a second correct program, tiled otherwise than the course's
kernel (tests/build_alternatives/<stage>/build_kernel.py, a folder laid out like exercises/), and
that program is not the course's."""

import importlib

import pytest

from kdacourse import REPO_ROOT
from kdacourse.catalog import exercises
from kdacourse.runner import run_tests
from kdacourse.targets import load_module

BUILD_FILE = "build_kernel.py"
BUILD_EXERCISES = [e for e in exercises() if e.file == BUILD_FILE]
ALTERNATIVES = REPO_ROOT / "tests" / "build_alternatives"
SHAPE = (1, 64, 2, 32, 32)  # B, N, H, d_k, d_v: every stage's tile constraints hold


def _builder_names(module):
    return sorted(name for name in dir(module) if name.startswith("build_") and name.endswith("program"))


def _test_file(exercise):
    return exercise.test_path.relative_to(REPO_ROOT).as_posix()


@pytest.fixture(scope="module")
def alternatives_run():
    """Every build exercise's tests on tests/build_alternatives/, GPU tests aside: one pytest process
    (each test file loads only its own stage's program), which imports TileLang once."""
    return run_tests(str(ALTERNATIVES), [_test_file(e) for e in BUILD_EXERCISES], timeout_per_test=600,
                     timeout_total=3600, extra_args=("-m", "not gpu"))


@pytest.mark.parametrize("exercise", BUILD_EXERCISES, ids=[e.id for e in BUILD_EXERCISES])
def test_a_second_program_passes_the_exercise_tests(exercise, alternatives_run):
    assert (ALTERNATIVES / exercise.stage / BUILD_FILE).is_file(), f"{exercise.id} has no second program"
    run = alternatives_run.of_file(_test_file(exercise))
    assert run.returncode == 0 and run.all_passed(), (
        f"the tests of {exercise.id} fail on {ALTERNATIVES.name}/{exercise.stage}/{BUILD_FILE}: "
        f"{run.failed() or 'none ran'}\n{run.output[-3000:]}")


@pytest.mark.parametrize("exercise", BUILD_EXERCISES, ids=[e.id for e in BUILD_EXERCISES])
def test_the_second_program_is_not_the_course_kernel(exercise):
    alternative = load_module(str(ALTERNATIVES), exercise.stage, BUILD_FILE)
    library = importlib.import_module(f"stages.{exercise.stage}.kernel")
    for name in _builder_names(alternative):
        ours = getattr(library, name)(*SHAPE, chunk_size=16).with_attr("global_symbol", "kernel").script()
        theirs = getattr(alternative, name)(*SHAPE, chunk_size=16).with_attr("global_symbol", "kernel").script()
        assert ours != theirs, f"{name} of the second program builds the course's kernel"
