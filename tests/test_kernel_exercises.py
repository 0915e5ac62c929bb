"""The kernel exercises' solutions are the library's kernels: the program a student completes in
solutions/<stage>/kernel_program.py (or writes whole in build_kernel.py) must build the same TIR as the
builder of the same name in stages/<stage>/kernel.py, so that a change to a stage's kernel cannot leave its exercise behind.

One exception, by design: a fix exercise of a stage that has a build exercise ships a whole program of
the build exercise's kernel, so it ships another program than the library's, one that moves more global
bytes than the build exercise allows (tests/test_build_answers_not_shipped.py), else repairing its one
bug would answer the build exercise. Its solution is held here to be not the library's program; its
values by its own exercise tests, as any student's program is."""

import importlib

import pytest

from kdacourse.catalog import exercises
from kdacourse.targets import load_module

KERNEL_FILES = ("kernel_program.py", "build_kernel.py")
BUILD_STAGES = {e.stage for e in exercises() if e.file == "build_kernel.py"}
VARIANTS = [e for e in exercises() if e.file == "kernel_program.py" and e.kind == "fix" and e.stage in BUILD_STAGES]
KERNEL_EXERCISES = [e for e in exercises() if e.file in KERNEL_FILES and e not in VARIANTS]
SHAPE = (1, 128, 2, 64, 64)  # B, N, H, d_k, d_v: every stage's tile constraints hold


def _builders(module):
    return {name: getattr(module, name) for name in dir(module) if name.startswith("build_") and name.endswith("program")}


def _tir(builder):
    """The program's TIR as text, without the name of the function (a stage may rename it)."""
    program = builder(*SHAPE, chunk_size=64)
    return program.with_attr("global_symbol", "kernel").script()


@pytest.mark.parametrize("exercise", KERNEL_EXERCISES, ids=[e.id for e in KERNEL_EXERCISES])
def test_solution_builds_the_library_kernel(exercise):
    solution = load_module("solutions", exercise.stage, exercise.file)
    library = importlib.import_module(f"stages.{exercise.stage}.kernel")
    builders = _builders(solution)
    assert builders, f"solutions/{exercise.stage}/{exercise.file} defines no build_*program"
    for name, builder in builders.items():
        assert hasattr(library, name), f"stages/{exercise.stage}/kernel.py has no {name}"
        assert _tir(builder) == _tir(getattr(library, name)), (
            f"{name} of solutions/{exercise.stage}/{exercise.file} builds another program than "
            f"stages/{exercise.stage}/kernel.py: copy the kernel's change into the solution (and rerun "
            f"python -m kdacourse.shipped)")


@pytest.mark.parametrize("exercise", VARIANTS, ids=[e.id for e in VARIANTS])
def test_fix_program_of_a_build_stage_is_not_the_library_kernel(exercise):
    solution = load_module("solutions", exercise.stage, exercise.file)
    library = importlib.import_module(f"stages.{exercise.stage}.kernel")
    for name, builder in _builders(solution).items():
        assert _tir(builder) != _tir(getattr(library, name)), (
            f"{name} of solutions/{exercise.stage}/{exercise.file} builds the library's kernel, the answer of "
            f"the stage's build exercise: ship a program written otherwise (see this file's docstring)")
