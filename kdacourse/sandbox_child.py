"""The sandboxed child of `course grade` (kdacourse.sandbox starts it), and the wire format both sides use.

This file runs alone inside the sandbox, bound read-only at /sandbox/child.py: it imports nothing of
kdacourse (the sandbox does not hold it), only the standard library, NumPy, the graded library at
/course/stages (LIBRARY_ROOT, first on sys.path: the course that grades, never an installed copy) and,
for a kernel exercise, TileLang. The parent imports it only for `encode`, `decode` and the paths.

Wire format, in both directions: one message is an 8-byte big-endian length, then a 4-byte length
and a JSON header, then the arrays the header refers to, each in NumPy's .npy format (read with
allow_pickle=False: nothing is ever unpickled). In the JSON, an array is {"$array": i}, a NumPy
scalar {"$scalar": i}, a tuple {"$tuple": [...]}, a dict {"$dict": {...}} (string keys), a NumPy
dtype {"$dtype": "float16"}, a dataclass or named tuple of the course library {"$record":
"stages.x.y:Name", "fields": {...}}, a module-level function of the course library {"$function":
"stages.x.y:name"} (imported by name on the other side, never sent as code; in the child, whose library
lacks the answers, such a function runs in the parent: a call of it is a callback), a TileLang program the
child keeps {"$program": n}.

A call's reply is {"ok": {"$dict": {"value": ..., "arguments": [...]}}}: the value, and the array
arguments as the function left them, which the parent copies back into its own (a function that
updates an argument in place, as a state pool is updated, does so across the sandbox too).

Requests (parent -> child): in "selftest" mode one {"op": "selftest", "unreadable": [paths], "unwritable":
[folders]}, answered with what the child is and reaches (_self_test); {"op": "load", "stage", "file",
"source", "forbidden", "delegates"}, {"op": "call",
"name", "args", "kwargs"}, {"op": "interpret", "program", "inputs", "out_idx"}, {"op": "program_json",
"program"}; in "analysis" mode (no student code) {"op": "analyze", "program_json", "function"}.
Replies: {"ok": value} or {"error": {"type", "message", "traceback"}}; before its reply, a call may send
callbacks {"callback": {"function", "args", "kwargs"}}, each answered {"ok": value} or {"error": ...}
(the parent runs only a library function that it sent in that call's request).
"""

import dataclasses
import io
import json
import os
import struct
import sys

import numpy as np

# Where bubblewrap's sandbox holds the graded library (LIBRARY_ROOT/stages) and the submission's files:
# the library's stubs that run a student's own function read LIBRARY_ROOT/exercises, a link to
# SCRATCH_EXERCISES. The own-user isolation has them in its box, and says where in these variables.
LIBRARY_ROOT = "/course"
SCRATCH_EXERCISES = "/tmp/exercises"
LIBRARY_VARIABLE, SCRATCH_VARIABLE = "COURSE_SANDBOX_LIBRARY", "COURSE_SANDBOX_SCRATCH"
PROBE_REPORTED = 20  # paths the self-test names of those it could read or write
ANSWER_PACKAGES = ("solutions", "tests", "kdacourse")  # the course's packages that hold answers
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # the parent caps what it reads far lower (kdacourse.remote)
MAX_DEPTH = 16
NUMERIC_KINDS = "biufc"
RECORD_MODULE_PREFIX = "stages."


class WireError(Exception):
    """A message that does not follow the wire format."""


# ------------------------------------------------------------------------------------------ codec


