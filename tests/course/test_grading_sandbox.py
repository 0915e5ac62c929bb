"""Untrusted grading: every attack of issue 13 and more, each shown contained.

Most attacks run a submission's function through kdacourse.remote (what the exercise tests call
under --sandbox) and check afterwards that nothing outside the child's scratch changed: the course's
solutions/ and tests/exercises/, the submission, a folder beside it, another student's folder. One
`course grade` of a whole stage shows the report side: an atexit handler that rewrites reports,
monkeypatched checks, an imported answer scoring zero with its line. The tests need bubblewrap;
without it they skip, except in CI (CI set), where a missing sandbox fails them.
"""

import hashlib
import io
import json
import os
import shutil
import struct
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kdacourse import REPO_ROOT
from kdacourse import sandbox as sandbox_module
from kdacourse.catalog import exercises, exercises_of_stage
from kdacourse.cheating import check_exercise
from kdacourse.remote import RemoteError, RemoteSession, SandboxCallFailed, TargetRefused
from kdacourse.sandbox import Limits, sandbox_problem
from kdacourse.sandbox_child import WireError, decode, encode
from kdacourse.shipped import split_region

STAGE = "s01_linear_attention"
WATCHED = [REPO_ROOT / "solutions", REPO_ROOT / "tests" / "exercises"]


@pytest.fixture(scope="module", autouse=True)
def needs_sandbox():
    problem = sandbox_problem()
    if problem and not os.environ.get("CI"):
        pytest.skip(f"no sandbox here: {problem}")
    assert problem is None, problem  # in CI the setup installs bubblewrap: a missing one is a broken setup


