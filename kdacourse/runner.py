"""Running tests against a target in a separate process, with time limits.

Every run is a fresh `python -m pytest` subprocess: a student's file that crashes the interpreter,
loops forever or exits the process costs that run, never the caller. Results come back through a
JUnit XML file in a temporary folder, never through the target's folder, and through this module
loaded as a pytest plugin (`-p kdacourse.runner`), which writes beside it, one JSON line per test:

- each failure's message whole (the exception's text, as pytest's report holds it; JUnit's `message`
  attribute is cut to 500 characters, and the element's text is the whole traceback);
- each skipped test's reason;
- which test timed out (a call of the code under test stopped, pytest-timeout's limit, the CPU limit).
  Once a test of a file has timed out, the file's other tests fail at once without running: the code
  that looped would loop again, and each would cost the whole limit;
- each test's outcome and seconds as it ends, and the tests collected: a run stopped at its total limit
  (which writes no JUnit file) still tells which tests ended and which never did.

One run may hold several exercises' test files (grading in the sandbox runs a submission's exercises
in one pytest process: the student's code runs in sandboxed children, never in that process). Each
file then has a limit of its own (--course-file-limit): once its tests have run that long, its other
tests fail at once, as after a timeout, and the other files go on.
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kdacourse import REPO_ROOT

# A failure that is a time limit: the sandbox's (kdacourse.sandbox), pytest-timeout's, the CPU limit's
# (tests/conftest.py). A test stopped by one of them makes the rest of its file fail at once.
TIMEOUT_MESSAGE = re.compile(r"timed out: the call did not return within|Timeout \(>[0-9.]+s\) from pytest-timeout"
                             r"|s of CPU time and was stopped|past the time limit of its file")


@dataclass
class RunResult:
    """outcomes: test id -> "passed" | "failed" | "skipped"; messages: test id -> failure text (the
    traceback); summaries: test id -> the failure's message alone, whole; skip_reasons: test id -> why
    it was skipped; timeouts: the tests stopped by a time limit, in order; timed_out: the whole run was
    stopped (the limit per exercise) before these tests ended; seconds: test id -> its setup, call and
    teardown; collected: the test ids pytest collected."""

    outcomes: dict = field(default_factory=dict)
    messages: dict = field(default_factory=dict)
    summaries: dict = field(default_factory=dict)
    skip_reasons: dict = field(default_factory=dict)
    timeouts: list = field(default_factory=list)
    returncode: int = 0
    timed_out: bool = False
    output: str = ""
    junit_xml: str = ""
    seconds: dict = field(default_factory=dict)
    collected: list = field(default_factory=list)

    def failed(self):
        return [test for test, outcome in self.outcomes.items() if outcome == "failed"]

    def all_passed(self):
        return bool(self.outcomes) and not self.timed_out and all(o != "failed" for o in self.outcomes.values())

    def of_file(self, test_path):
        """The part of this run that is the tests of `test_path` (relative to the repository), as if
        that file had run alone: its outcomes, messages and timeouts; timed out when the run was
        stopped before each of its collected tests ended; the exit code pytest would have given."""
        prefix = f"{Path(test_path).as_posix()}::"

        def mine(table):
            return {test: value for test, value in table.items() if test.startswith(prefix)}

        outcomes = mine(self.outcomes)
        collected = [test for test in self.collected if test.startswith(prefix)]
        unfinished = self.timed_out and any(test not in outcomes for test in collected or [prefix])
        if self.returncode in (0, 1):  # 1: a test failed, maybe another file's
            returncode = 1 if "failed" in outcomes.values() else 0 if outcomes else 5
        else:
            returncode = self.returncode  # the run as a whole went wrong: so did each file's part
        return RunResult(outcomes=outcomes, messages=mine(self.messages), summaries=mine(self.summaries),
                         skip_reasons=mine(self.skip_reasons),
                         timeouts=[test for test in self.timeouts if test.startswith(prefix)],
                         returncode=returncode, timed_out=unfinished, output=self.output,
                         junit_xml=_junit_of_file(self.junit_xml, prefix), seconds=mine(self.seconds),
                         collected=collected)


def run_tests(target, test_paths, timeout_per_test=30, timeout_total=300, extra_args=(), cpu_timeout_per_test=0,
              timeout_per_file=0):
    """Run pytest on `test_paths` (relative to the repository) with --target=`target`.

    timeout_per_test is wall-clock (pytest-timeout, the test function only: timeout_options);
    cpu_timeout_per_test, if not 0, limits the CPU time of each test (tests/conftest.py), which load
    on the machine does not stretch; timeout_per_file, if not 0, the wall-clock time of each test
    file's tests together (the plugin's --course-file-limit).
    """
    with tempfile.TemporaryDirectory(prefix="course-run-") as workdir:
        arguments = run_arguments(target, test_paths, workdir, timeout_per_test, extra_args, cpu_timeout_per_test,
                                     timeout_per_file)
        try:
            completed = subprocess.run([sys.executable, "-m", "pytest", *arguments], cwd=REPO_ROOT,
                                       capture_output=True, text=True, timeout=timeout_total, env=run_environment(),
                                       stdin=subprocess.DEVNULL)
            returncode, output, timed_out = completed.returncode, completed.stdout + completed.stderr, False
        except subprocess.TimeoutExpired as expired:
            returncode, timed_out = -1, True
            output = _text(expired.stdout) + _text(expired.stderr) + f"\n[stopped after {timeout_total} s]"
        return read_run(workdir, returncode, timed_out, output)


def run_arguments(target, test_paths, workdir, timeout_per_test=30, extra_args=(), cpu_timeout_per_test=0,
                     timeout_per_file=0):
    """The arguments of `pytest` for one run (see run_tests), its JUnit file and the plugin's lines
    written into `workdir`, where read_run reads them."""
    return [
        *map(str, test_paths),
        f"--target={target}", *timeout_options(timeout_per_test), f"--cpu-timeout={cpu_timeout_per_test}",
        f"--junitxml={Path(workdir) / JUNIT_FILE}", "-p", "kdacourse.runner",
        f"--course-results={Path(workdir) / RESULTS_FILE}", f"--course-file-limit={timeout_per_file}",
        "-p", "no:cacheprovider", "-q", "--no-header", "-rN", *extra_args,
    ]


JUNIT_FILE, RESULTS_FILE = "junit.xml", "results.jsonl"


def run_environment():
    """A run's environment: the caller's, writing no bytecode into the repository."""
    return dict(os.environ, PYTHONDONTWRITEBYTECODE="1")


def read_run(workdir, returncode, timed_out, output):
    """The RunResult of a run whose files run_arguments put in `workdir`."""
    junit, lines = Path(workdir) / JUNIT_FILE, Path(workdir) / RESULTS_FILE
    xml = junit.read_text() if junit.exists() else ""
    result = RunResult(returncode=returncode, timed_out=timed_out, output=output, junit_xml=xml)
    if xml:
        _read_junit(xml, result)
    if lines.exists():
        _read_results(lines.read_text(), result)
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


def _test_id(case):
    """A JUnit testcase's pytest id: 'tests/x/test_y.py::test_z[1]'."""
    return f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"


