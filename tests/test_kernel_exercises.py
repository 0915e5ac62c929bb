"""The kernel exercises' solutions are the library's kernels: the program a student completes in
solutions/<stage>/kernel_program.py (or writes whole in build_kernel.py) must build the same TIR as the
builder of the same name in stages/<stage>/kernel.py, so that a change to a stage's kernel cannot leave its exercise behind."""

import importlib

import pytest

from kdacourse.catalog import exercises
from kdacourse.targets import load_module

KERNEL_FILES = ("kernel_program.py", "build_kernel.py")
KERNEL_EXERCISES = [e for e in exercises() if e.file in KERNEL_FILES]
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
