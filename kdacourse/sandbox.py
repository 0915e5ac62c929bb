"""The sandbox that student code runs in when an instructor grades (bubblewrap, Linux).

A sandboxed process (SandboxedProcess) is kdacourse/sandbox_child.py run by bwrap with:
- no network and no other namespace shared (IPC, PID, UTS, cgroup): it sees only its own processes;
- a filesystem of its own: read-only binds of the system (/usr, /lib...), of Python and its
  packages, of the graded library at /course/stages and of the child script; nothing else of the
  course (no solutions/, tests/, kdacourse/, exercises/, no other submission); /tmp a private tmpfs
  (its only writable place, size-capped), where the submission's files are copied;
- the graded library (graded_library) is the course's stages/ as a student's handout has it: every
  function that is an exercise raises NotImplementedError (or runs the student's own, for one that
  other exercises call), and stages/common/oracles.py is left out. So no trick reaches an answer:
  the answers are not in the sandbox. It is the library of the course that grades (this kdacourse's
  REPO_ROOT), wherever that copy lies, installed or not; an installed copy of the course's packages
  in the environment is hidden under an empty tmpfs;
- when the grader is root: no user namespace, and the child drops to uid/gid 65534 (nobody) with
  no groups before anything else runs; otherwise an unprivileged user namespace;
- --cap-drop ALL (only setuid/setgid kept for that first step when root), no_new_privs,
  --new-session, --die-with-parent;
- resource limits set before bwrap starts, inherited by all of it: CPU time, address space,
  processes, file size, open files (Limits);
- a wall-clock limit per call, and the whole process killed at the end or on any failure: the
  launcher asks the kernel to kill bwrap when its parent dies (PR_SET_PDEATHSIG), bwrap kills the
  sandbox's PID namespace when it dies, so a process that started its own session dies too.

Where bwrap is missing or fails its self-test, `sandbox_problem()` says why and how to get it.
"""

import collections
import compileall
import hashlib
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path

from kdacourse import REPO_ROOT
from kdacourse.sandbox_child import LIBRARY_ROOT, SCRATCH_EXERCISES

NOBODY = 65534
CHILD_SCRIPT = Path(__file__).with_name("sandbox_child.py")
# The course's packages: an installed (not editable) copy of them in the environment is hidden.
COURSE_PACKAGES = ("stages", "kdacourse", "solutions", "tests", "exercises", "benchmarks")
# What the graded library is made from: a change to any of these makes a new one.
LIBRARY_SOURCES = ("stages", "solutions", "exercises", "kdacourse")
# "<course>:<library folder>", handed to the processes a grader starts (honoured for that course only)
LIBRARY_VARIABLE = "COURSE_GRADED_LIBRARY"
LIBRARY_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kdacourse" / "graded-library"
HOW_TO_GET = ("install bubblewrap (Debian/Ubuntu: `apt-get install -y bubblewrap`, which `make setup` does when "
              "run as root), or, on a machine where the code is trusted (a student's own), pass --trust")
SELF_TEST_SECONDS = 60


@dataclass(frozen=True)
class Limits:
    """What one sandboxed process may use. cpu_seconds, address_space, processes, file_size and
    open_files are rlimits (RLIMIT_CPU, _AS, _NPROC, _FSIZE, _NOFILE); processes counts the threads
    of every process of uid 65534 on the machine."""

    cpu_seconds: int = 300
    address_space: int = 4 * 2**30  # a kernel exercise (TileLang, the interpreter) runs in 2 GiB
    processes: int = 512
    file_size: int = 64 * 2**20
    open_files: int = 256
    scratch_bytes: int = 256 * 2**20  # the tmpfs at /tmp
    call_seconds: float = 60.0  # wall clock, per call
    reply_bytes: int = 64 * 2**20  # a longer reply fails the call
    stderr_bytes: int = 16 * 2**10  # what is kept of the child's output (the end of it)

    def rlimits(self):
        return {"RLIMIT_CPU": self.cpu_seconds, "RLIMIT_AS": self.address_space, "RLIMIT_NPROC": self.processes,
                "RLIMIT_FSIZE": self.file_size, "RLIMIT_NOFILE": self.open_files}


