"""`from_library(function, *args)`: a value of the course library that an exercise test compares with.

In the instructor's course it calls the library's function. In a handout (`course handout`), the
library's functions that are exercises are stubs that raise NotImplementedError, and so is what calls
them (reference C of stage 5 calls its exercises): there it returns the value that `course handout`
recorded from the full course, in tests/exercises/<stage>/expected/<test file>.npz.

A value is recorded per test and per call (the n-th call of a test), with a fingerprint of its array
arguments: a handout test whose inputs no longer match what was recorded fails and says so. A value
that was never recorded (a GPU test, when the handout was made on a machine without a GPU) skips its
test with a message: the instructor's grading runs it.

`course handout` records by running the tests that call from_library on the solutions with the
environment variable COURSE_RECORD_EXPECTED naming the handout's tests/exercises/ folder.
"""

import dataclasses
import importlib
import os
from pathlib import Path

import numpy as np
import pytest

from kdacourse import is_handout

RECORD_ENV = "COURSE_RECORD_EXPECTED"
EXERCISE_TESTS = Path(__file__).parent
_calls = {"test": None, "count": 0}


def from_library(function, *args, **kwargs):
    """function(*args, **kwargs), or in a handout the value recorded for this call of this test."""
    __tracebackhide__ = True
    path, key = _this_call()
    if is_handout():
        return _recorded(EXERCISE_TESTS / path, key, function, args, kwargs)
    value = function(*args, **kwargs)
    record_root = os.environ.get(RECORD_ENV)
    if record_root:
        _record(Path(record_root) / path, key, value, args, kwargs)
    return value


def _this_call():
    """(<stage>/expected/<test file>.npz, '<test name>#<n>') for the n-th call of the running test."""
    current = os.environ.get("PYTEST_CURRENT_TEST", "")
    node_id = current.rsplit(" (", 1)[0]
    file, _, test = node_id.partition("::")
    if not test:
        raise RuntimeError("from_library is meant for the exercise tests, under pytest")
    if _calls["test"] != node_id:
        _calls["test"], _calls["count"] = node_id, 0
    number = _calls["count"]
    _calls["count"] += 1
    stage_folder = Path(file).parent.name
    key = f"{test}#{number}".replace("/", "_")
    return Path(stage_folder) / "expected" / f"{Path(file).stem}.npz", key


def _fingerprint(args, kwargs):
    """Per array or number argument: its sum and the sum of its magnitudes."""
    values = [*args, *(kwargs[name] for name in sorted(kwargs))]
    sums = []
    for value in values:
        if isinstance(value, (np.ndarray, int, float)) and not isinstance(value, bool):
            array = np.asarray(value, dtype=np.float64)
            sums += [float(array.sum()), float(np.abs(array).sum())]
    return np.array(sums)


def _record(path, key, value, args, kwargs):
    entries = dict(np.load(path)) if path.is_file() else {}
    entries[f"{key}.inputs"] = _fingerprint(args, kwargs)
    if dataclasses.is_dataclass(value):
        cls = type(value)
        entries[f"{key}.class"] = np.array(f"{cls.__module__}:{cls.__qualname__}")
        for field in dataclasses.fields(value):
            entries[f"{key}.field.{field.name}"] = np.asarray(getattr(value, field.name))
    elif isinstance(value, tuple):
        entries[f"{key}.length"] = np.array(len(value))
        for position, item in enumerate(value):
            entries[f"{key}.item.{position}"] = np.asarray(item)
    else:
        entries[f"{key}.value"] = np.asarray(value)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **entries)


def _recorded(path, key, function, args, kwargs):
    __tracebackhide__ = True
    name = getattr(function, "__qualname__", repr(function))
    entries = np.load(path) if path.is_file() else {}
    if f"{key}.inputs" not in entries:
        pytest.skip(f"this handout has no recorded value of the library's {name} for this test (it was made "
                    f"where the test does not run, e.g. without a GPU); your instructor's grading runs it")
    recorded_inputs = entries[f"{key}.inputs"]
    inputs = _fingerprint(args, kwargs)
    if recorded_inputs.shape != inputs.shape or not np.allclose(inputs, recorded_inputs, rtol=1e-9, atol=1e-12):
        pytest.fail(f"the value of the library's {name} recorded in {path.name} was made for other inputs than "
                    f"this test's: the tests changed after the handout was made; ask for a new handout",
                    pytrace=False)
    if f"{key}.class" in entries:
        module, qualname = str(entries[f"{key}.class"]).split(":")
        cls = importlib.import_module(module)
        for part in qualname.split("."):
            cls = getattr(cls, part)
        prefix = f"{key}.field."
        return cls(**{field.name: entries[prefix + field.name] for field in dataclasses.fields(cls)})
    if f"{key}.length" in entries:
        return tuple(entries[f"{key}.item.{position}"] for position in range(int(entries[f"{key}.length"])))
    return entries[f"{key}.value"]
