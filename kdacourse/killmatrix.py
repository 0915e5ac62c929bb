"""The kill matrix: which exercise test catches which catalog bug.

For every bug, the tests of the file it is seeded into (tests/exercises/<stage>/test_<file>) run
against the solutions with that bug applied (`--target=bug:<id>`), each run in its own process. An
exercise test loads only the file it is named after (tests/exercises/conftest.py's target_module),
so the stage's other tests run the solutions unchanged and cannot catch the bug: they are not run.
A bug no test catches is a hole in the tests: test_exercise_model.py fails on it.
kdacourse/pages/course.py writes the matrix to docs/generated/kill_matrix.md.
"""

import re
from functools import cache

from kdacourse.catalog import bugs
from kdacourse.prefork import run_many


def stage_tests(stage):
    return f"tests/exercises/{stage}"


def file_tests(stage, file):
    """The tests of one exercise file: the only tests that load it."""
    return f"{stage_tests(stage)}/test_{file}"


@cache
def compute():
    """{bug id: RunResult of its file's exercise tests against the solutions with that bug}."""
    catalog = bugs()
    # compile tests look for spills and shared memory, not for wrong values: a bug is caught (or
    # missed) by the tests that run the code, so the matrix spares itself an nvcc run per bug. The runs
    # are forked from one process that imported TileLang once (kdacourse.prefork): 3 s of CPU per run.
    results = run_many([{"target": f"bug:{bug.id}", "test_paths": [file_tests(bug.stage, bug.file)],
                         "extra_args": ("-m", "not compile")} for bug in catalog], workers=2)
    return {bug.id: result for bug, result in zip(catalog, results)}


def test_function(test_id):
    """'tests/exercises/s01/test_x.py::test_y[8-8]' -> 'test_x.py::test_y'."""
    return re.sub(r"\[.*\]$", "", test_id.split("/")[-1])
