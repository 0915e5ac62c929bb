"""Test options shared by the whole suite.

--target chooses the code that tests/exercises/ checks: "exercises" (the student's copy, the
default), "solutions", "bug:<id>" (solutions with one catalog bug) or a folder laid out like
exercises/.
"""

import os

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--target",
        default="exercises",
        help="code under test for tests/exercises: exercises | solutions | bug:<id> | <folder>",
    )


def pytest_collection_modifyitems(config, items):
    _skip_compile_tests_without_nvcc(items)
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:  # torch costs a second to import: the exercise tests' subprocesses skip it
        return
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch sees none)")
    for item in gpu_items:
        item.add_marker(skip_gpu)


def _skip_compile_tests_without_nvcc(items):
    """Compile-only tests need nvcc, not a GPU. Without it they skip, except in CI, where the
    machine has nvcc and a missing one is a broken setup that must fail loudly."""
    from stages.common.tilelang_tools import NvccMissing, find_nvcc

    compile_items = [item for item in items if "compile" in item.keywords]
    if not compile_items or os.environ.get("CI"):
        return
    try:
        find_nvcc()
    except NvccMissing as missing:
        for item in compile_items:
            item.add_marker(pytest.mark.skip(reason=str(missing)))
