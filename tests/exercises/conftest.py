"""Fixtures for the exercise tests: `target_module(stage, file)` loads the code under test."""

import pytest

from kdacourse.targets import TargetError, load_module


@pytest.fixture
def target_module(request):
    """A loader: target_module("s01_linear_attention", "chunkwise.py") -> the target's module."""
    target = request.config.getoption("--target")

    def load(stage, file):
        try:
            return load_module(target, stage, file)
        except TargetError as error:
            pytest.fail(str(error), pytrace=False)

    return load
