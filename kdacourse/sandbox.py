"""The sandbox that student code runs in when an instructor grades (Linux): bubblewrap, or where no
namespace can be made, a user of its own.

A sandboxed process (SandboxedProcess) is kdacourse/sandbox_child.py run in one of two isolations.

**bubblewrap** (BUBBLEWRAP), wherever bwrap can make namespaces: the child runs by bwrap with:
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

**A user of its own** (OWN_USER), where bwrap cannot make namespaces (a container under Docker's
default seccomp profile, or without CAP_SYS_ADMIN, as Gradescope runs each submission) and the grader
is root, as Gradescope's guidance for autograders advises (run the student's code as another user,
the answers out of its reach); kdacourse/sandbox_launcher.py starts the child:
- as a uid that no account has (USER_BASE and up, one per sandboxed process alive, held by a lock
  file), with no groups; before its start and after its end every process of that uid is killed
  (`kill(-1)` as that uid: one that started its own session too) and its files in the shared temporary
  folders removed, so that nothing of one child reaches the next that gets the uid;
- in a folder of its own, made by the grader: a copy of the graded library and of the child script
  (the grader's, read-only), and a private scratch folder (the child's HOME, TMPDIR and working
  directory, where the submission's files are written); no tmpfs, so scratch_bytes is not enforced
  there (file_size bounds each file);
- the same rlimits, killed with its parent (PR_SET_PDEATHSIG), no_new_privs, and the network cut
  where seccomp is allowed (kdacourse/seccomp.py: a socket of any family but AF_UNIX refused);
- the course out of its reach by the file permissions alone: the self-test checks, as that user,
  that it can read none of the course's files (the Python environment aside) nor any installed copy
  of the course, and can write nowhere in the course or the environment; where it can, the sandbox
  is refused and the message names the files (the Gradescope bundle makes the course private itself,
  kdacourse.autograder.protect_course).

`sandbox_problem()` picks the isolation (bubblewrap first) and says, where neither works, why: the
real cause (bwrap missing, or namespaces forbidden here and the grader not root, or a file the user
could read). `describe()` says which ran, for the reports.
"""

import collections
import compileall
import errno
import fcntl
import hashlib
import json
import os
import re
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from kdacourse import REPO_ROOT
from kdacourse.sandbox_child import LIBRARY_ROOT, SCRATCH_EXERCISES
from kdacourse.seccomp import Rule, SeccompUnavailable, program

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
BUBBLEWRAP, OWN_USER = "bubblewrap", "own user"
# The isolation the grading run's parent chose, handed to the processes it starts.
ISOLATION_VARIABLE = "COURSE_SANDBOX_ISOLATION"
LAUNCHER_SCRIPT = Path(__file__).with_name("sandbox_launcher.py")
# The own-user isolation's uids: far above every range that accounts get (Debian's users end at 59999,
# systemd's dynamic users at 65519, subordinate uid ranges start at 100000 and take 65536 per user).
USER_BASE = 2_000_000_000
USER_SLOTS = 1024
USERS_FOLDER = Path(tempfile.gettempdir()) / "kdacourse-sandbox-users"  # the grader's lock files, 0700
SHARED_TEMPORARY_FOLDERS = ("/tmp", "/var/tmp", "/dev/shm")  # where any user may leave files
# The own-user isolation's network: no socket but a local one (and no io_uring, which makes sockets too).
NETWORK_RULES = (Rule("socket", errno.EACCES, not_equal=socket.AF_UNIX), Rule("io_uring_setup", errno.EPERM))
NAMESPACES_FORBIDDEN = ("this system forbids new namespaces (a container under Docker's default seccomp profile "
                        "or without CAP_SYS_ADMIN, as Gradescope runs each submission, or user namespaces "
                        "turned off)")
_chosen = {}  # what the self-test of the isolation in use found: {"isolation", "network_cut"}


@dataclass(frozen=True)
class Limits:
    """What one sandboxed process may use. cpu_seconds, address_space, processes, file_size and
    open_files are rlimits (RLIMIT_CPU, _AS, _NPROC, _FSIZE, _NOFILE); processes counts the threads
    of every process of the child's uid on the machine (under bubblewrap as root, 65534's, which all
    children share; in the own-user isolation, the child's own uid's)."""

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
    for path in [folder, *folder.rglob("*")]:  # readable by the sandbox's user, whatever the course's modes
        path.chmod(0o755 if path.is_dir() else 0o644)
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


