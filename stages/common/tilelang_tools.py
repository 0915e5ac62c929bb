"""TileLang helpers shared by every stage's kernel.py.

Two paths lead from a TileLang program to numbers:

- `compile_report(prim_func, pass_configs)` lowers the program for sm_90a on this machine's CPU
  (`lower_kernel`), compiles the generated CUDA with nvcc, and reads registers, spills and shared memory
  from ptxas. It needs nvcc, not a GPU, so it runs in CI and on a student's laptop.
- each stage's `forward(...)` JIT-compiles the same program for the GPU torch sees and runs it.

tilelang is imported inside the functions: the NumPy references and their tests never pay for it.
"""

import functools
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass

# TileLang 0.1.15 takes the target as a dict; the string form "cuda -arch=sm_90a" is rejected.
SM90A = {"kind": "cuda", "arch": "sm_90a"}



@functools.cache
def gpu_target() -> dict:
    """The target the fast path compiles for: the arch of the GPU torch sees ("sm_90a" on an H100 or
    H200, Hopper's wgmma needing the "a"), or sm_90a where there is none, to compile ahead of time.

    Named in full rather than as "cuda" (which TileLang resolves from the GPU), so that a program
    compiled on a machine without a GPU has the key of its TileLang cache entry on the GPU machine:
    a cache carried there (TILELANG_CACHE_DIR) spares its compiles."""
    import torch

    if torch.cuda.device_count() == 0:
        return SM90A
    major, minor = torch.cuda.get_device_capability()
    return {"kind": "cuda", "arch": f"sm_{major}{minor}{'a' if major == 9 else ''}"}


# exp(x) = exp2(x * log2(e)): kernels call the hardware exp2, references call exp.
LOG2_E = 1.4426950408889634


@dataclass(frozen=True)
class CompileReport:
    """What ptxas says of one kernel compiled for sm_90a, and the source it compiled."""

    registers: int  # per thread
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    stack_frame: int  # bytes of local memory per thread
    static_shared: int  # bytes, declared in the CUDA source
    dynamic_shared: int  # bytes, requested by TileLang at launch
    threads: int  # per block, as launched (TileLang may add producer warps)
    grid: tuple  # blocks along x, y, z
    cuda_source: str
    ptxas_log: str

    @property
    def shared_memory(self):
        return self.static_shared + self.dynamic_shared

    @property
    def divergent_barriers(self):
        """barriers_in_thread_branches of the source: a __syncthreads() that some warps skip."""
        return barriers_in_thread_branches(self.cuda_source)

    @property
    def misplaced_warp_group_operands(self):
        """warp_group_offsets_between_atoms of the source: a warp group's GEMM operand read from the
        wrong place."""
        return warp_group_offsets_between_atoms(self.cuda_source)

    def summary(self):
        return (
            f"{self.registers} registers/thread, {self.spill_stores} B spill stores, "
            f"{self.spill_loads} B spill loads, {self.stack_frame} B stack, "
            f"{self.shared_memory} B shared memory, {self.threads} threads/block, grid {self.grid}"
        )


class NvccMissing(FileNotFoundError):
    """No nvcc on this machine: compile-only reports cannot be made here."""


def find_nvcc():
    """The nvcc to compile with: $CUDA_HOME/bin/nvcc, else the one on PATH."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidates = [os.path.join(cuda_home, "bin", "nvcc")] if cuda_home else []
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc", "/usr/local/bin/nvcc"]
    for path in candidates:
        if path and os.path.exists(path):
            return path
    raise NvccMissing(
        "compile-only reports need nvcc (CUDA 12.x or 13.x) and no GPU: install the CUDA toolkit, "
        "or `pip install nvidia-cuda-nvcc`, and put nvcc on PATH or set CUDA_HOME"
    )


def lower(prim_func, target=SM90A):
    """Lower a TileLang program for `target`; returns the artifact with `kernel_source`."""
    import tilelang
    from tvm.target import Target

    target = Target(target)
    with target:  # some lowering passes ask for the current target
        return tilelang.lower(prim_func, target=target)


@dataclass(frozen=True)
class LoweredKernel:
    """A program's one device kernel as TileLang lowers it for sm_90a."""

    cuda_source: str
    threads: int  # per block, as launched (TileLang may add producer warps)
    grid: tuple  # blocks along x, y, z; an extent sized at run time kept as its expression
    dynamic_shared: int  # bytes, requested by TileLang at launch