def _snapshot(*roots):
    """path -> content hash (or 'dir') for everything under roots, links unfollowed."""
    state = {}
    for root in roots:
        for path in sorted(Path(root).rglob("*")):
            if "__pycache__" in path.parts:
                continue
            if path.is_symlink():
                state[str(path)] = "link:" + os.readlink(path)
            elif path.is_file():
                state[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                state[str(path)] = "dir"
    return state


@pytest.fixture
def attack(tmp_path):
    """attack(body, **limits) -> the proxy of a submission file holding `body`; afterwards, checks
    that nothing outside the sandbox's scratch changed."""
    submission = tmp_path / "submission"
    (submission / STAGE).mkdir(parents=True)
    other = tmp_path / "other_student" / STAGE
    other.mkdir(parents=True)
    (other / "chunkwise.py").write_text("SECRET = 'another student's answer'\n")
    (tmp_path / "victim.txt").write_text("outside the submission\n")
    before = {}
    sessions = []

    def load(body, forbidden=(), **limits):
        (submission / STAGE / "chunkwise.py").write_text(textwrap.dedent(body))
        before.setdefault("state", _snapshot(tmp_path, *WATCHED))
        session = RemoteSession(submission, limits=Limits(**{"call_seconds": 60, **limits}),
                                forbidden={(STAGE, "chunkwise.py"): tuple(forbidden)})
        sessions.append(session)
        return session.module(STAGE, "chunkwise.py")

    load.tmp_path = tmp_path
    load.sessions = sessions
    yield load
    for session in sessions:
        session.close()
    assert _snapshot(tmp_path, *WATCHED) == before["state"], "something outside the sandbox's scratch changed"


def _processes_with(marker):
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def test_os_system_and_subprocess_change_nothing_outside(attack):
    victim = attack.tmp_path / "victim.txt"
    module = attack(f"""
        import os, subprocess
        def attack():
            codes = [os.system("rm -f {victim}; echo pwned >> {REPO_ROOT}/solutions/{STAGE}/chunkwise.py"),
                     subprocess.run(["/bin/sh", "-c", "rm -rf {attack.tmp_path}/other_student"]).returncode]
            return codes
    """)
    codes = module.attack()
    assert len(codes) == 2  # the commands ran, in the sandbox, where those paths do not exist


def test_deleting_and_writing_outside_the_submission_fails(attack):
    victim, submission = attack.tmp_path / "victim.txt", attack.tmp_path / "submission"
    module = attack(f"""
        import os
        TARGETS = ["{victim}", "{submission}/beside.txt", "{submission}/{STAGE}/beside.py",
                   "{REPO_ROOT}/solutions/{STAGE}/chunkwise.py",
                   "{REPO_ROOT}/tests/exercises/{STAGE}/test_chunkwise.py", "{REPO_ROOT}/stages/__init__.py",
                   "/course/stages/__init__.py", "/usr/lib/pwned", "/etc/pwned"]
        def attack():
            outcomes = {{}}
            for path in TARGETS:
                try:
                    with open(path, "a") as f:
                        f.write("pwned")
                    outcomes[path] = "written"
                except OSError as error:
                    outcomes[path] = type(error).__name__
            for path in TARGETS[:1]:
                try:
                    os.remove(path)
                    outcomes["rm " + path] = "removed"
                except OSError as error:
                    outcomes["rm " + path] = type(error).__name__
            return outcomes
    """)
    outcomes = module.attack()
    # the graded library is bound read-only; the course is not in the sandbox at all (a write to /tmp lands
    # in its tmpfs)
    assert outcomes["/course/stages/__init__.py"] in ("OSError", "PermissionError")
    assert outcomes[f"{REPO_ROOT}/stages/__init__.py"] in ("FileNotFoundError", "PermissionError")
    assert outcomes[f"{REPO_ROOT}/solutions/{STAGE}/chunkwise.py"] in ("FileNotFoundError", "PermissionError")
    assert outcomes["/usr/lib/pwned"] in ("OSError", "PermissionError")


def test_reads_of_another_student_the_course_and_the_host_fail(attack):
    other = attack.tmp_path / "other_student" / STAGE / "chunkwise.py"
    module = attack(f"""
        import os
        PATHS = ["{other}", "{REPO_ROOT}/solutions/{STAGE}/chunkwise.py", "{REPO_ROOT}/kdacourse/grading.py",
                 "{REPO_ROOT}/tests/exercises/{STAGE}/test_chunkwise.py", "/etc/shadow", "/root/.bash_history",
                 "{REPO_ROOT}/.git/config"]
        def attack():
            readable = {{}}
            for path in PATHS:
                try:
                    readable[path] = bool(os.listdir(path)) if os.path.isdir(path) else bool(open(path).read())
                except OSError as error:
                    readable[path] = type(error).__name__
            import importlib.util
            readable["solutions"] = importlib.util.find_spec("solutions") is not None
            readable["kdacourse"] = importlib.util.find_spec("kdacourse") is not None
            readable["course"] = sorted(os.listdir("{REPO_ROOT}")) if os.path.isdir("{REPO_ROOT}") else []
            return readable
    """)
    readable = module.attack()
    assert set(readable.pop("course")) <= {".venv"}  # nothing of the course (the venv, when inside it)
    assert all(value is not True for value in readable.values()), readable


def test_no_network_and_nobody(attack):
    module = attack("""
        import os, socket
        def attack():
            try:
                socket.create_connection(("1.1.1.1", 53), timeout=3)
                network = "connected"
            except OSError as error:
                network = type(error).__name__
            return network, os.getuid(), os.getgid(), os.geteuid(), len(os.listdir("/proc"))
    """)
    network, uid, gid, euid, proc_entries = module.attack()
    assert network != "connected"
    if os.geteuid() == 0:
        assert (uid, gid, euid) == (65534, 65534, 65534)


def test_a_process_in_a_new_session_does_not_outlive_grading(attack):
    marker = f"outlive-{os.getpid()}-{time.monotonic_ns()}"
    module = attack(f"""
        import subprocess, sys, os
        def attack():
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # {marker}"],
                             start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            if os.fork() == 0:  # a double fork as well, the daemon way
                os.setsid()
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)  # {marker}"])
            return 1
    """)
    assert module.attack() == 1
    deadline = time.monotonic() + 20
    while len(_processes_with(marker)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_processes_with(marker)) == 2  # they did start
    for session in attack.sessions:
        session.close()
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == []


def test_a_hang_an_exit_and_an_exception_fail_that_call_only(attack):
    module = attack("""
        import os, sys, time
        def hang():
            while True:
                time.sleep(1)
        def leave():
            os._exit(0)
        def leave_politely():
            sys.exit(0)
        def fine(x):
            return x * 2
    """, call_seconds=3)
    started = time.monotonic()
    with pytest.raises(SandboxCallFailed, match="did not return within"):
        module.hang()
    assert time.monotonic() - started < 20
    assert module.fine(np.arange(3.0)).tolist() == [0.0, 2.0, 4.0]  # a fresh child
    with pytest.raises(SandboxCallFailed, match="exit code 0 before replying"):
        module.leave()
    with pytest.raises(RemoteError, match="SystemExit|0"):
        module.leave_politely()
    assert module.fine(2) == 4


def test_fork_bomb_is_bounded(attack):
    marker = f"bomb-{os.getpid()}-{time.monotonic_ns()}"
    module = attack(f"""
        import os
        # {marker}
        def attack():
            children = 0
            try:
                while True:
                    if os.fork() == 0:
                        import time
                        time.sleep(600)
                        os._exit(0)
                    children += 1
            except OSError as error:
                return children, type(error).__name__
    """, processes=64, call_seconds=20)
    result = module.attack()
    children, error = result
    assert children < 64 and error == "BlockingIOError"  # fork failed: EAGAIN, RLIMIT_NPROC
    for session in attack.sessions:
        session.close()


def test_huge_output_and_memory_fail_the_call_only(attack):
    module = attack("""
        import sys, numpy as np
        def flood():
            for _ in range(2000):
                print("x" * 100000)
            sys.stderr.write("y" * 10**7)
            return 7
        def huge():
            return np.zeros((4, 1 << 20))
        def memory():
            return np.ones(10**10).sum()  # 80 GB
        def huge_file():
            with open("/tmp/big", "wb") as f:
                f.write(b"z" * (256 << 20))
    """, reply_bytes=8 << 20, file_size=16 << 20)
    assert module.flood() == 7  # 200 MB of prints, read and dropped: the parent keeps 16 KiB
    with pytest.raises(SandboxCallFailed, match="more than"):
        module.huge()  # 32 MB > the 8 MB allowed a reply
    with pytest.raises(MemoryError):
        module.memory()  # RLIMIT_AS
    with pytest.raises(RemoteError):
        module.huge_file()  # RLIMIT_FSIZE: SIGXFSZ kills it, or the write fails


def test_monkeypatching_numpy_in_the_child_cannot_touch_the_checks(tmp_path):
    """The checks run in the parent: numpy, assert_close and the oracles patched in the child change
    nothing there, and the wrong answer fails."""
    submission = tmp_path / "submission" / STAGE
    submission.mkdir(parents=True)
    (submission / "chunkwise.py").write_text(textwrap.dedent("""
        import numpy as np
        import stages.common.compare as compare
        np.allclose = lambda *args, **kwargs: True
        np.testing.assert_allclose = lambda *args, **kwargs: None
        compare.assert_close = lambda *args, **kwargs: None
        np.linalg.norm = lambda *args, **kwargs: 0.0
        def chunkwise(q, k, v, chunk_size):
            if chunk_size < 1:
                raise ValueError("chunk_size")
            return np.zeros(q.shape[:3] + (v.shape[-1],))
    """))
    import subprocess
    import sys

    completed = subprocess.run([sys.executable, "-m", "pytest", f"tests/exercises/{STAGE}/test_chunkwise.py", "-q",
                                "-p", "no:cacheprovider", f"--target={tmp_path / 'submission'}", "--sandbox"],
                               cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert "8 failed, 1 passed" in completed.stdout, completed.stdout[-2000:]


def test_forbidden_call_raises_in_the_child_and_shows_statically(attack):
    module = attack("""
        import numpy as np
        def attack(L):
            solver = getattr(np.linalg, "in" + "v")
            return solver(np.eye(len(L)) + L)
    """, forbidden=["np.linalg.inv"])
    with pytest.raises(RemoteError, match="forbidden"):
        module.attack(np.zeros((4, 4)))


def test_a_symlinked_file_is_refused(tmp_path):
    stage = tmp_path / "submission" / STAGE
    stage.mkdir(parents=True)
    (stage / "chunkwise.py").symlink_to(REPO_ROOT / "solutions" / STAGE / "chunkwise.py")
    session = RemoteSession(tmp_path / "submission")
    with pytest.raises(TargetRefused, match="symbolic link"):
        session.module(STAGE, "chunkwise.py")
    session.close()


CHEATS = {
    "from stages.s01_linear_attention.reference import chunkwise as answer\n": "imports stages.s01_linear_attention.reference.chunkwise",
    "from solutions.s01_linear_attention.chunkwise import chunkwise as answer\n": "imports solutions",
    "import kdacourse.targets\n": "imports kdacourse",
    "from stages.common.oracles import causal_linear_attention\n": "oracles",
    "exec(open('/work/main/solutions/s01_linear_attention/chunkwise.py').read())\n": "uses exec",
    "import importlib\nanswer = importlib.import_module('stages.s01_linear_attention.reference')\n": "imports importlib",
    "from . import helper\n": "relative import",
    "TEXT = __import__('pathlib').Path('x').read_text()\n": "reads a file",
}


@pytest.mark.parametrize("cheat", list(CHEATS))
def test_cheating_shows_with_its_line(tmp_path, cheat):
    exercise = next(e for e in exercises() if e.id == "s01.chunkwise")
    stage = tmp_path / STAGE
    stage.mkdir()
    solution = (REPO_ROOT / "solutions" / STAGE / "chunkwise.py").read_text()
    (stage / "chunkwise.py").write_text(solution + "\n" + cheat)
    findings = check_exercise(str(tmp_path), exercise)
    assert any(CHEATS[cheat] in finding.reason for finding in findings), findings
    assert min(finding.line for finding in findings) == len((solution + "\n").splitlines()) + 1


def test_forbidden_names_show_however_imported(tmp_path):
    exercise = next(e for e in exercises() if e.id == "s05.block_inverse")
    assert "np.linalg.inv" in exercise.forbidden
    stage = tmp_path / exercise.stage
    stage.mkdir()
    solution = (REPO_ROOT / "solutions" / exercise.stage / exercise.file).read_text()
    for cheat in ("T = np.linalg.inv(A)", "import numpy as xp\nT = xp.linalg.inv(A)",
                  "from numpy.linalg import solve as s", "from numpy import linalg\nT = linalg.pinv(A)",
                  "T = getattr(np.linalg, 'inv')(A)"):
        (stage / exercise.file).write_text(solution + "\n" + cheat + "\n")
        assert any("forbids" in finding.reason for finding in check_exercise(str(tmp_path), exercise)), cheat


def test_a_symlink_anywhere_in_the_stage_shows(tmp_path):
    exercise = next(e for e in exercises() if e.id == "s01.chunkwise")
    shutil.copytree(REPO_ROOT / "solutions" / STAGE, tmp_path / STAGE)
    (tmp_path / STAGE / "helper.py").symlink_to(REPO_ROOT / "solutions" / STAGE / "recurrent.py")
    assert "symbolic link" in check_exercise(str(tmp_path), exercise)[0].reason


def test_the_shipped_exercises_and_solutions_show_no_cheating():
    for folder in ("exercises", "solutions"):
        for exercise in exercises():
            assert check_exercise(str(REPO_ROOT / folder), exercise) == [], (folder, exercise.id)


def test_the_wire_refuses_pickles_and_objects():
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    blob = buffer.getvalue()
    sizes, header = json.dumps([len(blob)]).encode(), json.dumps({"$array": 0}).encode()
    body = struct.pack(">I", len(sizes)) + sizes + struct.pack(">I", len(header)) + header + blob
    with pytest.raises(WireError):
        decode(body)
    with pytest.raises(WireError):
        encode(np.array([object()]))
    value = {"a": (np.arange(3.0), 2, "x", [np.float32(1.5)]), "dtype": np.float16}
    decoded = decode(encode(value)[8:])
    assert decoded["a"][0].tolist() == [0.0, 1.0, 2.0] and decoded["a"][1:3] == (2, "x")
    assert decoded["dtype"] is np.float16


def test_the_wire_carries_library_named_tuples_and_functions_by_name_only():
    from kdacourse.sandbox_child import library_record_class
    from stages.common import oracles
    from stages.s06_backward.reference import Gradients

    gradients = Gradients(*(np.full(2, float(i)) for i in range(8)))
    decoded = decode(encode(gradients)[8:], record_class=library_record_class)
    assert type(decoded) is Gradients and decoded.dbeta.tolist() == [4.0, 4.0]
    assert decode(encode([oracles.kda_delta_rule_from_state])[8:]) == [oracles.kda_delta_rule_from_state]

    def not_the_library(x):
        return x

    for value in (not_the_library, lambda x: x, print, np.add):
        with pytest.raises(WireError):
            encode(value)
    for name in ("os:system", "stages.common.oracles:np", "stages.common.oracles:nowhere"):
        sizes, header = json.dumps([]).encode(), json.dumps({"$function": name}).encode()
        with pytest.raises(WireError):
            decode(struct.pack(">I", len(sizes)) + sizes + struct.pack(">I", len(header)) + header)


def test_arrays_updated_in_the_sandbox_are_updated_in_the_caller():
    from kdacourse.remote import SandboxCallFailed, _copy_back

    pool, untouched = np.zeros((3, 2)), np.ones(4)
    _copy_back([pool, untouched], [np.arange(6.0).reshape(3, 2), np.ones(4)])
    assert pool.tolist() == [[0, 1], [2, 3], [4, 5]] and untouched.tolist() == [1, 1, 1, 1]
    for reply in ([np.zeros((3, 2))], [np.zeros((2, 3)), np.ones(4)], [np.zeros((3, 2), np.float32), np.ones(4)]):
        with pytest.raises(SandboxCallFailed):
            _copy_back([pool, untouched], reply)


def _forget_the_sandbox():
    for check in (sandbox_module.sandbox_problem, sandbox_module._bubblewrap_problem, sandbox_module._own_user_problem):
        check.cache_clear()


@pytest.mark.parametrize("command", ["grade", "grade-all"])
def test_grading_refuses_without_a_sandbox_and_names_trust(tmp_path, monkeypatch, capsys, command):
    from kdacourse.gradeall import grade_all
    from kdacourse.grading import grade

    shutil.copytree(REPO_ROOT / "exercises" / STAGE, tmp_path / "class" / "alice" / STAGE)
    monkeypatch.setattr(sandbox_module, "bwrap_path", lambda: None)
    monkeypatch.setattr(sandbox_module, "running_as_root", lambda: False)  # no own-user isolation either
    monkeypatch.delenv(sandbox_module.ISOLATION_VARIABLE, raising=False)
    _forget_the_sandbox()
    try:
        if command == "grade":
            assert grade(tmp_path / "class" / "alice", tmp_path / "out") == 2
        else:
            assert grade_all(tmp_path / "class", tmp_path / "out") == 2
    finally:
        _forget_the_sandbox()
    error = capsys.readouterr().err
    assert "bubblewrap" in error and "--trust" in error and "apt-get install" in error
    assert "needs the grader to run as root" in error
    assert not (tmp_path / "out").exists()


def test_grade_of_an_attacking_stage(tmp_path, capsys):
    """One stage graded in the sandbox: chunkwise's atexit handler rewrites every report it can find
    and leaves with os._exit(0) (failed, the reports untouched); kernel_mirror imports the answer
    (zero, with its line); recurrent patches numpy's and the course's checks and returns zeros
    (failed); kernel_program is the solution (passed, through the sandbox's interpreter)."""
    from kdacourse.grading import grade

    submission = tmp_path / "submission" / STAGE
    shutil.copytree(REPO_ROOT / "solutions" / STAGE, submission)
    source = (submission / "chunkwise.py").read_text()
    before, region, after = split_region(source)
    indent = region[: len(region) - len(region.lstrip())]
    attack = textwrap.dedent("""\
        import atexit, glob, io, os, sys
        def rewrite():  # io.FileIO: past the static checks, to show the sandbox
            for path in sys.argv + glob.glob("/tmp/**/*.xml", recursive=True) + glob.glob("/**/report.json", recursive=True):
                try:
                    io.FileIO(path, "w").write(b'<testsuites><testsuite tests="99"/></testsuites>')
                except OSError:
                    pass
        atexit.register(rewrite)
        os._exit(0)
    """)
    (submission / "chunkwise.py").write_text(before + "".join(indent + line + "\n" for line in attack.splitlines()) + after)
    kernel_mirror = (submission / "kernel_mirror.py").read_text()
    (submission / "kernel_mirror.py").write_text(
        "from stages.s01_linear_attention.reference import kernel_mirror as _answer\n" + kernel_mirror)
    recurrent = (submission / "recurrent.py").read_text()
    (submission / "recurrent.py").write_text(recurrent + textwrap.dedent("""
        import stages.common.compare as _compare
        np.allclose = lambda *a, **k: True
        _compare.assert_close = lambda *a, **k: None
        def recurrent(q, k, v):
            return np.zeros(q.shape[:3] + (v.shape[-1],))
    """))
    watched = _snapshot(tmp_path / "submission", *WATCHED)
    started = time.monotonic()
    assert grade(tmp_path / "submission", tmp_path / "out") == 0
    seconds = time.monotonic() - started
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    entries = {entry["id"]: entry for entry in report["exercises"]}
    assert report["sandbox"] is True
    assert not entries["s01.chunkwise"]["passed"] and "ended with exit code 0" in " ".join(entries["s01.chunkwise"]["failures"])
    assert entries["s01.kernel_mirror"]["points"] == 0
    assert entries["s01.kernel_mirror"]["cheating"] == [
        f"{submission / 'kernel_mirror.py'}:1: imports stages.s01_linear_attention.reference.kernel_mirror, which "
        "the exercise does not import as shipped: a stage's own library holds the answers (stages.common's "
        "helpers are fine)"]
    assert "kernel_mirror.py:1" in (tmp_path / "out" / "report.md").read_text()
    assert not entries["s01.recurrent"]["passed"]
    assert entries["s01.kernel_program"]["passed"], entries["s01.kernel_program"]["failures"]
    assert 'tests="99"' not in (tmp_path / "out" / "junit.xml").read_text()
    assert _snapshot(tmp_path / "submission", *WATCHED) == watched
    print(f"graded one attacking stage in {seconds:.1f} s")


def test_gradebook_counts_what_was_graded_and_names_the_cheating(tmp_path):
    """One column per exercise graded, its max their points (not the course's), and a cheating column."""
    import csv

    from kdacourse.cheating import Finding
    from kdacourse.gradeall import write_gradebook
    from kdacourse.grading import ExerciseResult
    from kdacourse.runner import RunResult

    graded = [exercise for exercise in exercises() if exercise.stage == STAGE]
    first, second = graded[:2]
    passed = ExerciseResult(first, RunResult(outcomes={"t.py::test_a": "passed"}), 1.0, 10)
    cheated = ExerciseResult(second, RunResult(), 0.0, 10, (Finding(f"/class/bob/{STAGE}/{second.file}", 3, "uses open"),))
    write_gradebook(tmp_path / "gradebook.csv", graded, {"bob": {first.id: passed, second.id: cheated}, "=cmd": {}})
    rows = list(csv.reader((tmp_path / "gradebook.csv").open()))
    assert rows[0] == ["student", *[exercise.id for exercise in graded], "total", "max", "cheating"]
    assert [row[0] for row in rows[1:]] == ["'=cmd", "bob"]  # a formula is not left to a spreadsheet
    bob = dict(zip(rows[0], rows[2]))
    assert bob[first.id] == str(first.points) and bob[second.id] == "0" and bob["total"] == str(first.points)
    stage_points = sum(exercise.points for exercise in exercises_of_stage(STAGE))
    assert bob["max"] == str(stage_points) and stage_points < sum(exercise.points for exercise in exercises())
    assert bob["cheating"] == f"{second.id}: {second.file}:3: uses open"
    assert dict(zip(rows[0], rows[1]))["cheating"] == ""


def test_a_hard_link_is_refused_and_shows(tmp_path):
    exercise = next(e for e in exercises() if e.id == "s01.chunkwise")
    outside = tmp_path / "graders_file.py"
    outside.write_text("SECRET = 1\n")
    (tmp_path / "submission" / STAGE).mkdir(parents=True)
    os.link(outside, tmp_path / "submission" / STAGE / "chunkwise.py")
    session = RemoteSession(tmp_path / "submission")
    with pytest.raises(TargetRefused, match="hard links"):
        session.module(STAGE, "chunkwise.py")
    session.close()
    assert "hard links" in check_exercise(str(tmp_path / "submission"), exercise)[0].reason


def test_the_sandbox_dies_with_a_killed_grader(tmp_path):
    """The grader's process killed outright (as the limit per exercise does to its pytest): the
    launcher's parent-death signal takes bwrap, and bwrap the sandbox's whole PID namespace."""
    import subprocess
    import sys

    marker = f"orphan-{os.getpid()}-{time.monotonic_ns()}"
    (tmp_path / "submission" / STAGE).mkdir(parents=True)
    (tmp_path / "submission" / STAGE / "chunkwise.py").write_text(textwrap.dedent(f"""
        import subprocess, sys
        def attack():
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # {marker}"], start_new_session=True)
            return 1
    """))
    grader = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from kdacourse.remote import RemoteSession
        module = RemoteSession({str(tmp_path / "submission")!r}).module({STAGE!r}, "chunkwise.py")
        print(module.attack(), flush=True)
        time.sleep(600)
    """)], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert grader.stdout.readline().strip() == "1"
        deadline = time.monotonic() + 20
        while not _processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _processes_with(marker)
    finally:
        grader.kill()
        grader.wait()
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _processes_with(marker) == []


def test_the_scratch_tmpfs_is_mounted_before_the_course_is_bound(monkeypatch):
    """bwrap applies mounts in order: a course under /tmp (a CI clone) bound before the scratch
    tmpfs at /tmp would be hidden by it, and every sandbox would fail its self-test (seen in CI)."""
    monkeypatch.setattr(sandbox_module, "bwrap_path", lambda: "/usr/bin/bwrap")
    argv = sandbox_module.bwrap_command("call", Limits())
    tmpfs = argv.index("--tmpfs")
    assert argv[tmpfs + 1] == "/tmp"
    binds = [i for i, arg in enumerate(argv) if arg == "--ro-bind"]
    assert binds and tmpfs < min(binds), "the tmpfs at /tmp must come before every --ro-bind"


def test_the_self_test_answers_a_request_made_after_the_child_is_ready():
    """The self-test's child reads the request before it replies: one that replied and ended first left
    the parent writing into a broken pipe when the parent was slow to write (CI under load reported
    "bwrap fails its self-test ... ended with exit code 0 before replying")."""
    child = sandbox_module.SandboxedProcess("selftest", Limits(call_seconds=sandbox_module.SELF_TEST_SECONDS))
    try:
        time.sleep(3)  # a parent descheduled between the start and the request
        facts = decode(child.request(encode({"op": "selftest"})))
    finally:
        child.kill()
    assert {"uid", "gid", "groups"} <= set(facts)
