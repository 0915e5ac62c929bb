"""Student code seen through the sandbox: proxies that the exercise tests call like the local module.

In untrusted grading (`course grade` without --trust) the `target_module` fixture returns a
RemoteModule instead of executing the student's file: the parent (pytest, running the instructor's
tests) never imports or executes it. Calling one of its functions sends the arguments to a
sandboxed child (kdacourse.sandbox), which imports the student's file against the graded library (the
course's stages/ without the answers), calls the function and sends
the result back: NumPy arrays, numbers, strings, tuples, lists and dicts of them, the library's
records (kdacourse.sandbox_child's wire format; nothing is unpickled). The tests then check those
values as they check a local function's.

A kernel exercise's `build_program` returns a RemoteProgram, a handle on the TileLang program that
stays in the child: `run_on_cpu` interprets it there (stages.common.interpreter), and a TIR analysis
of the library (e.g. stages.common.ordering.ordering_constraints) runs in a second sandboxed process
that runs no student code: the program reaches it as TVM's JSON, which is read without evaluating
anything. The parent only ever reads values.

Each file runs in a child of its own, but for the kernel programs: the files of a submission that
import TileLang (and that the catalog forbids the same names) share one child, which imports TileLang
before any of them, once instead of once per file. They are one student's files, so nothing crosses
between students; the analysis child stays apart.

A call whose child times out, ends, floods or answers garbage fails that call (SandboxCallFailed);
the next call starts a fresh child, and each file it held is imported again.
"""

import ast

import builtins
import os
import stat

import numpy as np

from kdacourse.sandbox import ChildFailed, Limits, SandboxedProcess, library_delegates
from kdacourse.sandbox_child import WireError, decode, encode, library_record_class

MAX_SOURCE_BYTES = 1 << 20
MAX_MESSAGE_CHARS = 2000
# Loading a file may import TileLang (several seconds, a minute on a loaded machine).
LOAD_SECONDS = 300
# Exceptions from the child that the parent raises as themselves (tests expect e.g. ValueError);
# any other comes back as a RemoteError subclass named like it.
BUILTIN_ERRORS = {cls.__name__: cls for cls in (
    ArithmeticError, AssertionError, AttributeError, FloatingPointError, IndexError, KeyError, LookupError,
    MemoryError, NameError, NotImplementedError, OverflowError, RecursionError, RuntimeError, TypeError,
    ValueError, ZeroDivisionError)}


class RemoteError(Exception):
    """An exception that the code under test raised in the sandbox: its type's name and message."""

    remote_type = "Exception"


class SandboxCallFailed(RemoteError):
    """The sandboxed child gave no reply: it timed out, ended, sent too much or sent garbage."""

    remote_type = "SandboxCallFailed"


class TargetRefused(Exception):
    """The submission's file cannot be graded as it is (missing, a symlink, not a file, too large)."""


def _raise_remote(error):
    name = str(error.get("type", "Exception"))[:100]
    message = str(error.get("message", ""))[:MAX_MESSAGE_CHARS]
    cls = BUILTIN_ERRORS.get(name)
    if cls is not None and getattr(builtins, name, None) is cls:
        raise cls(message)
    safe_name = name if name.isidentifier() else "RemoteException"
    cls = type(safe_name, (RemoteError,), {"remote_type": safe_name})
    raise cls(message)


def read_submission_file(folder, stage, file):
    """The text of folder/stage/file, read without following a link and without executing it."""
    path = os.path.join(folder, stage, file)
    for part in (os.path.join(folder, stage), path):
        if os.path.islink(part):
            raise TargetRefused(f"{part} is a symbolic link: a submission holds its own files")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise TargetRefused(f"{path} is missing") from None
    except OSError as error:
        raise TargetRefused(f"{path} cannot be read: {error}") from None
    with os.fdopen(fd, "rb") as f:
        status = os.fstat(f.fileno())
        if not stat.S_ISREG(status.st_mode):
            raise TargetRefused(f"{path} is not a regular file")
        if status.st_nlink > 1:  # it could be a file of the grader's that the student could not read
            raise TargetRefused(f"{path} has other hard links: a submission holds its own files")
        data = f.read(MAX_SOURCE_BYTES + 1)
    if len(data) > MAX_SOURCE_BYTES:
        raise TargetRefused(f"{path} is larger than {MAX_SOURCE_BYTES} bytes")
    return data.decode("utf-8", errors="replace"), path