def _acquire_user():
    """(a uid of the own-user isolation that no other sandboxed process holds, the lock file's fd that
    holds it until closed)."""
    try:
        USERS_FOLDER.mkdir(mode=0o700)
    except FileExistsError:
        pass
    status = USERS_FOLDER.lstat()
    if not stat.S_ISDIR(status.st_mode) or status.st_uid != os.geteuid() or status.st_mode & 0o077:
        raise SandboxUnavailable(f"{USERS_FOLDER} is not a folder of the grader's own that only it can open: "
                                 f"remove it")
    start = os.getpid() % USER_SLOTS
    for offset in range(USER_SLOTS):
        uid = USER_BASE + (start + offset) % USER_SLOTS
        fd = os.open(USERS_FOLDER / str(uid), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return uid, fd
        except BlockingIOError:
            os.close(fd)
    raise SandboxUnavailable(f"all {USER_SLOTS} users of the sandbox are in use")


_KILL_ALL = "import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\nexcept ProcessLookupError:\n    pass\n"


def sweep_user(uid):
    """Kill every process of `uid` (kill(-1) as that uid reaches each, whatever its session) and remove
    what it left in the shared temporary folders."""
    subprocess.run([sys.executable, "-I", "-S", "-c", _KILL_ALL], user=uid, group=uid, extra_groups=[], cwd="/",
                   env={}, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   timeout=60, check=True)
    for folder in SHARED_TEMPORARY_FOLDERS:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)  # by file descriptors: no link inside is followed
                else:
                    os.unlink(entry.path)
            except OSError:
                pass


class OwnUserBox:
    """The uid and the folder of one sandboxed process in the own-user isolation:

        <box>/child.py                 the child script     (the grader's, 0644)
        <box>/course/stages/...        the graded library   (the grader's, 0755/0644)
        <box>/course/exercises         -> <box>/scratch/exercises, as the handout's stubs expect
        <box>/scratch/                 the child's, 0700: HOME, TMPDIR, working directory
    """

    def __init__(self):
        self.uid, self._lock = _acquire_user()
        self.folder = None
        try:
            sweep_user(self.uid)  # a grader that died may have left processes of this uid
            self.folder = Path(tempfile.mkdtemp(prefix="kdacourse-sandbox-"))
            library = self.folder / "course" / "stages"
            shutil.copytree(graded_library() / "stages", library)  # its modes: 0755 and 0644 (_build_library)
            for folder in (self.folder, self.folder / "course"):
                folder.chmod(0o755)
            shutil.copyfile(CHILD_SCRIPT, self.folder / "child.py")
            (self.folder / "child.py").chmod(0o644)
            self.scratch = self.folder / "scratch"
            self.scratch.mkdir(mode=0o700)
            os.chown(self.scratch, self.uid, self.uid)
            os.symlink(self.scratch / "exercises", self.folder / "course" / "exercises")
        except BaseException:
            self.close()
            raise

    def command(self, mode, limits, preload_tilelang=False):
        """The argv that starts the child in `mode` as this box's user, behind sandbox_launcher.py."""
        scratch = str(self.scratch)
        environment = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "USER": "sandbox",
                       "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                       "TVM_NUM_THREADS": "1", "COURSE_SANDBOX_LIBRARY": str(self.folder / "course"),
                       "COURSE_SANDBOX_SCRATCH": scratch}
        if os.environ.get("LD_LIBRARY_PATH"):  # the interpreter is the grader's, which may need it to start
            environment["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
        child = [sys.executable, "-I", "-B", str(self.folder / "child.py"), mode]
        if preload_tilelang:
            child.append("--preload-tilelang")
        try:
            network_filter = program(NETWORK_RULES).hex()
        except SeccompUnavailable:
            network_filter = None
        spec = {"rlimits": limits.rlimits(), "uid": self.uid, "gid": self.uid, "parent": os.getpid(),
                "filter": network_filter, "cwd": scratch, "environment": environment, "argv": child}
        return [sys.executable, "-I", "-S", str(LAUNCHER_SCRIPT), json.dumps(spec)]

    def close(self):
        """Kill the uid's processes, remove its files and the box, and give the uid back."""
        if self._lock is None:
            return
        try:
            sweep_user(self.uid)
        except (OSError, subprocess.SubprocessError):
            pass  # the start's sweep failed too, and said why; the next holder of the uid sweeps again
        finally:
            if self.folder is not None:
                shutil.rmtree(self.folder, ignore_errors=True)
            os.close(self._lock)
            self._lock = None


def _under(path, roots):
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


class SandboxedProcess:
    """One sandbox_child.py in the isolation chosen (`isolation()`, or the one given), spoken to in
    messages (kdacourse.sandbox_child's format)."""

    def __init__(self, mode="student", limits=None, preload_tilelang=False, isolation_kind=None):
        self.limits = limits = limits or Limits()
        self._stderr = collections.deque()
        self._stderr_size = 0
        self._lock = threading.Lock()
        self.isolation = isolation_kind or isolation()
        self.box = None
        if self.isolation == OWN_USER:
            self.box = OwnUserBox()
            command, cwd = self.box.command(mode, limits, preload_tilelang), str(self.box.scratch)
        else:
            command, cwd = bwrap_command(mode, limits, preload_tilelang), "/"
        try:
            self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, start_new_session=True, cwd=cwd)
        except BaseException:
            if self.box is not None:
                self.box.close()
            raise
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
        """Kill the process group; bwrap's death takes the sandbox's PID namespace with it, and the
        own user's box kills every process of its uid."""
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
        if self.box is not None:
            self.box.close()

    def close(self):
        self.kill()


