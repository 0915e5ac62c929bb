"""Running tests against a target in a separate process, with time limits.

Every run is a fresh `python -m pytest` subprocess: a student's file that crashes the interpreter,
loops forever or exits the process costs that run, never the caller. Results come back through a
JUnit XML file in a temporary folder, never through the target's folder.
"""

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

from kdacourse import REPO_ROOT


@dataclass
class RunResult:
    """outcomes: test id -> "passed" | "failed" | "skipped"; messages: test id -> failure text;
    summaries: test id -> the failure's message alone (its first lines, without the traceback)."""

    outcomes: dict = field(default_factory=dict)
    messages: dict = field(default_factory=dict)
    summaries: dict = field(default_factory=dict)
    returncode: int = 0
    timed_out: bool = False
    output: str = ""
    junit_xml: str = ""

    def failed(self):
        return [test for test, outcome in self.outcomes.items() if outcome == "failed"]

    def all_passed(self):
        return bool(self.outcomes) and not self.timed_out and all(o != "failed" for o in self.outcomes.values())


def run_tests(target, test_paths, timeout_per_test=30, timeout_total=300, extra_args=(), cpu_timeout_per_test=0):
    """Run pytest on `test_paths` (relative to the repository) with --target=`target`.

    timeout_per_test is wall-clock (pytest-timeout, the test function only: timeout_options);
    cpu_timeout_per_test, if not 0, limits the CPU time of each test (tests/conftest.py), which load
    on the machine does not stretch.
    """
    with tempfile.TemporaryDirectory(prefix="course-run-") as workdir:
        junit = Path(workdir) / "junit.xml"
        command = [
            sys.executable, "-m", "pytest", *map(str, test_paths),
            f"--target={target}", *timeout_options(timeout_per_test), f"--cpu-timeout={cpu_timeout_per_test}",
            f"--junitxml={junit}",
            "-p", "no:cacheprovider", "-q", "--no-header", "-rN", *extra_args,
        ]
        environment = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        try:
            completed = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True,
                                       timeout=timeout_total, env=environment, stdin=subprocess.DEVNULL)
            returncode, output, timed_out = completed.returncode, completed.stdout + completed.stderr, False
        except subprocess.TimeoutExpired as expired:
            returncode, timed_out = -1, True
            output = _text(expired.stdout) + _text(expired.stderr) + f"\n[stopped after {timeout_total} s]"
        xml = junit.read_text() if junit.exists() else ""
    result = RunResult(returncode=returncode, timed_out=timed_out, output=output, junit_xml=xml)
    if xml:
        _read_junit(xml, result)
    return result


def timeout_options(timeout_per_test):
    """pytest-timeout's options for a run: the wall-clock limit covers each test's function only.

    Over the whole test (pytest-timeout's default: setup, call, teardown and the making of the
    reports), a limit that expires while pytest formats a failure raises inside pytest itself: an
    INTERNALERROR that ends the run and leaves one "internal error" for every test after it. A loaded
    machine did that to a test that failed just before the limit (the sandbox stops a call at 0.9
    of it). Setup and teardown stay under the run's total limit (timeout_total).
    """
    return [f"--timeout={timeout_per_test}", "-o", "timeout_func_only=true"]


def _text(data):
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


def _read_junit(xml, result):
    for case in ElementTree.fromstring(xml).iter("testcase"):
        path = case.get("classname", "").replace(".", "/")
        test_id = f"{path}.py::{case.get('name')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            result.outcomes[test_id] = "failed"
            result.messages[test_id] = (problem.get("message") or "") + "\n" + (problem.text or "")
            result.summaries[test_id] = problem.get("message") or ""
        elif case.find("skipped") is not None:
            result.outcomes[test_id] = "skipped"
        else:
            result.outcomes[test_id] = "passed"