class _Child:
    """One sandboxed process and what it holds; replaced by a fresh one after a failure."""

    def __init__(self, session, mode, preload_tilelang=False):
        self.session = session
        self.mode = mode
        self.preload_tilelang = preload_tilelang
        self.process = None
        self.generation = 0

    def start(self):
        if self.process is None or self.process.dead:
            self.process = SandboxedProcess(self.mode, self.session.limits, self.preload_tilelang)
            self.generation += 1
            return True
        return False

    def request(self, message, timeout=None, make_program=None):
        """The reply's value; on the way, the callbacks of the library functions `message` holds."""
        sent_functions = {function.__module__ + ":" + function.__qualname__: function
                          for function in _library_functions_in(message)}
        outgoing = message
        while True:
            try:
                body = self.process.request(encode(outgoing), timeout=timeout)
            except ChildFailed as failed:
                raise SandboxCallFailed(str(failed)) from None
            try:
                reply = decode(body, make_program=make_program, record_class=library_record_class)
            except (WireError, TypeError, ValueError) as error:
                self.process.kill()
                raise SandboxCallFailed(f"the sandboxed process sent a malformed reply: {error}") from None
            if not isinstance(reply, dict) or len(reply) != 1 or not ({"ok", "error", "callback"} & reply.keys()):
                self.process.kill()
                raise SandboxCallFailed("the sandboxed process sent a malformed reply")
            if "callback" not in reply:
                break
            outgoing = _run_callback(reply["callback"], sent_functions)
        if "error" in reply:
            _raise_remote(reply["error"] if isinstance(reply["error"], dict) else {})
        return reply["ok"]

    def close(self):
        if self.process is not None:
            self.process.kill()


def _library_functions_in(value, depth=0):
    """The module-level functions of the course library in a message (what a test passes as a callable)."""
    if depth > 16:
        return []
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [function for item in value for function in _library_functions_in(item, depth + 1)]
    module = getattr(value, "__module__", None) or ""
    return [value] if type(value).__name__ == "function" and module.startswith("stages.") else []


def _run_callback(callback, sent_functions):
    """The reply to a callback of the child: the value of a library function that this call's request
    passed to it, run here, or the error. Any other function is refused (the parent has the answers)."""
    if not isinstance(callback, dict):
        return {"error": {"type": "ValueError", "message": "a malformed callback"}}
    function = sent_functions.get(str(callback.get("function")))
    if function is None:
        return {"error": {"type": "PermissionError",
                          "message": "only a function passed to the code under test in this call can be called back"}}
    args, kwargs = callback.get("args", []), callback.get("kwargs", {})
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        return {"error": {"type": "ValueError", "message": "a malformed callback"}}
    try:
        return {"ok": function(*args, **kwargs)}
    except Exception as error:
        return {"error": {"type": type(error).__name__, "message": str(error)[:MAX_MESSAGE_CHARS]}}


class RemoteProgram:
    """A TileLang program built by the student's code; it stays in the sandboxed child."""

    def __init__(self, remote, generation, number):
        self._remote, self._generation, self._number = remote, generation, number

    def _child(self):
        child = self._remote.child
        if child.process is None or child.process.dead or child.generation != self._generation:
            raise SandboxCallFailed("the program was lost: its sandboxed process ended after a failure")
        return child

    def interpret(self, inputs, out_idx):
        """The program run through the tile interpreter on `inputs`, in the child; its outputs."""
        return self._child().request({"op": "interpret", "program": self._number, "inputs": list(inputs),
                                      "out_idx": list(out_idx)})

    def analyze(self, function):
        """function(program) for a TIR analysis of the course library, in a sandboxed process that
        runs no student code."""
        module = getattr(function, "__module__", "")
        if not module.startswith("stages."):
            raise ValueError(f"only the course library's analyses run on a sandboxed program, not {function!r}")
        program_json = self._child().request({"op": "program_json", "program": self._number})
        if not isinstance(program_json, str):
            raise SandboxCallFailed("the sandboxed process sent no program")
        analysis = self._remote.session.analysis_child()
        analysis.start()
        return analysis.request({"op": "analyze", "program_json": program_json,
                                 "function": f"{module}:{function.__name__}"}, timeout=LOAD_SECONDS)

    def __repr__(self):
        return f"<TileLang program built in the sandbox by {self._remote.stage}/{self._remote.file}>"


