"""Every exercise's solution is the library's code: each public function of solutions/<stage>/<file> that
the stage's library (reference.py, numerics.py) also defines has the library's code, compared as syntax
trees (comments and docstrings may differ). The cases come from the catalog, by the rule the handout uses
to decide which library functions are exercises (kdacourse.handout.solution_functions), so a new exercise
is checked without a list to update. Kernel programs (kernel.py, and the kernel package stages/kda/) are held to the library by the program
they build, not their text: tests/course/test_kernel_exercises.py."""

import importlib
import re

import pytest

from kdacourse.catalog import exercises
from kdacourse.handout import KERNEL_PACKAGE, LIBRARY_MODULES, REPO_ROOT, solution_functions
from kdacourse.targets import load_module
from tests.solution_code import assert_solution_is_library_code

KERNEL_MODULE = "kernel.py"
CASES = sorted((stage, module, name, exercise.file) for (stage, module, name), exercise in solution_functions().items()
               if module != KERNEL_MODULE and stage != KERNEL_PACKAGE)


@pytest.mark.parametrize("stage, module, name, file", CASES, ids=[f"{s}.{m[:-3]}.{n}" for s, m, n, _ in CASES])
def test_solution_is_the_library_code(stage, module, name, file):
    library = importlib.import_module(f"stages.{stage}.{module.removesuffix('.py')}")
    assert_solution_is_library_code(stage, name, library, file)


def _named_in_library(stage, name):
    """Whether any library module of the stage names `name` as a word (defines, calls or mentions it)."""
    pattern = re.compile(rf"\b{re.escape(name)}\b")
    return any(pattern.search(path.read_text()) for module in LIBRARY_MODULES
               if (path := REPO_ROOT / "stages" / stage / module).is_file())


@pytest.mark.parametrize("exercise", exercises(), ids=lambda exercise: exercise.id)
def test_every_exercise_is_held_to_the_library(exercise):
    """An exercise with no case above is a kernel program or a built kernel (held by the program it
    builds), a tuned kernel (held to the library kernel by its counted cost, in its own tests), or stands alone:
    its function (named like its file) is one the library never names. An exercise whose function the
    library still names but no longer defines, moved or dropped, fails here instead of dropping a case."""
    if exercise.file in ("kernel_program.py", "build_kernel.py", "tune_kernel.py") or any(
            file == exercise.file and stage == exercise.stage for stage, _, _, file in CASES):
        return
    name = exercise.file.removesuffix(".py")
    assert hasattr(load_module("solutions", exercise.stage, exercise.file), name), (
        f"solutions/{exercise.stage}/{exercise.file} defines no {name}")
    assert not _named_in_library(exercise.stage, name), (
        f"stages/{exercise.stage}'s library names {name} but defines none of solutions/{exercise.stage}/"
        f"{exercise.file}'s functions: define it in {', '.join(LIBRARY_MODULES)} so its code can be compared")