def lower_kernel(prim_func, pass_configs=None):
    """Lower `prim_func` for sm_90a under TileLang's `pass_configs` (a dict of pass options, as
    tilelang.compile takes them) and return its one device kernel as a LoweredKernel.

    The kernel is a function of the program's TIR, the options and TileLang, so it is kept in
    $KDACOURSE_COMPILE_CACHE (a folder; unset, nothing is kept) under a digest of all three: a test run
    that lowers one program in several tests and processes lowers it once (a stage's compile test and its
    page's compile report build the same program: tests/stages/test_stages.py's COMPILE_SHAPE is the
    pages'). The TIR is compared whole, the function's name included.
    """
    import hashlib
    import json

    import tilelang
    from tilelang.transform import PassContext

    options = sorted((str(name), str(value)) for name, value in (pass_configs or {}).items())
    key = "\0".join([tilelang.__version__, repr(SM90A), repr(options), prim_func.script()])
    cached = _cache_path(hashlib.sha256(key.encode()).hexdigest() + ".lowered.json")
    if cached and os.path.exists(cached):
        with open(cached) as f:
            fields = json.load(f)
        return LoweredKernel(**{**fields, "grid": tuple(fields["grid"])})
    with PassContext(config=pass_configs or {}):
        artifact = lower(prim_func)
    kernel_attrs = [fn.attrs for _, fn in artifact.device_mod.functions.items() if fn.attrs is not None]
    if len(kernel_attrs) != 1:
        raise ValueError(f"expected one device kernel, found {len(kernel_attrs)}")
    attrs = kernel_attrs[0]
    extent = dict(attrs["thread_extent"])
    kernel = LoweredKernel(
        cuda_source=artifact.kernel_source,
        threads=int(extent.get("threadIdx.x", 1)) * int(extent.get("threadIdx.y", 1))
        * int(extent.get("threadIdx.z", 1)),
        grid=tuple(_int_or_text(extent.get(f"blockIdx.{axis}", 1)) for axis in "xyz"),
        dynamic_shared=int(attrs["dyn_shared_memory_buf"]) if "dyn_shared_memory_buf" in attrs else 0,
    )
    if cached:
        _write_whole(cached, json.dumps(kernel.__dict__))
    return kernel


def compile_report(prim_func, pass_configs=None):
    """Lower `prim_func` for sm_90a under TileLang's `pass_configs` (lower_kernel), compile it with
    nvcc, and return its CompileReport."""
    kernel = lower_kernel(prim_func, pass_configs)
    return _parse_ptxas(ptxas_log(kernel.cuda_source), kernel.cuda_source, kernel.dynamic_shared, kernel.threads,
                        kernel.grid)


def ptxas_log(cuda_source):
    """What nvcc and ptxas print compiling `cuda_source` for sm_90a (registers, spills, shared memory).

    The log is a function of the source, the compile command and the compiler, so it is kept in
    $KDACOURSE_COMPILE_CACHE (as lower_kernel's kernels) under a digest of all three.
    """
    import hashlib

    from tilelang.contrib import nvcc as tilelang_nvcc

    nvcc = find_nvcc()
    options = tilelang_nvcc.default_compile_options() + ["--ptxas-options=--verbose", "-w"]
    arguments = ["--cubin", "-O3", "-gencode", "arch=compute_90a,code=sm_90a", *options]
    key = "\0".join([_nvcc_version(nvcc), *arguments, cuda_source])
    cached = _cache_path(hashlib.sha256(key.encode()).hexdigest() + ".log")
    if cached and os.path.exists(cached):
        with open(cached) as f:
            return f.read()
    with tempfile.TemporaryDirectory() as workdir:
        source_path = os.path.join(workdir, "kernel.cu")
        with open(source_path, "w") as f:
            f.write(cuda_source)
        command = [nvcc, *arguments, "-o", os.path.join(workdir, "kernel.cubin"), source_path]
        result = subprocess.run(command, capture_output=True, text=True)
    log = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed ({result.returncode}):\n{log[-4000:]}")
    if cached:
        _write_whole(cached, log)
    return log


def _cache_path(name):
    """The path of `name` in $KDACOURSE_COMPILE_CACHE (the folder made if it is missing), or None where
    the variable is unset."""
    cache = os.environ.get("KDACOURSE_COMPILE_CACHE")
    if not cache:
        return None
    os.makedirs(cache, exist_ok=True)
    return os.path.join(cache, name)


