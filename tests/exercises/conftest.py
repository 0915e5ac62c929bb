"""Fixtures for the exercise tests: `target_module(stage, file)` loads the code under test.

With --sandbox (untrusted grading) the target's file is never imported here: target_module returns
a kdacourse.remote proxy whose functions run in a sandboxed child, and the tests check what comes
back. The children start and import the student's files once tests are collected, before any test's
time limit runs; all are killed when the run ends. Compile-only and GPU tests skip there (they
would lower the student's program in this process).
"""

from pathlib import Path

import pytest

from kdacourse.targets import TargetError, load_module

EXERCISE_TESTS = Path(__file__).parent


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

        problem = problems.get((stage, file))
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
    """--sandbox: start a sandboxed child per exercise file the collected tests need, and import it there."""
    config = session.config
    if not config.getoption("--sandbox"):
        return
    from kdacourse.catalog import exercises
    from kdacourse.remote import RemoteSession, TargetRefused
    from kdacourse.sandbox import Limits, SandboxUnavailable
    from kdacourse.targets import target_folder

    files = sorted({(Path(item.path).parent.name, Path(item.path).name.removeprefix("test_"))
                    for item in session.items if Path(item.path).parent.parent == EXERCISE_TESTS})
    timeout = float(config.getoption("--timeout", 0) or 0)
    limits = Limits(call_seconds=0.9 * timeout) if timeout > 0 else Limits()
    forbidden = {(exercise.stage, exercise.file): exercise.forbidden for exercise in exercises()}
    problems = {}
    try:
        remote = RemoteSession(target_folder(config.getoption("--target")), limits=limits, forbidden=forbidden)
    except (SandboxUnavailable, TargetError) as error:
        config.course_sandbox = (None, dict.fromkeys(files, str(error)))
        return
    config.course_sandbox = (remote, problems)
    for stage, file in files:
        try:
            remote.module(stage, file)
        except TargetRefused as refused:
            problems[(stage, file)] = str(refused)
        except Exception as error:  # a RemoteError, or a builtin exception raised by the file's import
            problems[(stage, file)] = f"{stage}/{file} does not import: {type(error).__name__}: {error}"


def pytest_unconfigure(config):
    session = getattr(config, "course_sandbox", (None, None))[0]
    if session is not None:
        session.close()
