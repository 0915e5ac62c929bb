"""The kernel exercises' solutions are the library's kernels: the program a student completes in
solutions/<stage>/kernel_program.py (or writes whole in build_kernel.py) must build the same TIR as the
builder of the same name in stages/<stage>/kernel.py, so that a change to a stage's kernel cannot leave its exercise behind.

One exception, by design: the kernel_program.py exercise (fix or fill) of a stage that has a build
exercise must not answer it (tests/course/test_build_answers_not_shipped.py), so it is a kernel of its own,
one the library does not build (stages 1-4: the recurrence token by token, a builder the library
lacks). Its solution is held here to build no program of the library's; its values by its own
exercise tests against the references, as any student's program is."""

import importlib

import pytest

from kdacourse.catalog import exercises
from kdacourse.targets import load_module

KERNEL_FILES = ("kernel_program.py", "build_kernel.py")
BUILD_EXERCISES = {e.stage: e for e in exercises() if e.file == "build_kernel.py"}
KERNEL_EXERCISES = [e for e in exercises() if e.file in KERNEL_FILES]
BESIDE_A_BUILD = [e for e in exercises() if e.file == "kernel_program.py" and e.stage in BUILD_EXERCISES]
SHAPE = (1, 128, 2, 64, 64)  # B, N, H, d_k, d_v: every stage's tile constraints hold


def _builders(module):
    return {name: getattr(module, name) for name in dir(module) if name.startswith("build_") and name.endswith("program")}


def _tir(builder):
    """The program's TIR as text, without the name of the function (a stage may rename it)."""
    program = builder(*SHAPE, chunk_size=64)
    return program.with_attr("global_symbol", "kernel").script()


@pytest.mark.parametrize("exercise", KERNEL_EXERCISES, ids=[e.id for e in KERNEL_EXERCISES])
def test_solution_builds_the_library_kernel(exercise):
    """Every builder of the solution that the library defines builds the library's TIR; one it does not
    define is a kernel of its own, allowed only beside a build exercise (this file's docstring)."""
    solution = load_module("solutions", exercise.stage, exercise.file)
    library = importlib.import_module(f"stages.{exercise.stage}.kernel")
    builders = _builders(solution)
    assert builders, f"solutions/{exercise.stage}/{exercise.file} defines no build_*program"
    for name, builder in builders.items():
        if not hasattr(library, name):
            assert exercise in BESIDE_A_BUILD, f"stages/{exercise.stage}/kernel.py has no {name}"
            continue
        assert _tir(builder) == _tir(getattr(library, name)), (
            f"{name} of solutions/{exercise.stage}/{exercise.file} builds another program than "
            f"stages/{exercise.stage}/kernel.py: copy the kernel's change into the solution (and rerun "
            f"python -m kdacourse.shipped)")


@pytest.mark.parametrize("exercise", BESIDE_A_BUILD, ids=[e.id for e in BESIDE_A_BUILD])
def test_kernel_program_beside_a_build_exercise_is_another_kernel(exercise):
    """It builds no program of the build exercise's builder: repaired or filled, it is not that answer."""
    solution = load_module("solutions", exercise.stage, exercise.file)
    build_solution = load_module("solutions", exercise.stage, BUILD_EXERCISES[exercise.stage].file)
    shared = set(_builders(solution)) & set(_builders(build_solution))
    assert _builders(solution) and not shared, (
        f"solutions/{exercise.stage}/{exercise.file} defines {', '.join(sorted(shared)) or 'no builder'}, the build "
        f"exercise's builder: ship another kernel of the stage (see this file's docstring)")
