"""Test options shared by the whole suite.

--target chooses the code that tests/exercises/ checks: "exercises" (the student's copy, the
default), "solutions", "bug:<id>" (solutions with one catalog bug) or a folder laid out like
exercises/.
"""

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--target",
        default="exercises",
        help="code under test for tests/exercises: exercises | solutions | bug:<id> | <folder>",
    )


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:  # torch costs a second to import: the exercise tests' subprocesses skip it
        return
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch sees none)")
    for item in gpu_items:
        item.add_marker(skip_gpu)
