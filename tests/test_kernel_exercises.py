"""The kernel exercises' solutions are the library's kernels: the program a student completes in
solutions/<stage>/kernel_program.py (or writes whole in build_kernel.py) must build the same TIR as the
builder of the same name in stages/<stage>/kernel.py, so that a change to a stage's kernel cannot leave its exercise behind.

One exception, by design: the fix exercise of a stage that has a build exercise must not answer it
(tests/test_build_answers_not_shipped.py), so it ships a kernel of its own, one the library does not
build (stage 4's: KDA token by token, a builder the library lacks). Its solution is held here to build
no program of the library's; its values by its own exercise tests against the references, as any
student's program is."""

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
    builders = _builders(solution)
    assert builders, f"solutions/{exercise.stage}/{exercise.file} defines no build_*program"
    for name, builder in builders.items():
        # a builder the library lacks is another kernel of the stage; one it has must build another program
        assert not hasattr(library, name) or _tir(builder) != _tir(getattr(library, name)), (
            f"{name} of solutions/{exercise.stage}/{exercise.file} builds the library's kernel, the answer of "
            f"the stage's build exercise: ship a program written otherwise (see this file's docstring)")