def _write_whole(path, text):
    """Write `text` to `path` so that a process beside this one reads the whole of it or nothing."""
    partial = f"{path}.{os.getpid()}"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


@functools.cache
def _nvcc_version(nvcc):
    """The compiler's own account of itself (`nvcc --version`), part of a cached log's key."""
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout


def barriers_in_thread_branches(cuda_source):
    """[(line number, the branch's opening line)] for each __syncthreads() of a generated CUDA source
    that lies inside an `if` (or its `else`) whose condition reads threadIdx.

    __syncthreads() waits for every thread of the block: where a branch on the thread index leaves
    whole warps out, the others wait for them, and the kernel hangs or its barriers pair up wrongly.
    (TileLang's own barrier for some of the threads, tl::__sync_thread_partial, is not counted.)
    The source is read as TileLang writes it: one statement a line, braces at the ends of lines.
    """
    found, branches = [], []  # branches: the opening line of each block we are in
    for number, line in enumerate(cuda_source.splitlines(), 1):
        text = line.strip()
        if "__syncthreads()" in text and any("threadIdx" in opening for opening in branches):
            found.append((number, next(o for o in reversed(branches) if "threadIdx" in o)))
        closed = None
        for _ in range(text.count("}")):
            closed = branches.pop() if branches else None
        for _ in range(text.count("{")):  # an `else` belongs to the branch it closes
            branches.append(closed if text.startswith("} else") and closed else text)
    return found


# a wgmma operand's shared-memory descriptor: layout (swizzle), leading byte offset and stride byte
# offset (in 16-byte units), the descriptor's name and the buffer it points into
_DESCRIPTOR = re.compile(r"initialize_wgmma_descriptor<(\d+), (\d+), (\d+)>\((desc_\w+), .*?\(\(\w+\*\)(\w+)\)")
# a descriptor moved on per warp group: desc + (... ((int)threadIdx.x) >> 7) * bytes ...)
_WARP_GROUP_OFFSET = re.compile(r"\b(desc_\w+) \+ [^,]*?\(\(\(int\)threadIdx\.x\) >> 7\) \* (\d+)\)")


def warp_group_offsets_between_atoms(cuda_source):
    """[(descriptor, buffer, offset in bytes, the buffer's atom in bytes)] for each wgmma operand that
    a program's warp groups split, where the second group's offset is not a whole number of the
    operand's swizzle atoms.

    With two warp groups (256 threads) TileLang splits a GEMM's N (or M) between them and moves each
    group's descriptor by its share. For an operand whose N (or M) runs along the rows of its buffer
    (a leading byte offset above 1: the distance between two atoms of 32 or 64 columns) the share
    must be a multiple of that distance. TileLang 0.1.15 computes it from the rows of the operand as
    written in T.gemm: for a row slice such as K_col_s[0:16, :] of a 64-row buffer it moves 16 rows'
    worth instead of one atom of 64 rows, and the second group reads the first group's columns (stage
    6's intra kernel gave wrong dq, dk, dg on the H200 so). The source is read as TileLang writes it.
    """
    descriptors = {m.group(4): (int(m.group(2)), m.group(5)) for m in _DESCRIPTOR.finditer(cuda_source)}
    found = []
    for m in _WARP_GROUP_OFFSET.finditer(cuda_source):
        leading_byte_offset, buffer = descriptors[m.group(1)]
        offset, atom = int(m.group(2)), 16 * leading_byte_offset
        if leading_byte_offset > 1 and offset % atom:
            found.append((m.group(1), buffer, offset, atom))
    return found


def _int_or_text(extent):
    """A launch extent: an int, or the text of its expression when it is sized at run time."""
    try:
        return int(extent)
    except TypeError:
        return str(extent)


def _parse_ptxas(log, source, dynamic_shared, threads, grid):
    def number(pattern):
        match = re.search(pattern, log)
        if match is None:
            raise RuntimeError(f"ptxas output has no match for {pattern!r}:\n{log}")
        return int(match.group(1))

    return CompileReport(
        registers=number(r"Used (\d+) registers"),
        spill_stores=number(r"(\d+) bytes spill stores"),
        spill_loads=number(r"(\d+) bytes spill loads"),
        stack_frame=number(r"(\d+) bytes stack frame"),
        static_shared=int(m.group(1)) if (m := re.search(r"(\d+) bytes smem", log)) else 0,
        dynamic_shared=dynamic_shared,
        threads=threads,
        grid=grid,
        cuda_source=source,
        ptxas_log=log,
    )