class SandboxUnavailable(Exception):
    """No sandbox here: untrusted grading refuses."""


class ChildFailed(Exception):
    """The sandboxed process timed out, ended, or sent more or other than a message."""


# The launcher runs as the grader, sets the limits, asks to be killed with its parent, then becomes bwrap.
_LAUNCHER = """
import ctypes, json, os, resource, signal, sys
for name, value in json.loads(sys.argv[1]).items():
    resource.setrlimit(getattr(resource, name), (value, value))
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[2]):
    os._exit(70)
os.execv(sys.argv[3], sys.argv[3:])
"""


def bwrap_path():
    return shutil.which("bwrap")


def _library_key():
    """A hash of everything the graded library is made from (the course's library, solutions,
    exercises and machinery): the name of its folder in the cache."""
    digest = hashlib.sha256()
    for top in LIBRARY_SOURCES:
        for path in sorted((REPO_ROOT / top).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".toml"):
                digest.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:24]


@cache
def graded_library():
    """The folder whose stages/ the sandbox holds at /course/stages: the course's library without the
    answers, built once per content of the course and kept in LIBRARY_CACHE (a grading run's many
    sandboxes, and later runs, find it there). Its delegates.json lists the exercise files [stage,
    file] whose functions the library runs for other exercises (the student's own, as in a handout)."""
    # the grading run's parent made it for this copy of the course: no hash again in each test process
    course, _, given = os.environ.get(LIBRARY_VARIABLE, "").partition(os.pathsep)
    folder = Path(given) if given and course == str(REPO_ROOT) else LIBRARY_CACHE / _library_key()
    if folder.is_dir():
        status = folder.stat()
        if status.st_uid != os.geteuid() or status.st_mode & 0o022:
            raise SandboxUnavailable(f"the graded library {folder} is not the grader's own: remove it")
        os.environ[LIBRARY_VARIABLE] = f"{REPO_ROOT}{os.pathsep}{folder}"  # for the processes this one starts
        return folder
    LIBRARY_CACHE.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix="building-", dir=LIBRARY_CACHE))
    try:
        _build_library(building)
        building.chmod(0o755)
        os.rename(building, folder)  # atomic: a folder under its final name is whole
    except OSError:
        if not folder.is_dir():
            raise
    finally:
        shutil.rmtree(building, ignore_errors=True)
    return graded_library.__wrapped__()  # the checks above, on the folder now built