def imports_tilelang(source):
    """Whether the file's source imports TileLang (read as a syntax tree, never run)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    for node in ast.walk(tree):
        names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(name.split(".")[0] == "tilelang" for name in names):
            return True
    return False


class _RemoteFile:
    def __init__(self, session, stage, file, source, forbidden, child):
        self.session, self.stage, self.file = session, stage, file
        self.source, self.forbidden = source, list(forbidden)
        self.child = child
        self.names = None
        self.loaded_in = None  # the child's generation that imported the file

    def ensure_loaded(self):
        self.child.start()
        if self.loaded_in != self.child.generation:
            delegates = [[stage, file, source] for (stage, file), source in self.session.delegates().items()
                         if (stage, file) != (self.stage, self.file)]
            names = self.child.request({"op": "load", "stage": self.stage, "file": self.file, "source": self.source,
                                        "forbidden": self.forbidden, "delegates": delegates},
                                       timeout=self.session.load_seconds)
            if not isinstance(names, list):
                raise SandboxCallFailed("the sandboxed process sent a malformed reply")
            self.names = {str(name) for name in names}
            self.loaded_in = self.child.generation

    def call(self, name, args, kwargs):
        self.ensure_loaded()
        generation = self.child.generation
        reply = self.child.request({"op": "call", "stage": self.stage, "file": self.file, "name": name,
                                    "args": list(args), "kwargs": dict(kwargs)},
                                   make_program=lambda number: RemoteProgram(self, generation, number))
        if not isinstance(reply, dict) or set(reply) != {"value", "arguments"}:
            raise SandboxCallFailed("the sandboxed process sent a malformed reply")
        _copy_back([a for a in (*args, *kwargs.values()) if isinstance(a, np.ndarray)], reply["arguments"])
        return reply["value"]


def _copy_back(sent, returned):
    """The array arguments as the sandboxed function left them, copied into the caller's arrays (what
    an in-place update does in one process); a reply that does not match what was sent is refused."""
    if not isinstance(returned, list) or len(returned) != len(sent):
        raise SandboxCallFailed("the sandboxed process sent a malformed reply")
    for mine, theirs in zip(sent, returned):
        if not isinstance(theirs, np.ndarray) or theirs.shape != mine.shape or theirs.dtype != mine.dtype:
            raise SandboxCallFailed("the sandboxed process sent a malformed reply")
        if mine.flags.writeable and not np.array_equal(mine, theirs, equal_nan=mine.dtype.kind in "fc"):
            np.copyto(mine, theirs)


class RemoteFunction:
    """A function of the student's file; calling it calls it in the sandbox."""

    def __init__(self, remote, name):
        self._remote, self.__name__ = remote, name

    def __call__(self, *args, **kwargs):
        return self._remote.call(self.__name__, args, kwargs)

    def __repr__(self):
        return f"<function {self.__name__} of {self._remote.stage}/{self._remote.file}, run in the sandbox>"


class RemoteModule:
    """The student's file as the tests see it: its functions, each run in the sandbox."""

    def __init__(self, remote):
        self._remote = remote

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in self._remote.names:
            raise AttributeError(f"{self._remote.stage}/{self._remote.file} has no function {name!r}")
        return RemoteFunction(self._remote, name)


class RemoteSession:
    """The sandboxed children of one test run against one submission folder; close() kills them all."""

    def __init__(self, folder, limits=None, forbidden=None, load_seconds=LOAD_SECONDS):
        self.folder = str(folder)
        self.limits = limits or Limits()
        self.load_seconds = load_seconds  # a file's import (a loop there costs this, not the run)
        self.forbidden = forbidden or {}  # (stage, file) -> names the catalog forbids
        self._files = {}
        self._shared = {}  # forbidden names -> the child of the files that import TileLang
        self._analysis = None
        self._delegates = None

    def delegates(self):
        """{(stage, file): source} of the submission's files that the graded library runs for other
        exercises (kdacourse.sandbox.library_delegates), those it has and that can be read."""
        if self._delegates is None:
            self._delegates = {}
            for stage, file in library_delegates():
                try:
                    self._delegates[(stage, file)] = read_submission_file(self.folder, stage, file)[0]
                except TargetRefused:
                    pass
        return self._delegates

    def module(self, stage, file):
        """The proxy of folder/stage/file, loaded in a sandboxed child: its own, or the one its
        submission's TileLang files share.

        Raises TargetRefused (the file cannot be read as a submission's file) or RemoteError (it does
        not import: its exception's type and message)."""
        key = (stage, file)
        if key not in self._files:
            source, _ = read_submission_file(self.folder, stage, file)
            forbidden = tuple(self.forbidden.get(key, ()))
            if imports_tilelang(source):
                child = self._shared.setdefault(forbidden, _Child(self, "student", preload_tilelang=True))
            else:
                child = _Child(self, "student")
            self._files[key] = _RemoteFile(self, stage, file, source, forbidden, child)
        remote = self._files[key]
        # a kernel program's tests analyse its TIR: the analysis child imports TileLang while the
        # student's child loads, and is ready before any test's time limit runs
        analysis = self.analysis_child() if remote.child in self._shared.values() else None
        warming = analysis is not None and analysis.start()
        remote.ensure_loaded()
        if warming:
            try:
                analysis.request({"op": "ready"}, timeout=self.load_seconds)
            except RemoteError:
                pass  # started again at its first analysis, which then reports what is wrong
        return RemoteModule(remote)

    def release(self, stage, file):
        """The tests of folder/stage/file are done: its own child is killed (a later module() starts a
        new one); a shared child lives on for the next TileLang file."""
        remote = self._files.pop((stage, file), None)
        if remote is not None and remote.child not in self._shared.values():
            remote.child.close()

    def analysis_child(self):
        if self._analysis is None:
            self._analysis = _Child(self, "analysis", preload_tilelang=True)
        return self._analysis

    def close(self):
        for remote in self._files.values():
            remote.child.close()
        for child in self._shared.values():
            child.close()
        if self._analysis is not None:
            self._analysis.close()