def _junit_of_file(xml, prefix):
    """A JUnit document of the testcases of `xml` whose test ids start with `prefix` ("" when none)."""
    if not xml:
        return ""
    suite = ElementTree.Element("testsuite")
    suite.extend(case for case in ElementTree.fromstring(xml).iter("testcase") if _test_id(case).startswith(prefix))
    return ElementTree.tostring(suite, encoding="unicode")


def _read_junit(xml, result):
    for case in ElementTree.fromstring(xml).iter("testcase"):
        test_id = _test_id(case)
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


def _read_results(text, result):
    """The plugin's lines into `result`: whole messages, skip reasons, timeouts (the last line of a test
    wins), seconds, the tests collected, and the outcome of each test that ended, where JUnit's file
    (written only when the run ends) has none."""
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a run stopped while writing it
        if "collected" in entry:
            result.collected = [str(test) for test in entry["collected"]]
            continue
        test_id = entry.get("test")
        if "message" in entry:
            result.summaries[test_id] = entry["message"]
        if "skipped" in entry:
            result.skip_reasons[test_id] = entry["skipped"]
        if entry.get("timed_out") and test_id not in result.timeouts:
            result.timeouts.append(test_id)
        if "outcome" in entry:
            result.seconds[test_id] = entry["seconds"]
            result.outcomes.setdefault(test_id, entry["outcome"])