def _course_files():
    """Every file of the course (its Python environment aside, which the sandbox's user must read)
    and of any copy of the course installed in that environment: none may be readable to that user."""
    environment = {os.path.realpath(prefix) for prefix in (sys.prefix, sys.base_prefix)}
    found = []
    roots = [str(REPO_ROOT), *_git_folders(), *_installed_course_packages([sys.prefix, sys.base_prefix])]
    for root in roots:
        for folder, folders, files in os.walk(root):
            folders[:] = [name for name in folders if os.path.realpath(os.path.join(folder, name)) not in environment]
            found += [os.path.join(folder, name) for name in files]
    return found


def _git_folders():
    """The git folders of a course that is a worktree or a submodule (its .git a file naming them),
    which hold the solutions' history outside the course's folder."""
    dot_git = REPO_ROOT / ".git"
    if not dot_git.is_file():
        return []
    text = dot_git.read_text(errors="replace").strip()
    if not text.startswith("gitdir:"):
        return []
    folder = (REPO_ROOT / text.removeprefix("gitdir:").strip()).resolve()
    common = folder / "commondir"
    shared = [str((folder / common.read_text().strip()).resolve())] if common.is_file() else []
    return [str(folder), *shared]


def _self_test(kind):
    """What the child says of itself in the isolation `kind` ({uid, gid, groups, ...}); ChildFailed,
    OSError or ValueError when it does not start or answer."""
    from kdacourse.sandbox_child import decode, encode

    request = {"op": "selftest"}
    if kind == OWN_USER:
        request.update(unreadable=_course_files(), unwritable=sorted({str(REPO_ROOT), os.path.realpath(sys.prefix)}))
    child = None
    try:
        child = SandboxedProcess("selftest", Limits(call_seconds=SELF_TEST_SECONDS), isolation_kind=kind)
        facts = decode(child.request(encode(request)))
        facts["uid_expected"] = child.box.uid if child.box else NOBODY
        return facts
    except PermissionError:
        raise
    except (ChildFailed, OSError, ValueError, subprocess.SubprocessError) as error:
        output = child.output().strip() if child else ""
        raise ChildFailed(f"{error}{'; ' + output[-500:] if output else ''}") from None
    finally:
        if child:
            child.kill()


@cache
def _bubblewrap_problem():
    """None when bwrap isolates here; else why not, its real cause first."""
    if bwrap_path() is None:
        return "bwrap (bubblewrap) is not installed"
    try:
        facts = _self_test(BUBBLEWRAP)
    except ChildFailed as error:
        text = str(error)
        if "namespace" in text or "Operation not permitted" in text:
            said = re.search(r"bwrap: [^;\n]*", text)
            said = said[0] if said else text[:300]
            return f"bwrap cannot make the namespaces it isolates with ({said}): {NAMESPACES_FORBIDDEN}"
        return f"bwrap fails its self-test ({text})"
    if running_as_root() and (facts.get("uid"), facts.get("gid"), facts.get("groups")) != (NOBODY, NOBODY, []):
        return f"bwrap's self-test: the child runs as {facts}, not as nobody"
    if facts.get("imports"):
        return f"bwrap's self-test: the child cannot import NumPy and the graded library ({facts['imports']})"
    return None


