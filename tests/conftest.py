"""Test options shared by the whole suite.

--target chooses the code that tests/exercises/ checks: "exercises" (the student's copy, the
default), "solutions", "bug:<id>" (solutions with one catalog bug) or a folder laid out like
exercises/. --sandbox (what `course grade` passes) runs a folder's code in a sandbox only.
"""

import os
import signal

import pytest

# A compile-only test lowers a kernel and runs nvcc: 10 s alone, a minute on a loaded 2-core
# machine. Its limits (wall-clock and CPU) are this, whatever the run's limit per test.
COMPILE_TEST_LIMIT_S = 600


def pytest_addoption(parser):
    parser.addoption(
        "--target",
        default="exercises",
        help="code under test for tests/exercises: exercises | solutions | bug:<id> | <folder>",
    )
    parser.addoption(
        "--cpu-timeout",
        type=float,
        default=0,
        help="fail a test that uses more than this many seconds of CPU time (0: no limit); unlike "
        "pytest-timeout's wall-clock --timeout, a loaded machine cannot make a correct test hit it",
    )
    parser.addoption(
        "--sandbox",
        action="store_true",
        help="untrusted grading: a folder target's code runs only in a sandboxed child (kdacourse.remote); "
        "this process never imports it",
    )


def pytest_configure(config):
    """A pytest-xdist worker (`course test` runs one per core) computes on one thread: torch would
    otherwise start a thread per core in each worker, and its threads spin waiting for each other while
    the other worker holds a core (tests/kernels/test_s06_layer.py on 2 cores: 80 s, 52 s of CPU; on
    one thread 9 s, 6 s). Set before any test imports torch, which reads it once."""
    if hasattr(config, "workerinput"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


# Tests that read one computation made once per process: under pytest-xdist (`course test` runs a
# worker per core) each group runs on one worker, so the computation is made once, not per worker.
KILL_MATRIX_GROUP = "kill_matrix"  # kdacourse.killmatrix.compute: a pytest run per catalog bug


def xdist_group(item):
    """The item's xdist group, or None: the kill matrix's readers (its pages, the caught-bug tests),
    and a file's tests that share a module- or session-scoped fixture defined in that file."""
    if "kill_matrix" in item.nodeid or getattr(item, "originalname", "") == "test_every_bug_is_caught":
        return KILL_MATRIX_GROUP
    module = item.nodeid.split("::")[0]
    fixtures = getattr(item, "_fixtureinfo", None)
    for definitions in (fixtures.name2fixturedefs.values() if fixtures else ()):
        if any(d.scope in ("module", "session") and d.baseid == module for d in definitions):
            return module
    return None


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    grouped = []
    for item in items:
        group = xdist_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
            grouped.append(item)
    # the groups first: each is one long computation (the kill matrix, a grading of the solutions), and
    # the scheduler hands tests out in this order, so a group started last leaves the other worker idle
    # at the end while the single tests, short and many, fill the gaps either way
    first = set(map(id, grouped))
    items[:] = grouped + [item for item in items if id(item) not in first]
    _skip_compile_tests_without_nvcc(items)
    for item in items:
        if "compile" in item.keywords:
            item.add_marker(pytest.mark.timeout(COMPILE_TEST_LIMIT_S))
    gpu_items = [item for item in items if "gpu" in item.keywords]
    # torch costs two seconds of CPU to import: runs without GPU tests skip it, and so does untrusted
    # grading, which skips them anyway (tests/exercises/conftest.py)
    if not gpu_items or config.getoption("--sandbox", default=False):
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


class CpuTimeLimit(Exception):
    """A test used more CPU time than --cpu-timeout allows."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    """--cpu-timeout: a limit on the CPU time the test's call uses, through ITIMER_PROF (SIGPROF)."""
    limit = item.config.getoption("--cpu-timeout")
    if not limit or not hasattr(signal, "setitimer"):
        yield
        return
    if "compile" in item.keywords:
        limit = max(limit, COMPILE_TEST_LIMIT_S)

    def stop(signum, frame):
        raise CpuTimeLimit(f"the test used more than {limit:g} s of CPU time and was stopped (an endless loop?)")

    previous = signal.signal(signal.SIGPROF, stop)
    signal.setitimer(signal.ITIMER_PROF, limit)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def pytest_runtest_logreport(report):
    """With KDACOURSE_FAILURES=FILE, each failure's traceback and captured output go into FILE as it
    happens (a GPU run cut by its device call's time limit still says why its tests failed; pytest's
    summary comes only at the end). Written by the main process: xdist's workers send it their reports."""
    path = os.environ.get("KDACOURSE_FAILURES")
    if path and report.failed and "PYTEST_XDIST_WORKER" not in os.environ:
        with open(path, "a") as failures:
            failures.write(f"==== {report.nodeid} ({report.when})\n{report.capstdout}\n{report.longreprtext}\n")
