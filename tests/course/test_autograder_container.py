"""run_autograder in a container such as Gradescope's: no namespace can be made, so bubblewrap cannot
run, and the grader runs the student's code as a user of its own (kdacourse.sandbox's own-user
isolation).

The container is imitated by a seccomp filter with the refusals of Docker's default profile that
bwrap meets (moby's profiles/seccomp/default.json, for a container without CAP_SYS_ADMIN): EPERM for
unshare, setns, mount, umount2, pivot_root and a clone with any CLONE_NEW* flag, ENOSYS for clone3;
and CAP_SYS_ADMIN dropped from the bounding set. kdacourse/seccomp.py applies both and runs
run_autograder, as root, as Gradescope runs it.

The layout is tests/course/test_autograder.py's (source/, submission/, results/ under a root that
AUTOGRADER_ROOT names), for an assignment of stage 1 alone, in a folder that other users can reach:
the sandbox's user runs the grader's Python, as in Gradescope's image (apt's Python, the environment
in /autograder/source/.venv). So the environment is copied there as hard links and, where other users
cannot reach it (a pyenv under /root, say), the Python installation it was made from too.
"""

import errno
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from kdacourse import REPO_ROOT
from kdacourse.autograder import make_autograder, unpack_bundle
from kdacourse.catalog import exercises
from kdacourse.seccomp import Rule, SeccompUnavailable, architecture, program
from tests.course.test_autograder import _copy_venv, results_errors

STAGE = "s01_linear_attention"
ASSIGNMENT = [exercise for exercise in exercises() if exercise.stage == STAGE]
MAX_SCORE = sum(exercise.points for exercise in ASSIGNMENT)
CAP_SYS_ADMIN = 21
CLONE_NEW_FLAGS = 0x7E020000  # CLONE_NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET
DOCKER_RULES = [*(Rule(call, errno.EPERM) for call in ("unshare", "setns", "mount", "umount2", "pivot_root")),
                Rule("clone", errno.EPERM, any_bits=CLONE_NEW_FLAGS), Rule("clone3", errno.ENOSYS)]
SECCOMP_SCRIPT = REPO_ROOT / "kdacourse" / "seccomp.py"
# What a process under the filter finds: unshare, a clone into a new user namespace (flags | SIGCHLD, as
# a fork: were it allowed, its child would print a second line) and clone3 refused as Docker refuses
# them, and no CAP_SYS_ADMIN.
PROBE = """
import ctypes, json, sys
libc = ctypes.CDLL(None, use_errno=True)
facts = {{"unshare": libc.unshare(0x10000000) == -1 and ctypes.get_errno(),
          "clone": libc.syscall({clone}, 0x10000000 | 17, 0, 0, 0, 0) == -1 and ctypes.get_errno(),
          "clone3": libc.syscall(435, 0, 0) == -1 and ctypes.get_errno()}}
capabilities = next(line for line in open("/proc/self/status") if line.startswith("CapEff"))
facts["sys_admin"] = bool(int(capabilities.split()[1], 16) >> {sys_admin} & 1)
print(json.dumps(facts))
"""


def docker_like(command):
    """`command` run under the filter, as root without CAP_SYS_ADMIN."""
    return [sys.executable, "-I", "-S", str(SECCOMP_SCRIPT), program(DOCKER_RULES).hex(),
            "--drop-capability", str(CAP_SYS_ADMIN), "--", *map(str, command)]


def _clean_environment(**extra):
    """The test's environment without what would choose the grader's paths or isolation for it."""
    kept = {key: value for key, value in os.environ.items() if not key.startswith(("AUTOGRADER_", "PYTHON", "COURSE_"))}
    return {**kept, **extra}


