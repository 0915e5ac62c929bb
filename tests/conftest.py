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
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch sees none)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