def encode(value, programs=None):
    """bytes of one message holding `value`; `programs` (child side) maps TileLang programs to ids."""
    arrays = []

    def walk(item, depth):
        if depth > MAX_DEPTH:
            raise WireError("the value is nested too deeply")
        if item is None or isinstance(item, (bool, int, float, str)):
            if isinstance(item, int) and not isinstance(item, bool) and abs(item) > 2**63:
                raise WireError("an integer too large to send")
            return item
        if isinstance(item, np.ndarray):
            if item.dtype.kind not in NUMERIC_KINDS or item.dtype.fields is not None:
                raise WireError(f"an array of dtype {item.dtype} cannot be sent (numbers only)")
            arrays.append(np.ascontiguousarray(item))
            return {"$array": len(arrays) - 1}
        if isinstance(item, np.generic):
            arrays.append(np.asarray(item))
            return {"$scalar": len(arrays) - 1}
        if isinstance(item, np.dtype) or (isinstance(item, type) and issubclass(item, np.generic)):
            return {"$dtype": np.dtype(item).name}
        if isinstance(item, tuple) and not hasattr(item, "_fields"):
            return {"$tuple": [walk(x, depth + 1) for x in item]}
        if isinstance(item, tuple) or (dataclasses.is_dataclass(item) and not isinstance(item, type)):
            cls = type(item)
            if not cls.__module__.startswith(RECORD_MODULE_PREFIX):
                raise WireError(f"a {cls.__name__} cannot be sent (only the course library's records)")
            names = item._fields if isinstance(item, tuple) else [f.name for f in dataclasses.fields(item)]
            fields = {name: walk(getattr(item, name), depth + 1) for name in names}
            return {"$record": f"{cls.__module__}:{cls.__qualname__}", "fields": fields}
        if type(item).__name__ == "function" and library_function(_function_name(item)) is item:
            return {"$function": _function_name(item)}
        if isinstance(item, list):
            return [walk(x, depth + 1) for x in item]
        if isinstance(item, dict):
            if not all(isinstance(key, str) for key in item):
                raise WireError("a dict with keys other than strings cannot be sent")
            return {"$dict": {key: walk(x, depth + 1) for key, x in item.items()}}
        if programs is not None and type(item).__name__ == "PrimFunc":
            programs.append(item)
            return {"$program": len(programs) - 1}
        raise WireError(f"a value of type {type(item).__name__} cannot be sent (arrays, numbers, strings, "
                        f"tuples, lists and dicts of them)")

    header = json.dumps(walk(value, 0)).encode()
    blobs = []
    for array in arrays:
        buffer = io.BytesIO()
        np.save(buffer, array, allow_pickle=False)
        blobs.append(buffer.getvalue())
    sizes = json.dumps([len(blob) for blob in blobs]).encode()
    body = struct.pack(">I", len(sizes)) + sizes + struct.pack(">I", len(header)) + header + b"".join(blobs)
    return struct.pack(">Q", len(body)) + body


def decode(body, make_program=None, record_class=None, make_function=None):
    """The value of one message body (without its 8-byte length). make_program(n) gives what a
    {"$program": n} becomes; record_class(name) the class of a {"$record": name} (None: refused);
    make_function(name) what a {"$function": name} becomes (None: the library's function itself)."""
    try:
        (size_length,) = struct.unpack_from(">I", body, 0)
        sizes = json.loads(body[4:4 + size_length])
        offset = 4 + size_length
        (header_length,) = struct.unpack_from(">I", body, offset)
        header = json.loads(body[offset + 4:offset + 4 + header_length])
        offset += 4 + header_length
    except (struct.error, ValueError, RecursionError) as error:
        raise WireError(f"a malformed message: {error}") from None
    if not isinstance(sizes, list) or not all(isinstance(size, int) and size >= 0 for size in sizes):
        raise WireError("a malformed message: bad array sizes")
    arrays = []
    for size in sizes:
        blob = body[offset:offset + size]
        offset += size
        if len(blob) != size:
            raise WireError("a malformed message: an array is cut short")
        try:
            array = np.load(io.BytesIO(blob), allow_pickle=False)
        except Exception as error:
            raise WireError(f"a malformed array: {error}") from None
        if array.dtype.kind not in NUMERIC_KINDS or array.dtype.fields is not None:
            raise WireError(f"an array of dtype {array.dtype} (numbers only)")
        arrays.append(array)

    def walk(item, depth):
        if depth > MAX_DEPTH:
            raise WireError("a message nested too deeply")
        if item is None or isinstance(item, (bool, int, float, str)):
            return item
        if isinstance(item, list):
            return [walk(x, depth + 1) for x in item]
        if not isinstance(item, dict) or len(item) not in (1, 2):
            raise WireError("a malformed message: unknown item")
        if "$array" in item or "$scalar" in item:
            index = item.get("$array", item.get("$scalar"))
            if not isinstance(index, int) or not 0 <= index < len(arrays):
                raise WireError("a malformed message: bad array index")
            return arrays[index] if "$array" in item else arrays[index][()]
        if "$tuple" in item and isinstance(item["$tuple"], list):
            return tuple(walk(x, depth + 1) for x in item["$tuple"])
        if "$dict" in item and isinstance(item["$dict"], dict):
            return {str(key): walk(x, depth + 1) for key, x in item["$dict"].items()}
        if "$dtype" in item and isinstance(item["$dtype"], str):
            dtype = np.dtype(item["$dtype"])
            if dtype.kind not in NUMERIC_KINDS:
                raise WireError("a malformed message: bad dtype")
            return dtype.type
        if "$program" in item and isinstance(item["$program"], int) and make_program is not None:
            return make_program(item["$program"])
        if "$function" in item and isinstance(item["$function"], str):
            if make_function is not None:
                return make_function(item["$function"])
            function = library_function(item["$function"])
            if function is None:
                raise WireError(f"not a function of the course library: {item['$function'][:100]!r}")
            return function
        if "$record" in item and isinstance(item.get("fields"), dict) and record_class is not None:
            cls = record_class(item["$record"])
            if cls is None:
                raise WireError(f"a record of an unknown class {item['$record'][:100]!r}")
            return cls(**{str(key): walk(x, depth + 1) for key, x in item["fields"].items()})
        raise WireError("a malformed message: unknown item")

    return walk(header, 0)