@pytest.fixture(scope="module")
def filtered():
    """Skip where the filter cannot be applied; check, where it is, that it refuses what Docker refuses."""
    if os.geteuid() != 0:
        pytest.skip("the Gradescope autograder runs as root, and so must this imitation of it (it drops "
                    "CAP_SYS_ADMIN and makes the sandbox's users)")
    try:
        program(DOCKER_RULES)
    except SeccompUnavailable as error:
        pytest.skip(f"no Docker-like filter here: {error}")
    probe_source = PROBE.format(clone=architecture()[1]["clone"], sys_admin=CAP_SYS_ADMIN)
    probe = subprocess.run(docker_like([sys.executable, "-I", "-S", "-c", probe_source]), capture_output=True, text=True)
    if probe.returncode != 0 and "prctl" in probe.stderr:
        pytest.skip(f"the kernel refuses the seccomp filter here: {probe.stderr.strip()[-300:]}")
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout) == {"unshare": errno.EPERM, "clone": errno.EPERM, "clone3": errno.ENOSYS,
                                        "sys_admin": False}
    bwrap = shutil.which("bwrap")
    if bwrap:
        refused = subprocess.run(docker_like([bwrap, "--ro-bind", "/", "/", "true"]), capture_output=True, text=True)
        assert refused.returncode != 0 and "Operation not permitted" in refused.stderr, refused.stderr


def _reachable_by_others(path):
    """Whether a user of no group of the owner's could walk to `path` (every folder on the way o+x)."""
    path = Path(os.path.realpath(path))
    return all(os.stat(folder).st_mode & stat.S_IXOTH for folder in [path, *path.parents])


def _layout_folder(environment, base):
    """A folder that other users can reach, on the file system of the environment (and of the base
    Python where it is to be copied too), for copies made of hard links; None when there is none."""
    devices = {os.stat(environment).st_dev} | ({os.stat(base).st_dev} if base else set())
    for candidate in (REPO_ROOT / "build", Path("/var/tmp"), Path(tempfile.gettempdir())):
        candidate.mkdir(exist_ok=True)
        if {os.stat(candidate).st_dev} == devices and _reachable_by_others(candidate):
            return candidate
    return None


def _point_venv_at(venv, python_home):
    """The copied environment made from the Python installation copied at python_home: its pyvenv.cfg
    and its interpreter's link replaced (unlinked first: a hard link's content is the original's)."""
    interpreter = Path(os.path.realpath(sys.executable)).name
    config = (venv / "pyvenv.cfg").read_text()
    original = str(Path(os.path.realpath(sys.base_prefix)))
    (venv / "pyvenv.cfg").unlink()
    (venv / "pyvenv.cfg").write_text(config.replace(original, str(python_home)))
    for link in (venv / "bin").iterdir():
        if link.is_symlink() and os.path.realpath(link).startswith(original + os.sep):
            link.unlink()
            link.symlink_to(python_home / "bin" / interpreter)


@pytest.fixture(scope="module")
def container(filtered, tmp_path_factory):
    """run(fill_upload) -> (results.json, its output): as tests/course/test_autograder.py's gradescope
    fixture, with run_autograder under the Docker-like filter."""
    venv, base = Path(sys.prefix), Path(sys.base_prefix)
    assert venv != base, "run the tests from the course's virtual environment (make setup)"
    copy_base = not _reachable_by_others(os.path.dirname(os.path.realpath(sys.executable)))
    folder = _layout_folder(venv, base if copy_base else None)
    if folder is None:
        pytest.skip("no folder that other users can reach on the file system of the Python environment, "
                    "where a copy of it made of hard links would let the sandbox's user run it")
    out = tmp_path_factory.mktemp("bundle") / "out"
    assert make_autograder(out, [STAGE], timeout_per_test=60) == 0
    root = Path(tempfile.mkdtemp(prefix="gradescope-container-", dir=folder))
    root.chmod(0o755)  # as /autograder: the sandbox's user walks through it to the environment
    environment = _clean_environment(AUTOGRADER_ROOT=str(root))
    try:
        unpack_bundle(out / "autograder.zip", root / "source")
        shutil.copy2(root / "source" / "run_autograder", root / "run_autograder")
        _copy_venv(venv, root / "source" / ".venv", root / "source")
        if copy_base:
            subprocess.run(["cp", "-al", os.path.realpath(base), str(root / "python")], check=True)
            _point_venv_at(root / "source" / ".venv", root / "python")
            # the interpreter may name its library's folder by the original's path (a RUNPATH)
            environment["LD_LIBRARY_PATH"] = str(root / "python" / "lib")

        def run(fill_upload):
            for name in ("submission", "results"):
                shutil.rmtree(root / name, ignore_errors=True)
                (root / name).mkdir()
            fill_upload(root / "submission", root)
            completed = subprocess.run(docker_like([root / "run_autograder"]), cwd=root, capture_output=True,
                                       text=True, env=environment, timeout=600)
            output = completed.stdout + completed.stderr
            assert completed.returncode == 0, output[-4000:]
            results = json.loads((root / "results" / "results.json").read_text())
            assert results_errors(results, ASSIGNMENT) == [], json.dumps(results, indent=1)[:3000]
            return results, output

        run.root = root
        run.environment = environment
        yield run
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)  # faster than shutil.rmtree on 100,000 links