@cache
def _own_user_problem():
    """None when the own-user isolation holds here (the grader is root); else why not."""
    if not running_as_root():
        return (f"the other isolation, the code run as a user of its own, needs the grader to run as root "
                f"(it runs as uid {os.geteuid()})")
    try:
        facts = _self_test(OWN_USER)
    except PermissionError as error:
        return (f"the sandbox's user cannot run the grader's Python ({error}): the Python environment "
                f"({sys.prefix}, {sys.base_prefix}) and the folders above it must be readable by other users")
    except (ChildFailed, SandboxUnavailable, OSError, subprocess.SubprocessError) as error:
        return f"the code cannot run as a user of its own here: {error}"
    expected = facts.pop("uid_expected")
    if (facts.get("uid"), facts.get("gid"), facts.get("groups")) != (expected, expected, []):
        return f"the own-user isolation's self-test: the child runs as {facts}, not as uid {expected} alone"
    if facts.get("imports"):
        return (f"the sandbox's user (uid {expected}) cannot import NumPy and the graded library "
                f"({facts['imports']}): the Python environment {sys.prefix} and the folders above it must be "
                f"readable by other users")
    readable, writable = facts.get("readable", []), facts.get("writable", [])
    if readable:
        return (f"the sandbox's user could read {facts['readable_count']} of the course's files, e.g. {readable[0]}: make the "
                f"course unreadable to other users (chmod go-rwx on each entry of {REPO_ROOT} but the Python "
                f"environment; the autograder bundle does it itself)")
    if writable:
        return (f"the sandbox's user could write {writable[0]}{f' and {len(writable) - 1} more' if len(writable) > 1 else ''}"
                f": the course and its Python environment must be the grader's alone to write")
    _chosen["network_cut"] = not facts.get("network")
    return None


@cache
def sandbox_problem():
    """None when a sandbox works here (bubblewrap, else a user of its own); else why not, the real
    cause, and what to do. The isolation chosen is handed to the processes this one starts."""
    if not sys.platform.startswith("linux"):
        return f"the sandbox needs Linux; this is {sys.platform}: {HOW_TO_GET}"
    for kind, problem in ((BUBBLEWRAP, _bubblewrap_problem), (OWN_USER, _own_user_problem)):
        if problem() is None:
            _chosen["isolation"] = kind
            os.environ[ISOLATION_VARIABLE] = kind
            return None
    where = "fix what the message names" if running_as_root() else "grade as root (as Gradescope runs the autograder)"
    what = (HOW_TO_GET if bwrap_path() is None else
            f"{where}, or grade where namespaces are allowed, or, on a machine where the code is trusted (a "
            f"student's own), pass --trust")
    return f"{_bubblewrap_problem()}; and {_own_user_problem()}: {what}"


def require_sandbox():
    """Raise SandboxUnavailable (why, and how to get one) unless the sandbox works here."""
    problem = sandbox_problem()
    if problem:
        raise SandboxUnavailable(problem)


def isolation():
    """The isolation the sandboxed processes use: the one the grading run's parent chose, else this
    process's choice (sandbox_problem)."""
    require_sandbox()
    return os.environ[ISOLATION_VARIABLE]


def chosen_isolation():
    """The isolation this process's sandbox_problem chose, or that its parent handed down; None before."""
    return os.environ.get(ISOLATION_VARIABLE)


def describe(kind):
    """What a report says of the isolation `kind` (None: not known)."""
    if kind == BUBBLEWRAP:
        return "bubblewrap (namespaces: no network, the course not in the sandbox)"
    if kind == OWN_USER:
        network = ("its network cut by seccomp" if _chosen.get("network_cut", True)
                   else "its network NOT cut (seccomp was refused here)")
        return ("a user of its own (no namespace could be made here: the code ran as a uid of its own in a "
                f"private folder, the course unreadable to it, {network})")
    return "the sandbox"
