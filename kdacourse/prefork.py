"""Many pytest runs, each in a process of its own, started from one process that imported their
dependencies once.

A run of an exercise's tests in a fresh `python -m pytest` spends about 3 s of CPU importing pytest,
NumPy and TileLang before its first test, more than a kernel exercise's tests then take. The kill
matrix makes one run per catalog bug (kdacourse.killmatrix), a hundred runs: a server process
(`python -m kdacourse.prefork WORKERS`) imports them once and forks a child per run, at most
WORKERS at a time. Each child is still a process of its own, as run_tests's are: a bug's module, its
state and its crash stay in it, and a run past its limit is killed with its process group.

This is for the course's own code (the solutions with a catalog bug): a student's code never runs
here. Its runs are `kdacourse.runner.run_tests`'s, the same arguments and the same RunResult.

The protocol, JSON lines: the client writes every run to the server's stdin ({"id", "arguments",
"workdir", "timeout_total"}) and closes it; the server answers each run as it ends ({"id",
"returncode", "timed_out"}) on stdout, and the run's output is in workdir/output.txt.
"""

import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from pathlib import Path

from kdacourse import REPO_ROOT
from kdacourse.runner import run_arguments, read_run, run_environment

OUTPUT_FILE = "output.txt"
POLL_SECONDS = 0.02


def run_many(runs, workers=2):
    """[RunResult] of `runs`, dicts of run_tests's keyword arguments (target, test_paths and any of
    timeout_per_test, timeout_total, extra_args, cpu_timeout_per_test, timeout_per_file), in order,
    with at most `workers` running at once."""
    with tempfile.TemporaryDirectory(prefix="course-prefork-") as root:
        jobs = []
        for index, run in enumerate(runs):
            options = dict(run)
            timeout_total = options.pop("timeout_total", 300)
            workdir = Path(root) / str(index)
            workdir.mkdir()
            jobs.append({"id": index, "arguments": run_arguments(workdir=workdir, **options),
                         "workdir": str(workdir), "timeout_total": timeout_total})
        server = subprocess.Popen([sys.executable, "-m", "kdacourse.prefork", str(workers)], cwd=REPO_ROOT,
                                  env=run_environment(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        server.stdin.write("".join(json.dumps(job) + "\n" for job in jobs))
        server.stdin.close()
        results = {}
        for line in server.stdout:
            ended = json.loads(line)
            workdir = Path(jobs[ended["id"]]["workdir"])
            output = (workdir / OUTPUT_FILE).read_text(errors="replace")
            if ended["timed_out"]:
                output += f"\n[stopped after {jobs[ended['id']]['timeout_total']} s]"
            results[ended["id"]] = read_run(workdir, ended["returncode"], ended["timed_out"], output)
        if server.wait() != 0 or len(results) != len(jobs):
            raise RuntimeError(f"kdacourse.prefork's server exited with {server.returncode} after "
                               f"{len(results)} of {len(jobs)} runs")
        return [results[index] for index in range(len(jobs))]


def serve(workers):
    """Read every run from stdin, then fork them, `workers` at a time; answer each as it ends."""
    import numpy  # noqa: F401  (the imports every child would otherwise make for itself)
    import pytest  # noqa: F401

    try:
        import tilelang.language  # noqa: F401
    except ImportError:  # a course without TileLang: its children fail as fresh processes would
        pass
    # what the server holds now (TileLang's, torch's and NumPy's objects) out of the collector's sight:
    # pytest collects the garbage five times as each run ends, and walking these objects cost a child
    # 0.7 s of its 1.5 (gc.freeze keeps them in the children, which only skip them)
    gc.freeze()

    pending = deque(json.loads(line) for line in sys.stdin if line.strip())
    running = {}  # pid -> (job, deadline)
    while pending or running:
        while pending and len(running) < workers:
            job = pending.popleft()
            running[start(job)] = (job, time.monotonic() + job["timeout_total"])
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            job, _ = running.pop(pid)
            answer(job, os.waitstatus_to_exitcode(status), timed_out=False)
            continue
        for pid, (job, deadline) in list(running.items()):
            if time.monotonic() > deadline:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                running.pop(pid)
                answer(job, -1, timed_out=True)
        time.sleep(POLL_SECONDS)


def start(job):
    """Fork the child that runs `job`'s pytest in its own process group; its pid."""
    sys.stdout.flush()  # nothing of the server's answers may be written again by the child
    pid = os.fork()
    if pid:
        return pid
    code = 3
    try:
        os.setpgrp()
        output = os.open(Path(job["workdir"]) / OUTPUT_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(output, 1)
        os.dup2(output, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.chdir(REPO_ROOT)
        sys.dont_write_bytecode = True
        # the plugin (-p kdacourse.runner) is imported afresh, so that pytest can rewrite its asserts
        sys.modules.pop("kdacourse.runner", None)
        import pytest

        code = int(pytest.main(job["arguments"]))
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def answer(job, returncode, timed_out):
    print(json.dumps({"id": job["id"], "returncode": returncode, "timed_out": timed_out}), flush=True)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