def _copy_stage(source, upload):
    shutil.copytree(source / STAGE, upload / STAGE)


def test_the_solutions_score_full_marks_as_a_user_of_their_own(container):
    results, output = container(lambda upload, root: _copy_stage(REPO_ROOT / "solutions", upload))
    assert results["score"] == MAX_SCORE, results["output"] + output[-3000:]
    assert results["extra_data"]["isolation"] == "own user"
    assert "a user of its own" in results["output"] and "network cut by seccomp" in results["output"]


THIEF = '''\
import subprocess
import sys


def recurrent(q, k, v):
    stolen = [subprocess.run(["cat", path], capture_output=True, text=True).stdout for path in {answers!r}]
    stolen.append(subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, {source!r}); "
                                  "import solutions.{stage}.recurrent as answer; print(answer.__file__)"],
                                 capture_output=True, text=True).stdout)
    for path in {targets!r}:
        subprocess.run(["sh", "-c", f"echo pwned >> {{path}}"], stderr=subprocess.DEVNULL)
    raise RuntimeError(f"stole {{sum(map(len, stolen))}} characters")
'''


def _digests(paths):
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None for path in paths}


def test_a_thief_and_the_shipped_exercises_score_zero_and_write_nothing_the_grader_reads(container):
    """recurrent.py reads the solution and the tests, imports the solution, and writes into the tests, the
    grader's code, the results and beside the upload, past the static checks (a subprocess); the
    other files of the stage are the shipped exercises, in a zip."""
    source, root = container.root / "source", container.root
    answers = [source / "solutions" / STAGE / "recurrent.py", source / "tests" / "exercises" / STAGE / "test_recurrent.py"]
    grader_files = [answers[1], source / "kdacourse" / "grading.py", source / "kdacourse" / "autograder.py"]
    targets = [*grader_files, root / "results" / "results.json", root / "outside.txt", source / "stages" / "__init__.py"]
    before = _digests(grader_files)

    def upload_a_thief(upload, root):
        with zipfile.ZipFile(upload / "handin.zip", "w") as archive:
            for path in sorted((REPO_ROOT / "exercises" / STAGE).glob("*.py")):
                if path.name != "recurrent.py":
                    archive.write(path, path.relative_to(REPO_ROOT / "exercises"))
            archive.writestr(f"{STAGE}/recurrent.py", THIEF.format(answers=[str(p) for p in answers], stage=STAGE,
                                                                   source=str(source), targets=[str(p) for p in targets]))

    results, output = container(upload_a_thief)
    tests = {test["name"].split(":")[0]: test for test in results["tests"]}
    assert "stole 0 characters" in tests["s01.recurrent"]["output"], tests["s01.recurrent"]["output"]
    assert results["score"] == 0, output[-3000:]
    assert all(test["status"] == "failed" and test["output"].startswith("failed (") for test in results["tests"])
    assert _digests(grader_files) == before
    assert not (root / "outside.txt").exists()
    assert "pwned" not in (root / "results" / "results.json").read_text()


def test_a_grader_that_cannot_isolate_names_the_cause(filtered):
    """Under the filter, a grader that is not root has neither isolation: the message says that
    namespaces are forbidden here and that the other isolation needs root, not to install bubblewrap."""
    if not shutil.which("bwrap"):
        pytest.skip("bubblewrap is not installed here: the message would rightly say to install it")
    check = ("import kdacourse.sandbox as sandbox\n"
             "sandbox.running_as_root = lambda: False\n"
             "print(sandbox.sandbox_problem())\n")
    completed = subprocess.run(docker_like([sys.executable, "-c", check]), capture_output=True, text=True,
                               env=_clean_environment(PYTHONPATH=str(REPO_ROOT)), cwd=REPO_ROOT, timeout=120)
    assert completed.returncode == 0, completed.stderr
    message = completed.stdout
    assert "forbids new namespaces" in message and "Docker's default seccomp profile" in message, message
    assert "needs the grader to run as root" in message and "install bubblewrap" not in message, message