def _library_attribute(name):
    """The module-level object `stages.x.y:name` of the course library, or None."""
    module_name, _, qualname = name.partition(":")
    if not module_name.startswith(RECORD_MODULE_PREFIX) or not qualname.isidentifier():
        return None
    import importlib

    try:
        return getattr(importlib.import_module(module_name), qualname)
    except (ImportError, AttributeError):
        return None


def library_record_class(name):
    """The dataclass or named tuple `stages.x.y:Name` of the course library, or None."""
    cls = _library_attribute(name)
    is_record = isinstance(cls, type) and (dataclasses.is_dataclass(cls) or (issubclass(cls, tuple) and hasattr(cls, "_fields")))
    return cls if is_record else None


def _function_name(function):
    return f"{getattr(function, '__module__', '')}:{getattr(function, '__qualname__', '')}"


def library_function(name):
    """The module-level function `stages.x.y:name` of the course library, or None."""
    function = _library_attribute(name)
    return function if type(function).__name__ == "function" and _function_name(function) == name else None


def read_message(stream, limit=MAX_MESSAGE_BYTES):
    """One message body from a binary stream, or None at its end."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (length,) = struct.unpack(">Q", head)
    if length > limit:
        raise WireError(f"a message of {length} bytes, more than {limit}")
    body = stream.read(length)
    if len(body) < length:
        return None
    return body


# ------------------------------------------------------------------------------------------ child


class ForbiddenCall(Exception):
    """The exercise called a function its catalog entry forbids."""


def _forbid(names):
    """Replace each forbidden function (e.g. "np.linalg.inv") by one that raises ForbiddenCall."""
    roots = {"np": np, "numpy": np}
    for name in names:
        root, *path = name.split(".")
        owner = roots.get(root)
        if owner is None or not path:
            continue
        for attribute in path[:-1]:
            owner = getattr(owner, attribute, None)
        if owner is None or not hasattr(owner, path[-1]):
            continue

        def forbidden(*args, _name=name, **kwargs):
            raise ForbiddenCall(f"{_name} is forbidden in this exercise (its catalog entry says so)")

        setattr(owner, path[-1], forbidden)


class ParentFunction:
    """A function of the course library that the parent passed to the code under test: a call of it is
    a callback, run in the parent (the graded library here may lack it: stages.common.oracles)."""

    def __init__(self, child, name):
        self._child, self.__name__ = child, name.partition(":")[2]
        self._name = name

    def __call__(self, *args, **kwargs):
        return self._child.callback(self._name, args, kwargs)


class Child:
    def __init__(self, mode, requests=None, replies=None):
        self.mode = mode
        self.modules = {}  # "<stage>/<file>" -> the student's module (a kernel child holds several)
        self.module = None  # the one the request at hand runs
        self.where = None  # its "<stage>/<file>"
        self.programs = []
        self.requests, self.replies = requests, replies

    def callback(self, name, args, kwargs):
        """name(*args, **kwargs) run by the parent: its value, or its error raised here."""
        self.replies.write(encode({"callback": {"function": name, "args": list(args), "kwargs": dict(kwargs)}}))
        body = _read_exact(self.requests)
        if body is None:
            raise SystemExit("sandbox: the parent went away")
        reply = decode(body, record_class=library_record_class)
        if isinstance(reply, dict) and "ok" in reply:
            return reply["ok"]
        error = reply.get("error", {}) if isinstance(reply, dict) else {}
        raise RuntimeError(f"{name} failed in the grader: {error.get('type', 'Exception')}: {error.get('message', '')}")

    def where_in_student_file(self, error):
        """' (at <stage>/<file>, line N: `the line`)' for the deepest frame of `error`'s traceback in
        the student's file, or '': the grader's message then points where the student's code failed
        (a kernel program that TileLang could not build fails inside TileLang, called from that line)."""
        path = getattr(self.module, "__file__", None)
        line, frame = None, error.__traceback__
        while path is not None and frame is not None:
            if frame.tb_frame.f_code.co_filename == path:
                line = frame.tb_lineno
            frame = frame.tb_next
        if line is None:
            return ""
        import linecache

        text = linecache.getline(path, line).strip()
        return f" (at {self.where}, line {line}: `{text}`)"

    def handle(self, request):
        op = request.get("op")
        if op == "ready":  # the process has started and imported what it preloads
            return True
        if op == "load" and self.mode == "student" and self._where(request) not in self.modules:
            return self.load(request)
        if op == "call" and self._where(request) in self.modules:
            self.where = self._where(request)
            self.module = self.modules[self.where]
            function = getattr(self.module, str(request["name"]), None)
            if not callable(function):
                raise AttributeError(f"the module has no function {request['name']!r}")
            args, kwargs = request.get("args", ()), request.get("kwargs", {})
            value = function(*args, **kwargs)
            arrays = [a for a in (*args, *kwargs.values()) if isinstance(a, np.ndarray)]
            return {"value": value, "arguments": arrays}
        if op == "interpret" and self.mode == "student":
            from stages.common.interpreter import interpret

            outputs = interpret(self.program(request["program"]), out_idx=list(request["out_idx"]))(*request["inputs"])
            return [np.asarray(x) for x in outputs] if isinstance(outputs, (list, tuple)) else np.asarray(outputs)
        if op == "program_json" and self.mode == "student":
            from tilelang import tvm

            return tvm.ir.save_json(self.program(request["program"]))
        if op == "analyze" and self.mode == "analysis":
            return self.analyze(request)
        raise ValueError(f"unknown request {op!r} in {self.mode} mode")

    @staticmethod
    def _where(request):
        return f"{request.get('stage')}/{request.get('file')}"

    def program(self, number):
        if not isinstance(number, int) or not 0 <= number < len(self.programs):
            raise ValueError("no such program")
        return self.programs[number]

    def load(self, request):
        import linecache
        import types

        stage, file = str(request["stage"]), str(request["file"])
        for other_stage, other_file, other_source in request.get("delegates", []):
            _write_exercise(str(other_stage), str(other_file), str(other_source))
        source = str(request["source"])
        path = _write_exercise(stage, file, source)
        self.where = f"{stage}/{file}"
        _forbid(request.get("forbidden", []))
        name = f"course_target.{stage}.{file[:-3]}"
        module = types.ModuleType(name)
        module.__file__ = path
        sys.modules[name] = module
        linecache.cache[path] = (len(source), None, source.splitlines(keepends=True), path)
        exec(compile(source, path, "exec", dont_inherit=True), module.__dict__)
        self.module = self.modules[self.where] = module
        return sorted(key for key, item in vars(module).items() if callable(item) and not key.startswith("__"))

    def analyze(self, request):
        """Run a TIR analysis of the course library on a program the student's child built; this
        process runs no student code (the program arrives as TVM's JSON, which evaluates nothing)."""
        import importlib

        from tilelang import tvm

        module_name, _, function_name = str(request["function"]).partition(":")
        if not module_name.startswith("stages.") or not function_name.isidentifier():
            raise ValueError("only the course library's analyses run here")
        function = getattr(importlib.import_module(module_name), function_name)
        return function(tvm.ir.load_json(str(request["program_json"])))


def _write_exercise(stage, file, source):
    """The private scratch copy (tmpfs) of a submission's file, SCRATCH_EXERCISES/stage/file; its path."""
    if not (stage.isidentifier() and file.endswith(".py") and file[:-3].isidentifier()):
        raise ValueError("bad stage or file name")
    scratch = os.environ.get(SCRATCH_VARIABLE)
    folder = os.path.join(os.path.join(scratch, "exercises") if scratch else SCRATCH_EXERCISES, stage)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, file)
    with open(path, "w", encoding="utf-8") as f:
        f.write(source)
    return path