def _build_library(folder):
    """stages/ into `folder` as the handout stubs it (kdacourse.handout.stub_library), less the oracles."""
    from kdacourse.handout import used_by_exercises, stub_library

    shutil.copytree(REPO_ROOT / "stages", folder / "stages", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    (folder / "stages" / "common" / "oracles.py").unlink()  # closed forms: the answer of a reference A
    stubbed = stub_library(folder)
    # compiled once here: the sandboxes read the bytecode (they may not write it) instead of each
    # compiling the library again at start
    compileall.compile_dir(folder / "stages", quiet=1)
    delegated = used_by_exercises()
    delegates = sorted({(exercise.stage, exercise.file) for key, exercise in stubbed.items() if key in delegated})
    (folder / "delegates.json").write_text(json.dumps(delegates))


def library_delegates():
    """[(stage, file)] of the exercise files whose functions the graded library runs for other exercises."""
    return [tuple(pair) for pair in json.loads((graded_library() / "delegates.json").read_text())]


def _installed_course_packages(prefixes):
    """The course's packages installed (copied, not linked) under the Python prefixes bound in the sandbox."""
    found = []
    for entry in sys.path:
        if entry and any(_under(os.path.realpath(entry), [os.path.realpath(p)]) for p in prefixes):
            found += [os.path.join(entry, name) for name in COURSE_PACKAGES if os.path.isdir(os.path.join(entry, name))]
    return found


def running_as_root():
    return os.geteuid() == 0


def bwrap_command(mode, limits, preload_tilelang=False):
    """The argv that starts sandbox_child.py in `mode` inside bwrap, behind the launcher."""
    bwrap = bwrap_path()
    if bwrap is None:
        raise SandboxUnavailable(f"bwrap (bubblewrap) is not installed: {HOW_TO_GET}")
    root = running_as_root()
    args = [bwrap, "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    if root:  # no user namespace: the child drops to nobody itself, first thing
        args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                 "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-all"]
    # the scratch tmpfs first: bwrap applies its mounts in order, so a course that lives under /tmp
    # (a CI clone, say) is bound on top of it below instead of being hidden by it
    args += ["--size", str(limits.scratch_bytes), "--perms", "01777", "--tmpfs", "/tmp"]
    bound, made = [], set()

    def make_parents(path):
        for parent in reversed(Path(path).parents):
            text = str(parent)
            if text != "/" and text not in made and not _under(text, bound):
                args.extend(["--perms", "0755", "--dir", text])
                made.add(text)

    def bind(path, dest=None):
        path = str(path)
        dest = str(dest or path)
        if _under(dest, bound) or not os.path.exists(path):
            return
        make_parents(dest)
        args.extend(["--ro-bind", path, dest])
        bound.append(dest)

    for top in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args.extend(["--symlink", os.readlink(top), top])
        elif os.path.isdir(top):
            bind(top)
    for path in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime"):
        bind(path)
    prefixes = sorted({sys.base_prefix, sys.prefix, os.path.dirname(os.path.dirname(sys.executable))})
    for prefix in prefixes:
        bind(os.path.realpath(prefix), prefix)
        bind(prefix)
    for package in _installed_course_packages(prefixes):  # a pip-installed course: its files hidden
        args += ["--tmpfs", package]
    bind(graded_library() / "stages", f"{LIBRARY_ROOT}/stages")  # the library without the answers, read-only
    # the handout's stubs that run the student's own function look for it in <library root>/exercises/
    args += ["--symlink", SCRATCH_EXERCISES, f"{LIBRARY_ROOT}/exercises"]
    bind(CHILD_SCRIPT, "/sandbox/child.py")
    args += ["--proc", "/proc", "--dev", "/dev", "--clearenv", "--chdir", "/tmp"]
    environment = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "USER": "nobody", "LANG": "C.UTF-8",
                   "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
                   "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TVM_NUM_THREADS": "1"}
    if root:
        environment["COURSE_SANDBOX_SETUID"] = str(NOBODY)
    for name, value in environment.items():
        args += ["--setenv", name, value]
    child = [sys.executable, "-I", "-B", "/sandbox/child.py", mode]
    if preload_tilelang:
        child.append("--preload-tilelang")
    launcher = [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(limits.rlimits()), str(os.getpid())]
    return launcher + args + ["--"] + child


def _under(path, roots):
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


