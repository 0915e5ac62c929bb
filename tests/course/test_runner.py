"""kdacourse/runner.py's time limits: a test that fails just before its limit, on a machine so loaded
that pytest's formatting of the failure runs past it, is reported as that failure, and the run goes
on to the next test."""

import subprocess
import sys
import xml.etree.ElementTree as ElementTree

from kdacourse.runner import timeout_options

LIMIT_S = 1.0

# The test fails at 0.8 of the limit (where the sandbox stops a call: 0.9); the hook stands for a
# loaded machine, on which formatting the failure takes longer than what is left of the limit.
TESTS = '''
import time

def test_fails_just_before_the_limit():
    time.sleep(0.8 * LIMIT_S)
    raise AssertionError("stopped before the limit")

def test_after_it():
    pass
'''
CONFTEST = '''
import time
import pytest

@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "call" and call.excinfo is not None:
        time.sleep(0.5 * LIMIT_S)
    yield
'''


def _run(folder, options):
    for name, text in (("test_slow_report.py", TESTS), ("conftest.py", CONFTEST)):
        (folder / name).write_text(f"LIMIT_S = {LIMIT_S}\n" + text)
    junit = folder / "junit.xml"
    completed = subprocess.run([sys.executable, "-m", "pytest", str(folder), *options, f"--junitxml={junit}",
                                "-p", "no:cacheprovider", "-q", "--rootdir", str(folder)],
                               capture_output=True, text=True, timeout=60, cwd=folder)
    cases = {case.get("name"): case for case in ElementTree.parse(junit).iter("testcase")}
    return completed, cases


def test_a_failure_formatted_past_the_limit_is_that_failure(tmp_path):
    completed, cases = _run(tmp_path, timeout_options(LIMIT_S))
    assert "INTERNALERROR" not in completed.stdout + completed.stderr
    assert set(cases) == {"test_fails_just_before_the_limit", "test_after_it"}
    failure = cases["test_fails_just_before_the_limit"].find("failure")
    assert failure is not None and "stopped before the limit" in failure.get("message")
    assert len(cases["test_after_it"]) == 0  # passed: no failure, error or skipped element


def test_the_whole_test_limit_breaks_such_a_run(tmp_path):
    """The same run with pytest-timeout's default (the limit over setup, call, teardown and the
    reports): the alarm goes off inside pytest, and the run ends there. What timeout_options avoids."""
    completed, cases = _run(tmp_path, [f"--timeout={LIMIT_S}"])
    assert "INTERNALERROR" in completed.stdout + completed.stderr
    assert "test_after_it" not in cases
