"""Fixtures for the exercise tests: `target_module(stage, file)` loads the code under test.

With --sandbox (untrusted grading) the target's file is never imported here: target_module returns
a kdacourse.remote proxy whose functions run in a sandboxed child, and the tests check what comes
back. A file's child starts and imports the student's file as the first of that file's tests is set
up, before any test's time limit runs, and is killed after its last test: a run that grades a whole
submission (kdacourse.grading) holds one child at a time, and one analysis child for all its kernel
programs. Compile-only and GPU tests skip there (they would lower the student's program in this
process).
"""

from pathlib import Path

import pytest

from kdacourse.targets import TargetError, load_module

EXERCISE_TESTS = Path(__file__).parent
COSTED_FILES = ("build_kernel.py", "tune_kernel.py")  # whose tests count the library kernel's cost as their target


@pytest.fixture
def target_module(request):
    """A loader: target_module("s01_linear_attention", "chunkwise.py") -> the target's module."""
    target = request.config.getoption("--target")
    if request.config.getoption("--sandbox"):
        return _remote_loader(request.config)

    def load(stage, file):
        try:
            return load_module(target, stage, file)
        except TargetError as error:
            pytest.fail(str(error), pytrace=False)

    return load


def _remote_loader(config):
    session, problems = config.course_sandbox

    def load_remote(stage, file):
        from kdacourse.remote import TargetRefused

        problem = problems.get((stage, file), problems.get("all"))
        if problem is None and session is not None:
            try:
                return session.module(stage, file)
            except TargetRefused as refused:
                problem = str(refused)
            except Exception as error:  # a RemoteError, or a builtin exception raised by the file's import
                problem = f"{stage}/{file} does not import: {type(error).__name__}: {error}"
        pytest.fail(problem or "no sandbox", pytrace=False)

    return load_remote


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--sandbox"):
        return
    skip = pytest.mark.skip(reason="untrusted grading: compile-only and GPU tests are not run (they would "
                            "lower the student's program in the grader)")
    for item in items:
        if "compile" in item.keywords or "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """--sandbox: the session of sandboxed children that the tests' student files will run in."""
    config = session.config
    if not config.getoption("--sandbox"):
        return
    from kdacourse.catalog import exercises
    from kdacourse.remote import LOAD_SECONDS, RemoteSession
    from kdacourse.sandbox import Limits, SandboxUnavailable
    from kdacourse.targets import target_folder

    timeout = float(config.getoption("--timeout", 0) or 0)
    limits = Limits(call_seconds=0.9 * timeout) if timeout > 0 else Limits()
    forbidden = {(exercise.stage, exercise.file): exercise.forbidden for exercise in exercises()}
    # a file's import may take its exercise's whole time (kdacourse.runner's limit per file), no more
    file_limit = float(config.getoption("--course-file-limit", 0) or 0)
    load_seconds = min(LOAD_SECONDS, file_limit) if file_limit else LOAD_SECONDS
    try:
        remote = RemoteSession(target_folder(config.getoption("--target")), limits=limits, forbidden=forbidden,
                               load_seconds=load_seconds)
    except (SandboxUnavailable, TargetError) as error:
        config.course_sandbox = (None, {"all": str(error)})
        return
    config.course_sandbox = (remote, {})
    if any((_student_file(item) or ("", ""))[1] in COSTED_FILES for item in session.items):
        # the cost tests build the library's kernel here, in the grader, for their target: TileLang's
        # import (seconds) is made now, before any test's time limit runs, not charged to the student
        import tilelang.language  # noqa: F401


def _student_file(item):
    """(stage, file) of the student's file an exercise test checks, or None for another test."""
    path = Path(item.path)
    if path.parent.parent != EXERCISE_TESTS:
        return None
    return path.parent.name, path.name.removeprefix("test_")


def pytest_runtest_setup(item):
    """--sandbox: the first test of a file starts the file's child and imports the student's file in
    it (outside the test's time limit); a file that does not import fails each of its tests."""
    session, problems = getattr(item.config, "course_sandbox", (None, None))
    key = _student_file(item)
    if session is None or key is None or key in problems:
        return
    from kdacourse.remote import TargetRefused

    try:
        session.module(*key)
    except TargetRefused as refused:
        problems[key] = str(refused)
    except Exception as error:  # a RemoteError, or a builtin exception raised by the file's import
        problems[key] = f"{key[0]}/{key[1]} does not import: {type(error).__name__}: {error}"


def pytest_runtest_teardown(item, nextitem):
    """--sandbox: after the last test of a file, its child is killed (the next file has its own)."""
    session = getattr(item.config, "course_sandbox", (None, None))[0]
    key = _student_file(item)
    if session is not None and key is not None and (nextitem is None or _student_file(nextitem) != key):
        session.release(*key)


def pytest_unconfigure(config):
    session = getattr(config, "course_sandbox", (None, None))[0]
    if session is not None:
        session.close()