class SandboxedProcess:
    """One sandbox_child.py in bwrap, spoken to in messages (kdacourse.sandbox_child's format)."""

    def __init__(self, mode="student", limits=None, preload_tilelang=False):
        self.limits = limits = limits or Limits()
        self._stderr = collections.deque()
        self._stderr_size = 0
        self._lock = threading.Lock()
        self.process = subprocess.Popen(bwrap_command(mode, limits, preload_tilelang), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                        cwd="/")
        self._reader = threading.Thread(target=self._drain_stderr, daemon=True)
        self._reader.start()
        self.dead = False

    def _drain_stderr(self):
        """Keep the last limits.stderr_bytes of the child's output; read and drop the rest (a flood)."""
        stream = self.process.stderr
        while True:
            chunk = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
            if not chunk:
                return
            with self._lock:
                self._stderr.append(chunk)
                self._stderr_size += len(chunk)
                while self._stderr_size - len(self._stderr[0]) >= self.limits.stderr_bytes:
                    self._stderr_size -= len(self._stderr.popleft())

    def output(self):
        """The end of what the child wrote to stderr (its prints too), as text."""
        with self._lock:
            data = b"".join(self._stderr)[-self.limits.stderr_bytes:]
        return data.decode(errors="replace")

    def request(self, message, timeout=None):
        """Send one encoded message, return the reply's body; ChildFailed (and the process killed)
        on a timeout, an end, an oversized or cut reply."""
        if self.dead:
            raise ChildFailed("the sandboxed process has already ended")
        self._seconds = self.limits.call_seconds if timeout is None else timeout  # for _check_time's message
        deadline = time.monotonic() + self._seconds
        finished = False
        try:
            self._write(message, deadline)
            head = self._read(8, deadline)
            (length,) = struct.unpack(">Q", head)
            if length > self.limits.reply_bytes:
                raise ChildFailed(f"the sandboxed process sent a reply of {length} bytes, more than the "
                                  f"{self.limits.reply_bytes} allowed")
            body = self._read(length, deadline)
            finished = True
            return body
        finally:
            if not finished:
                self.kill()

    def _write(self, data, deadline):
        fd = self.process.stdin.fileno()
        os.set_blocking(fd, False)
        view = memoryview(data)
        while view:
            self._check_time(deadline)
            _, ready, _ = select.select([], [fd], [], max(0.0, min(1.0, deadline - time.monotonic())))
            if ready:
                try:
                    view = view[os.write(fd, view[:1 << 20]):]
                except BrokenPipeError:
                    raise ChildFailed(self._ended()) from None

    def _read(self, n, deadline):
        fd = self.process.stdout.fileno()
        chunks, left = [], n
        while left:
            self._check_time(deadline)
            ready, _, _ = select.select([fd], [], [], max(0.0, min(1.0, deadline - time.monotonic())))
            if ready:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    raise ChildFailed(self._ended())
                chunks.append(chunk)
                left -= len(chunk)
        return b"".join(chunks)

    def _check_time(self, deadline):
        if time.monotonic() >= deadline:
            raise ChildFailed(f"timed out: the call did not return within {self._seconds:g} s "
                              f"(wall clock) and its sandboxed process was killed")

    def _ended(self):
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        self._reader.join(timeout=2)
        if code is not None and code < 0:
            how = f"was killed by signal {signal.Signals(-code).name if -code in signal.valid_signals() else -code}"
            if -code in (signal.SIGXCPU, signal.SIGKILL):
                how += " (a CPU time or memory limit?)"
        else:
            how = f"ended with exit code {code}"
        tail = "\n".join(self.output().strip().splitlines()[-5:])
        return f"the sandboxed process {how} before replying" + (f"; its last output:\n{tail}" if tail else "")

    def kill(self):
        """Kill bwrap's process group; its death takes the sandbox's PID namespace with it."""
        if self.dead:
            return
        self.dead = True
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for stream in (self.process.stdin, self.process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(timeout=2)

    def close(self):
        self.kill()


@cache
def sandbox_problem():
    """None when the sandbox works here; else why not and how to get it."""
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux (bubblewrap); this is {sys.platform}: {HOW_TO_GET}"
    if bwrap_path() is None:
        return f"bwrap (bubblewrap) is not installed: {HOW_TO_GET}"
    from kdacourse.sandbox_child import decode, encode

    child = None
    try:
        child = SandboxedProcess("selftest", Limits(call_seconds=SELF_TEST_SECONDS))
        facts = decode(child.request(encode({"op": "selftest"})))
    except (ChildFailed, OSError, ValueError) as error:
        output = child.output().strip() if child else ""
        return f"bwrap fails its self-test ({error}{'; ' + output[-500:] if output else ''}): {HOW_TO_GET}"
    finally:
        if child:
            child.kill()
    if running_as_root() and (facts.get("uid"), facts.get("gid"), facts.get("groups")) != (NOBODY, NOBODY, []):
        return f"bwrap's self-test: the child runs as {facts}, not as nobody: {HOW_TO_GET}"
    return None


def require_sandbox():
    """Raise SandboxUnavailable (why, and how to get one) unless the sandbox works here."""
    problem = sandbox_problem()
    if problem:
        raise SandboxUnavailable(problem)


def describe(limits=None):
    """One line on the sandbox, for reports."""
    limits = limits or Limits()
    return "bubblewrap sandbox, " + ", ".join(f"{key}={value}" for key, value in asdict(limits).items())