# TileLang turns a kernel's Python source into TIR with Python's ast module, whose constructor is not
# thread-safe in CPython 3.11 (CI once raised "AST constructor recursion depth mismatch" with threads
# building at once): programs are built one at a time, and compiled (C++ lowering, nvcc) side by side
_PROGRAM_BUILD_LOCK = threading.Lock()


def build_in_turn(build, *arguments, **keywords):
    """build(*arguments, **keywords): a TileLang program, built while no other thread builds one. The
    compiled_* functions that compile_in_threads runs build through it."""
    with _PROGRAM_BUILD_LOCK:
        return build(*arguments, **keywords)


def compile_in_threads(compilers, log=None):
    """{key: what compilers[key]() returns, or the exception it raised}, every call in its own thread.

    compilers: {key: a function of no arguments that compiles one kernel}, building its program with
    build_in_turn. TileLang's lowering runs in C++ without the GIL and nvcc is a subprocess, so n
    compiles take about as long as the slowest, not their sum. log(message), if given, hears each one
    finish with its seconds.
    """
    import concurrent.futures
    import time

    def timed(key):
        started = time.monotonic()
        result = compilers[key]()
        return result, time.monotonic() - started

    results = {}
    with concurrent.futures.ThreadPoolExecutor(max(1, len(compilers))) as pool:
        futures = {pool.submit(timed, key): key for key in compilers}
        for future in concurrent.futures.as_completed(futures):
            key = futures[future]
            try:
                results[key], seconds = future.result()
                message = f"compiled {key} in {seconds:.0f} s"
            except Exception as failure:  # kept for the caller, who decides
                results[key] = failure
                message = f"FAILED to compile {key}: {type(failure).__name__}: {str(failure).strip()[-300:]}"
            if log is not None:
                log(message)
    return {key: results[key] for key in compilers}


# ------------------------------------------------------------------------------------------ errors that name a line


def shown_path(path):
    """`path` as a reader finds it: relative to the working directory when it lies below it."""
    path = str(path)
    relative = os.path.relpath(path, os.getcwd()) if os.path.isabs(path) else path
    return path if relative.startswith("..") else relative


def statement_at(path, line):
    """The text of the Python statement of `path` that holds `line`, on one line (a compound statement
    such as `for` or `with` by its header); None where the file cannot be read or parsed."""
    import ast
    import linecache

    source = "".join(linecache.getlines(str(path)))
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    found, nodes = None, list(tree.body)
    while nodes:  # walk down to the innermost statement that spans the line
        node = nodes.pop()
        if isinstance(node, ast.stmt) and node.lineno <= line <= (node.end_lineno or node.lineno):
            found = node
            nodes = [child for field in ("body", "orelse", "finalbody", "handlers") for child in getattr(node, field, [])]
    if found is None:
        return None
    body = getattr(found, "body", None)
    if isinstance(body, list) and body:  # a compound statement: its header, up to its body
        text = "".join(linecache.getlines(str(path))[found.lineno - 1:body[0].lineno - 1]) or linecache.getline(
            str(path), found.lineno)
    else:
        text = ast.get_source_segment(source, found) or ""
    text = " ".join(text.split())
    return text if len(text) <= 160 else text[:157] + "..."


def source_line(path, line):
    """'exercises/s01_linear_attention/kernel_program.py, line 70: `T.gemm(K_s, V_s, S_f)`'."""
    text = statement_at(path, line)
    where = f"{shown_path(path)}, line {line}"
    return f"{where}: `{text}`" if text else where


def build_error_message(error, build_program):
    """One paragraph that says why `build_program(...)` raised `error` while TileLang parsed its program.

    TileLang runs the body of a `@T.prim_func` as Python, with the author's file and line numbers, to
    build the TIR: the deepest frame of the traceback in the file of `build_program` is the line that
    failed (a `T.gemm`, a `T.copy`, a store). The message names that line, what TileLang said (the
    last line of its message) and, for the shape checks of `T.gemm`, the same in plain words.
    A `build_program` without a Python file (one that ran in the grading sandbox) is named by what
    TileLang said alone.
    """
    said = f"{type(error).__name__}: {_what_tilelang_said(error)}"
    plain = _gemm_shapes_in_plain_words(error) or _unequal_shapes_in_plain_words(error)
    # a shape check: the interpreter page's section on tile shapes (stages.common.interpreter.TileShapeMismatch)
    said = f'{said}; in plain words: {plain} (read the interpreter page, "A tile of the wrong shape")' if plain else said
    path = getattr(getattr(build_program, "__code__", None), "co_filename", None)
    line = None
    traceback = error.__traceback__
    while path is not None and traceback is not None:  # the deepest frame in the author's file
        if traceback.tb_frame.f_code.co_filename == path:
            line = traceback.tb_lineno
        traceback = traceback.tb_next
    if line is None:
        return f"the program does not build: {said}"
    return f"the program does not build: {source_line(path, line)}: {said}"