# ------------------------------------------------------------------------- the plugin (-p kdacourse.runner)


def pytest_addoption(parser):
    parser.addoption("--course-results", default=None,
                     help="kdacourse.runner: write each test's whole failure message, skip reason and timeout here")
    parser.addoption("--course-file-limit", type=float, default=0,
                     help="kdacourse.runner: seconds a test file's tests may take together (0: no limit)")


_PLUGIN = {}  # the run's config, for the report hook (a report does not carry it)


def pytest_configure(config):
    # timed_out: test file -> its first test that timed out; started: test file -> when its first test
    # began; tests: test id -> [outcome so far, seconds so far]
    _PLUGIN.update(config=config, timed_out={}, started={}, tests={})


def _test_file(nodeid):
    return nodeid.split("::", 1)[0]


def _write(entry):
    path = _PLUGIN["config"].getoption("--course-results")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")


def pytest_collection_finish(session):
    _write({"collected": [item.nodeid for item in session.items]})


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """A test whose file has had a test time out, or whose file's tests have run past their limit
    together, fails at once (the loop would cost the limit again)."""
    test_file = _test_file(item.nodeid)
    earlier = _PLUGIN["timed_out"].get(test_file)
    if earlier is not None:
        pytest.fail(f"not run: {earlier} timed out before it (its time limit stopped the code under test), "
                    "so the exercise's other tests fail at once", pytrace=False)
    limit = _PLUGIN["config"].getoption("--course-file-limit")
    started = _PLUGIN["started"].setdefault(test_file, time.monotonic())
    if limit and time.monotonic() - started > limit:
        pytest.fail(f"not run: the exercise's tests ran past the time limit of its file ({limit:g} s all "
                    "together; an endless loop, or calls each just under their limit?)", pytrace=False)


def pytest_runtest_logreport(report):
    outcome = _PLUGIN["tests"].setdefault(report.nodeid, [None, 0.0])
    outcome[1] += report.duration
    if report.failed:
        outcome[0] = "failed"
        entry = {"test": report.nodeid, "message": _whole_message(report)}
        if TIMEOUT_MESSAGE.search(entry["message"]):
            entry["timed_out"] = True
            _PLUGIN["timed_out"].setdefault(_test_file(report.nodeid), report.nodeid.split("::", 1)[-1])
        _write(entry)
    elif report.skipped:
        outcome[0] = outcome[0] or "skipped"
        if isinstance(report.longrepr, tuple):
            _write({"test": report.nodeid, "skipped": report.longrepr[2].removeprefix("Skipped: ")})
    elif report.when == "call":
        outcome[0] = outcome[0] or "passed"
    if report.when == "teardown":
        _write({"test": report.nodeid, "outcome": outcome[0] or "passed", "seconds": round(outcome[1], 3)})


def _whole_message(report):
    """The failure's message whole: the exception as pytest's report holds it (its crash entry), or
    the report's text where it has none (a pytest.fail without traceback, a collection error)."""
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr)
    if report.when != "call":
        message = f"failed on {report.when} with {message}"
    return message