def _drop_privileges():
    """As root inside the sandbox (the grader is root): become nobody before anything else runs."""
    if os.environ.get("COURSE_SANDBOX_SETUID") and os.getuid() == 0:
        uid = gid = int(os.environ["COURSE_SANDBOX_SETUID"])
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        if os.getuid() != uid or os.geteuid() != uid:
            raise SystemExit("sandbox: could not drop privileges")
    os.environ.pop("COURSE_SANDBOX_SETUID", None)


def _self_test(request):
    """What the child is and reaches: its ids; whether NumPy and the graded library import; of the
    paths the request names, those it can read ("unreadable") and, under the folders it names, those
    it can write ("unwritable"); whether it can open a network socket."""
    facts = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups()}
    try:
        import stages  # noqa: F401
    except Exception as error:  # noqa: BLE001 (whatever stops the import is what the grader must hear)
        facts["imports"] = f"{type(error).__name__}: {error}"
    readable = [path for path in request.get("unreadable", []) if os.access(path, os.R_OK)]
    import importlib.util

    for name in ANSWER_PACKAGES:  # an installed copy of the course (an editable install's finder, say)
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None:
            continue
        locations = [spec.origin] if spec.has_location and spec.origin else list(spec.submodule_search_locations or [])
        readable += [path for path in locations if os.access(path, os.R_OK)]
    # the answers first, then the rest, as examples
    facts["readable"] = sorted(readable, key=lambda path: "/solutions/" not in path)[:PROBE_REPORTED]
    facts["readable_count"] = len(readable)
    facts["writable"] = [path for root in request.get("unwritable", []) for folder, _, files in os.walk(root)
                         for path in (folder, *(os.path.join(folder, name) for name in files))
                         if os.access(path, os.W_OK)][:PROBE_REPORTED]
    import socket

    try:
        socket.socket(socket.AF_INET, socket.SOCK_STREAM).close()
        facts["network"] = True
    except OSError:
        facts["network"] = False
    return facts