def _what_tilelang_said(error):
    """The message of `error` on one line: the last line of a message that carries TVM's C++
    traceback, else the whole message (TVM's StructuralEqual spreads one over five lines)."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if any(line.startswith(("Traceback", "File ")) or line[:1].isdigit() for line in lines):
        return lines[-1]
    text = " ".join(lines)
    return text if len(text) <= 300 else text[:297] + "..."


# TVM's check that two shapes agree (T.copy between regions of different shapes raises it)
_UNEQUAL = re.compile(r"StructuralEqual check failed.*?:\s*(\([^)]*\))\s*and rhs.*?:\s*(\([^)]*\))", re.S)


def _unequal_shapes_in_plain_words(error):
    match = _UNEQUAL.search(str(error))
    if match is None:
        return None
    return f"two shapes that must agree differ, {match.group(1)} and {match.group(2)}"


# TileLang 0.1.15's shape checks of T.gemm: "T.gemm M shape check failed: M_A = 16, M_C = 32"
_GEMM_SHAPE_CHECK = re.compile(r"(M|N|K) shape check failed: (\w+) = (\d+), (\w+) = (\d+)")


def _gemm_shapes_in_plain_words(error):
    """The failed shape check of a T.gemm (C = A B, A: M x K, B: K x N, C: M x N) said in words, with
    the transpose flag that would make it hold where TileLang's frame still shows the operands."""
    match = _GEMM_SHAPE_CHECK.search(str(error))
    if match is None:
        return None
    axis, first, second = match.group(1), int(match.group(3)), int(match.group(5))
    words = {
        "M": f"A gives M = {first} rows, C has {second}",
        "K": f"A gives K = {first}, B gives K = {second}",
        "N": f"B gives N = {first} columns, C has {second}",
    }[axis]
    flags = {"M": "transpose_A?", "K": "transpose_A or transpose_B?", "N": "transpose_B?"}[axis]
    return f"{words} ({_gemm_fix(error, axis) or flags})"


def _gemm_fix(error, axis):
    """'transpose_A=True?' where flipping one flag of the failed T.gemm makes its shapes agree; found in
    the locals of TileLang's frame that checked them (None where that frame is gone)."""
    traceback, checked = error.__traceback__, None
    while traceback is not None:
        if {"A_shape", "B_shape", "C_shape", "transpose_A", "transpose_B"} <= traceback.tb_frame.f_locals.keys():
            checked = traceback.tb_frame.f_locals
        traceback = traceback.tb_next
    if checked is None:
        return None
    try:
        (a_rows, a_cols), (b_rows, b_cols), (m, n) = (
            [int(s) for s in checked[name][-2:]] for name in ("A_shape", "B_shape", "C_shape"))
    except (TypeError, ValueError):  # a symbolic extent
        return None
    flags = {"transpose_A": bool(checked["transpose_A"]), "transpose_B": bool(checked["transpose_B"])}

    def agree(transpose_a, transpose_b):
        m_a, k_a = (a_cols, a_rows) if transpose_a else (a_rows, a_cols)
        k_b, n_b = (b_cols, b_rows) if transpose_b else (b_rows, b_cols)
        return m_a == m and k_a == k_b and n_b == n

    for flag in {"M": ["transpose_A"], "K": ["transpose_A", "transpose_B"], "N": ["transpose_B"]}[axis]:
        flipped = dict(flags, **{flag: not flags[flag]})
        if agree(flipped["transpose_A"], flipped["transpose_B"]):
            return f"A is {a_rows} x {a_cols}, B {b_rows} x {b_cols}, C {m} x {n}: {flag}={flipped[flag]}?"
    return f"A is {a_rows} x {a_cols}, B {b_rows} x {b_cols}, C {m} x {n}"