def main():
    _drop_privileges()
    # the graded library, before any copy the environment has installed
    sys.path.insert(0, os.environ.get(LIBRARY_VARIABLE, LIBRARY_ROOT))
    mode = sys.argv[1] if len(sys.argv) > 1 else "student"
    # the protocol keeps private copies of stdin and stdout; what the code under test prints goes
    # to stderr, which the parent reads apart and caps
    requests = os.fdopen(os.dup(0), "rb", buffering=0)
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if mode == "selftest":
        # the request is read before the reply: a child that replied and ended before the parent had
        # written would leave the parent a broken pipe (seen once under load: "ended with exit code 0")
        body = _read_exact(requests)
        request = decode(body) if body is not None else {}
        replies.write(encode(_self_test(request if isinstance(request, dict) else {})))
        return
    if "--preload-tilelang" in sys.argv:
        import tilelang  # noqa: F401  (before the student's code: a kernel exercise needs it)
    child = Child(mode, requests, replies)
    while True:
        body = _read_exact(requests)
        if body is None:
            return
        try:
            request = decode(body, record_class=library_record_class,
                             make_function=lambda name: ParentFunction(child, name))
            reply = {"ok": child.handle(request)}
            message = encode(reply, child.programs)
        except BaseException as error:  # noqa: B036 (an exit or an interrupt is a failed call too)
            import traceback

            message = str(error)[:4000] + child.where_in_student_file(error)
            reply = {"error": {"type": type(error).__name__, "message": message,
                               "traceback": "".join(traceback.format_tb(error.__traceback__)[-3:])[-4000:]}}
            message = encode(reply)
        replies.write(message)


def _read_exact(stream):
    head = _read_n(stream, 8)
    if head is None:
        return None
    (length,) = struct.unpack(">Q", head)
    if length > MAX_MESSAGE_BYTES:
        raise SystemExit("sandbox: request too large")
    return _read_n(stream, length)


def _read_n(stream, n):
    chunks, left = [], n
    while left:
        chunk = stream.read(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


if __name__ == "__main__":
    main()
