"""A tile interpreter: runs a TileLang program on the CPU with NumPy, so a kernel's values are checked
without a GPU.

TileLang parses a `@T.prim_func` into TIR *before* lowering it for a GPU: the grid as loops bound to
blockIdx, buffers with a scope (global, `shared.dyn`, `local.fragment`, `local.var`), tile operations
as calls (`tl.tileop.copy`, `tl.tileop.gemm` and `tl.tileop.wgmma_gemm`, `tl.tileop.fill`,
`tl.tileop.reduce`, `tl.tileop.cumsum`) on regions, and `T.Parallel` loops as parallel `For` nodes. That program is what
the author wrote, before any layout, pipeline or thread is chosen; this module runs it:

- the grid is a loop over blocks, one block at a time;
- every buffer is a NumPy array; `T.alloc_var` is one value per lane (or thread), and reading it
  before anything stored into it stops the run with `ReadBeforeWrite`. Shared, fragment and local
  float buffers start filled with a NaN of a payload no arithmetic makes (UNWRITTEN_BITS): a statement
  that uses an element that nothing has written stops the run with `ReadBeforeWrite`, which names the
  buffer, the element and the statement's line in the author's file. `T.gemm` and `T.copy` into a
  shared or fragment buffer carry such elements on instead (a GEMM row computed from an unwritten row
  and never stored is no error): the rows and columns of C they reach, the elements they copy, are
  marked (TAINTED_BITS), and the run stops where a marked element is used, naming the first read;
- a `T.Parallel` nest runs once, vectorized: its loop variables are index arrays that broadcast
  against each other, stores are fancy-index assignments, `if` and `T.if_then_else` are masks;
- a block that reads its thread index (T.get_thread_binding, a loop bound to threadIdx) runs each
  statement in all its threads at once: the index is an array over the threads, the last axis of
  every value that depends on it, and a condition on it is a mask, as inside T.Parallel;
- `T.atomic_add` (`T.atomic_max`, `T.atomic_min`) on an element combines every executing lane's value
  into it in turn (np.add.at); on a region, adds a tile into it;
- serial, pipelined and unrolled loops run in order (a pipelined loop's stages overlap on the GPU,
  not in meaning);
- `T.copy` moves a region with bounds (reads outside the source give 0, writes outside the destination
  are dropped) and casts to the destination's dtype;
- `T.gemm` reads its operands as stored, multiplies them exactly, sums in float32 (fp32 operands are
  rounded to TF32 first, as Hopper's tensor cores take them) and adds into the accumulator unless
  `clear_accum`;
- every arithmetic node computes in its own dtype: fp16 through NumPy's float16, bf16 by rounding a
  float32 to 8 significant bits (round to nearest even), so casts round as the GPU rounds.

Mistakes a GPU would not report stop the run with an error that names the author's line and the
section of the interpreter page to read: ReadBeforeWrite, TileShapeMismatch, OutOfRange, and inside
one T.Parallel nest CrossLaneRead (a lane reads an element another lane wrote there) and LaneRace (two
lanes, or two threads in one statement, write one element). What it cannot show: races between
threads beyond one T.Parallel nest or one statement, races between blocks (they run one after
another), missing or misplaced barriers, the pipeline's overlap, layouts, registers, spills and
shared-memory limits (the compile-only path, stages.common.tilelang_tools, reports those), and the
last bits of exp2 and of the GEMM's summation order.

    kernel = interpret(build_program(1, 256, 2, 64, 64), out_idx=[3])
    o = kernel(q, k, v)               # NumPy arrays in, NumPy arrays out

A construct it does not run raises `UnsupportedConstruct`, naming the construct and its line in the
program as TileLang parsed it (`prim_func.script()`).
"""

from __future__ import annotations

import math
import re

import numpy as np

from stages.common.tile_regions import region_parts

__all__ = ["interpret", "run", "InterpreterError", "UnsupportedConstruct", "ReadBeforeWrite", "TileShapeMismatch",
           "OutOfRange", "CrossLaneRead", "LaneRace", "round_to_dtype", "NUMPY_DTYPES"]


class InterpreterError(RuntimeError):
    """The program did something the GPU would not do sensibly: an out-of-bounds read, mismatched
    shapes in a tile operation, a wrong number of arguments."""


class UnsupportedConstruct(InterpreterError):
    """The interpreter has no meaning for this construct; the message names it and its line."""


class ReadBeforeWrite(InterpreterError):
    """A statement read an element of a shared, fragment or local buffer that nothing had written: on a
    GPU it reads whatever the memory held. The message names the buffer, the element and the line."""

    section = "A buffer read before it is written"


# The mistakes below are named like ReadBeforeWrite: the author's file and line, what went wrong in
# the GPU's terms, and `section`, the section of the interpreter page (docs/interpreter.md, "Errors it
# names") that explains it. Each is a direct subclass of InterpreterError (the grading sandbox relays
# an error by the name of its class).

class TileShapeMismatch(InterpreterError):
    """A tile operation's regions disagree in shape: a T.copy between tiles of different shapes, a
    T.gemm operand that is not M x K, K x N or M x N."""

    section = "A tile of the wrong shape"


class OutOfRange(InterpreterError):
    """A store or a load at an index outside its buffer: on a GPU it writes over, or reads, another
    buffer's memory, or faults."""

    section = "A store or load out of range"


class CrossLaneRead(InterpreterError):
    """A lane of a T.Parallel loop read an element of a shared or fragment buffer that another lane
    wrote in the same loop: the interpreter runs the loop statement by statement, the GPU runs its
    lanes at once, in different threads, with no barrier inside the loop."""

    section = "A value read across lanes"


class LaneRace(InterpreterError):
    """Two lanes of one T.Parallel loop wrote one element of a shared or fragment buffer (different
    values, or by different statements): which write lands last is undefined on a GPU."""

    section = "A race between lanes"


# ------------------------------------------------------------------------------------------ dtypes

# How each TIR dtype is held in NumPy. bf16 has no NumPy type: a float32 whose value is on bf16's grid.
NUMPY_DTYPES = {
    "float16": np.float16, "bfloat16": np.float32, "float32": np.float32, "float64": np.float64,
    "int8": np.int64, "int16": np.int64, "int32": np.int64, "int64": np.int64,
    "uint8": np.int64, "uint16": np.int64, "uint32": np.int64, "uint64": np.int64, "bool": np.bool_,
}


def _round_float32_bits(x, kept_mantissa_bits):
    """Round float32 values to `kept_mantissa_bits` explicit mantissa bits, to nearest even."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32).astype(np.uint64)
    dropped = 23 - kept_mantissa_bits
    half = np.uint64(1 << (dropped - 1))
    lowest_kept = (bits >> np.uint64(dropped)) & np.uint64(1)
    rounded = (bits + half - np.uint64(1) + lowest_kept) & ~np.uint64((1 << dropped) - 1)
    rounded = np.where(np.isfinite(x), rounded, bits)  # inf and NaN keep their bits
    return rounded.astype(np.uint32).view(np.float32).reshape(x.shape)


def round_to_dtype(x, dtype):
    """x rounded to `dtype` (a TIR dtype string) and held as NUMPY_DTYPES[dtype]."""
    if dtype == "bfloat16":
        return _round_float32_bits(np.asarray(x, dtype=np.float32), 7)
    if dtype not in NUMPY_DTYPES:
        raise UnsupportedConstruct(f"dtype {dtype!r} (the interpreter knows {', '.join(NUMPY_DTYPES)})")
    target = NUMPY_DTYPES[dtype]
    if target is np.int64 and np.issubdtype(np.asarray(x).dtype, np.floating):
        x = np.trunc(x)  # a float cast to an integer truncates, as in C
    return np.asarray(x, dtype=target)


# The bits an unwritten element of a float buffer holds, and those of an element that a T.gemm or a
# T.copy computed from one: quiet NaNs of payloads 0xAD and 0xAF, which no arithmetic makes (an invalid
# operation gives the payload 0, a NaN operand passes its own on), so a NaN that the program computed
# (fp16 overflow, 0 * inf) is never taken for either. The payload sits in the top bits of the mantissa,
# which a cast between fp16, fp32 and fp64 keeps. bf16 is held as float32 (NUMPY_DTYPES).
_UNSIGNED = {np.dtype(np.float16): np.uint16, np.dtype(np.float32): np.uint32, np.dtype(np.float64): np.uint64}
_QUIET_NAN = {np.dtype(np.float16): (0x7E00, 0), np.dtype(np.float32): (0x7FC00000, 13),
              np.dtype(np.float64): (0x7FF8000000000000, 42)}  # the bits of NaN, and the payload's shift
UNWRITTEN_BITS = {d: _UNSIGNED[d](nan | 0xAD << shift) for d, (nan, shift) in _QUIET_NAN.items()}
TAINTED_BITS = {d: _UNSIGNED[d](nan | 0xAF << shift) for d, (nan, shift) in _QUIET_NAN.items()}
_TAINT_BIT = {d: _UNSIGNED[d](0x2 << shift) for d, (nan, shift) in _QUIET_NAN.items()}  # the one bit they differ in


def _unwritten_array(shape, dtype):
    """An array of `shape` and NumPy `dtype` (a float one) whose every element is UNWRITTEN_BITS."""
    dtype = np.dtype(dtype)
    return np.full(shape, UNWRITTEN_BITS[dtype], dtype=_UNSIGNED[dtype]).view(dtype)


def _unwritten(values):
    """A boolean mask (or a NumPy bool) of the elements of `values` that hold UNWRITTEN_BITS or
    TAINTED_BITS: one OR and one comparison, as they differ in one bit."""
    values = np.asarray(values)
    dtype = values.dtype
    return (values.view(_UNSIGNED[dtype]) | _TAINT_BIT[dtype]) == TAINTED_BITS[dtype]


def never_written(values):
    """A boolean mask of the elements of `values` (a float array: the interpreter's output, or a cast
    of it to another float type) that still hold UNWRITTEN_BITS: an output's elements start so, and
    an element the program never stored keeps them (a T.copy out of range drops the store)."""
    values = np.asarray(values)
    if values.dtype not in _UNSIGNED:
        return np.zeros(values.shape, dtype=bool)
    return values.view(_UNSIGNED[values.dtype]) == UNWRITTEN_BITS[values.dtype]


def _taint(array, mask):
    """Mark the elements of `array` (a float array, changed in place) where `mask` holds as TAINTED_BITS."""
    array.view(_UNSIGNED[array.dtype])[mask] = TAINTED_BITS[array.dtype]


def _to_tf32(x):
    """Hopper's tensor cores read fp32 GEMM operands as TF32: 10 explicit mantissa bits."""
    return _round_float32_bits(x, 10)


# ------------------------------------------------------------------------------------------ public API


def interpret(prim_func, out_idx=None):
    """A callable that runs `prim_func` on NumPy arrays, as `tilelang.compile(prim_func, out_idx)` runs
    it on a GPU: called with the inputs, it allocates the outputs (the parameters listed in `out_idx`)
    and returns them (one array, or a list for several); without `out_idx` it takes every parameter
    and writes the outputs in place. Inputs are rounded to their parameter's dtype."""
    program = _Program(prim_func)
    return program.bind(out_idx)


def run(prim_func, *arrays):
    """Run `prim_func` once on `arrays`, one per parameter, writing into them in place (each must
    already have its parameter's NumPy dtype, see NUMPY_DTYPES)."""
    _Program(prim_func).launch(list(arrays))


# ------------------------------------------------------------------------------------------ the program


class _Frame:
    """The interpreter's state while it runs: values of variables and buffers by slot, and the lanes.

    `mask` is True outside T.Parallel; inside, a boolean array (broadcastable against the lanes) that
    says which lanes execute the current statement. `lane_depth` counts the parallel loops entered.
    `filled` holds the slots of the allocated buffers found written in full since their allocation (or
    since a T.gemm or T.copy last marked elements of them): their reads need no check. `origins` says,
    for a buffer holding marked elements, which read of an unwritten element they come from.
    `lanes` holds the (name, slot) of the loop variables of the T.Parallel loops entered; `writers`,
    inside a T.Parallel nest that both writes and reads a buffer (or writes it twice), maps the slot of
    such a buffer to None until the nest stores into it, then to which lane of the nest wrote each
    element (_NO_LANE: none yet, _EVERY_LANE: several lanes, one value), so that a lane reading
    another's element, or writing over it, is caught. `unset` maps the slot of a `T.alloc_var` that
    has lanes nothing wrote yet to those lanes (True: all of them). In a block that reads its thread
    index, `threads` is the block's (x, y, z) thread counts and `thread_axes` is 1: the threads are
    the last axis of every value that depends on them, and T.Parallel's lanes sit before it.
    """

    __slots__ = ("values", "mask", "lane_depth", "filled", "origins", "lanes", "writers", "unset", "threads",
                 "thread_axes")

    def __init__(self, size):
        self.values = [None] * size
        self.mask = True
        self.lane_depth = 0
        self.filled = set()
        self.origins = {}
        self.lanes = []
        self.writers = {}
        self.unset = {}
        self.threads = (1, 1, 1)
        self.thread_axes = 0


_NO_LANE, _EVERY_LANE = -1, -2  # in _Frame.writers: no lane of the nest wrote the element, several did


def _tirx():
    import tilelang  # noqa: F401  (registers TileLang's ops with TVM)
    from tvm import tirx

    return tirx


class _Program:
    """`prim_func` compiled once into nested Python closures over a _Frame."""

    def __init__(self, prim_func):
        self.tirx = _tirx()
        self.func = prim_func
        self._script_lines = None
        self._statement = None  # the statement being compiled, for error messages
        self.written = set()  # slots of the buffers the program writes (copied back when out_idx is None)
        self.poisoned = set()  # slots of the float buffers the program allocates: they start as UNWRITTEN_BITS
        self.grid_vars = []  # (name, slot) of the block indices, for messages
        self.thread_slots = {}  # axis (0, 1, 2) -> slot of the thread index T.Kernel binds for it
        self.thread_dependent = set()  # slots of the thread indices and of the values bound from them
        self.uses_threads = False  # whether the program reads a thread index: then blocks run in thread mode
        self._parallel_nesting = 0  # T.Parallel loops around the statement being compiled
        self.slots = {}  # id-independent: TIR Vars and Buffers hash by their node
        self.buffers = {}  # slot -> tirx.Buffer
        self.params = [prim_func.buffer_map[p] if p in prim_func.buffer_map else p for p in prim_func.params]
        for buffer in self.params:
            if not isinstance(buffer, self.tirx.Buffer):
                raise UnsupportedConstruct(f"scalar parameter {buffer} (only tensor parameters are supported)")
            self._slot(buffer)
        self.body = self._stmt(prim_func.body)

    # ---- slots ----------------------------------------------------------------------------------

    def _slot(self, node):
        key = node.__chandle__()  # the node's address: every Python wrapper of one node shares it
        if key not in self.slots:
            self.slots[key] = len(self.slots)
            if isinstance(node, self.tirx.Buffer):
                self.buffers[self.slots[key]] = node
        return self.slots[key]

    # ---- errors ---------------------------------------------------------------------------------

    def _line_of(self, node):
        """The line of `node` in the program as TileLang parsed it, and that line's text."""
        if self._script_lines is None:
            self._script_lines = self.func.script().splitlines()
        # str(stmt) prints a declaration for every buffer the statement touches before the statement
        text = [line.strip() for line in str(node).splitlines()
                if line.strip() and not _DECLARATION.match(line.strip()) and not line.strip().startswith("#")]
        first = text[0] if text else ""
        for number, line in enumerate(self._script_lines, start=1):
            if first and first in line:
                return number, line.strip()
        return None, first

    def _unsupported(self, construct, node):
        number, text = self._line_of(node)
        if number is None and self._statement is not None:  # an expression: name its statement's line
            number, text = self._line_of(self._statement)
        where = f"line {number} of {self._name()}.script()" if number else "the program"
        source = self._source_line(node if isinstance(node, self.tirx.Stmt) else self._statement)
        return UnsupportedConstruct(f"the tile interpreter does not run {construct}, at {source}{where}: {text}")

    def _source_line(self, stmt):
        """'file.py:12 (the line), ' where TileLang recorded the Python line of `stmt`, else ''."""
        span = _span(stmt)
        if span is None:
            return ""
        import linecache

        name, line = span
        code = linecache.getline(name, line).strip()
        return f"{name}:{line} ({code}), " if code else f"{name}:{line}, "

    def _origin(self, frame, slot, element, statement, hint=""):
        """What to blame for the unwritten element `element` of the buffer in `slot`, read by `statement`:
        its own read (an _Origin), or, for a marked element, the read its T.gemm or T.copy came from."""
        value = frame.values[slot][tuple(int(i) for i in element)]
        if value.view(_UNSIGNED[value.dtype]) == TAINTED_BITS[value.dtype] and slot in frame.origins:
            return frame.origins[slot]
        blocks = ", ".join(f"{var} = {frame.values[var_slot]}" for var, var_slot in self.grid_vars)
        return _Origin(statement, slot, tuple(int(i) for i in element), hint, blocks)

    def _read_before_write(self, origin, used=None):
        """ReadBeforeWrite naming the read of `origin` (an _Origin) and, where the unwritten values went
        through a T.gemm or T.copy first, `used`: the (statement, slot, element) that used the result."""
        name, where, declared = self._described(origin.statement, origin.slot)
        message = (f"{where}: reads `{name}` before writing it: {name}{list(origin.element)} holds no value yet "
                   f"({declared}; in the block {origin.blocks}){origin.hint}")
        if used is not None:
            statement, slot, element = used
            used_name, used_where, _ = self._described(statement, slot)
            message += (f". The value computed from it reached `{used_name}`{list(map(int, element))}, used at "
                        f"{used_where}")
        return ReadBeforeWrite(f"{message} (read the interpreter page, \"{ReadBeforeWrite.section}\")")

    def _variable_read_before_write(self, frame, statement, buffer, hint=""):
        """ReadBeforeWrite for a `T.alloc_var` read (by `statement`) where nothing wrote it."""
        name = buffer.name
        span = _span(statement)
        line = _declaration_line(span[0], name, span[1]) if span is not None else None
        declared = f"the variable {name} (a T.alloc_var" + (f", declared at line {line})" if line else ")")
        blocks = ", ".join(f"{var} = {frame.values[var_slot]}" for var, var_slot in self.grid_vars)
        return ReadBeforeWrite(
            f"{self._where(statement)}: reads `{name}` before writing it: {declared} holds no value yet (in the "
            f"block {blocks}){hint}. On a GPU a variable is a register that holds whatever it held before: give it "
            f"its first value (`{name} = 0`, or T.alloc_var(dtype, init=0)) before the first read "
            f"(read the interpreter page, \"{ReadBeforeWrite.section}\")")

    def _described(self, statement, slot):
        """(the buffer's name, where `statement` is, the buffer's declaration), for messages."""
        buffer = self.buffers[slot]
        name = buffer.name
        scope = {"shared": "shared", "shared.dyn": "shared", "local.fragment": "fragment"}.get(buffer.scope(), "local")
        span = _span(statement)
        if span is not None:
            line = _declaration_line(span[0], name, span[1])
            return name, self._where(statement), f"the {scope} buffer {name}" + (f", declared at line {line}" if line else "")
        # a program without spans: the buffer's declaration as TileLang parsed it
        return name, self._where(statement), f"the {scope} buffer {name} of shape {list(_static_shape(buffer))} and {buffer.dtype}"

    def _where(self, statement):
        """Where `statement` is: 'file.py, line 12: `the line`' where TileLang recorded its Python line,
        else its line in the program as TileLang parsed it."""
        from stages.common.tilelang_tools import source_line

        span = _span(statement)
        if span is not None:
            return source_line(*span)
        number, text = self._line_of(statement)
        return f"line {number} of {self._name()}.script(): {text}" if number else f"the statement {text}"

    def _taught(self, kind, statement, problem):
        """A `kind` error (a class with a `section`): where `statement` is, the problem, what to read."""
        error = kind(f"{self._where(statement)}: {problem} (read the interpreter page, \"{kind.section}\")")
        error.located = True  # an enclosing statement leaves it as it is
        return error

    def _locate(self, error, statement):
        """`error` raised while `statement` ran, named with its line unless an inner part named one."""
        return error if getattr(error, "located", False) else self._taught(type(error), statement, str(error))

    # ---- launching ------------------------------------------------------------------------------

    def bind(self, out_idx):
        if out_idx is None:
            return self._in_place
        outputs = [out_idx] if isinstance(out_idx, int) else list(out_idx)
        outputs = [i % len(self.params) for i in outputs]

        def kernel(*inputs):
            expected = len(self.params) - len(outputs)
            if len(inputs) != expected:
                raise InterpreterError(f"{self._name()} takes {expected} inputs, got {len(inputs)}")
            supplied = iter(inputs)
            arrays = []
            for index, buffer in enumerate(self.params):
                if index in outputs:
                    arrays.append(self._empty(buffer))
                else:
                    arrays.append(self._as_param(index, next(supplied)))
            self.launch(arrays)
            results = [arrays[i] for i in outputs]
            return results[0] if len(results) == 1 else results

        return kernel

    def _in_place(self, *arrays):
        """Run on every parameter, then write what the program wrote back into the caller's arrays
        (the parameters it only reads are left as given, not replaced by their rounded copies)."""
        if len(arrays) != len(self.params):
            raise InterpreterError(f"{self._name()} takes {len(self.params)} arrays, got {len(arrays)}")
        copies = [self._as_param(i, a) for i, a in enumerate(arrays)]
        self.launch(copies)
        for buffer, given, result in zip(self.params, arrays, copies):
            if self._slot(buffer) not in self.written:
                continue
            if hasattr(given, "copy_"):  # a torch tensor
                import torch

                given.copy_(torch.from_numpy(result))
            else:
                given[...] = result

    def _name(self):
        attrs = self.func.attrs
        return str(attrs["global_symbol"]) if attrs is not None and "global_symbol" in attrs else "the program"

    def _empty(self, buffer):
        """An output the interpreter allocates: a float one starts as UNWRITTEN_BITS, so that an
        element the program never stores can be told apart from a NaN it computed (never_written)."""
        shape = _static_shape(buffer)
        dtype = NUMPY_DTYPES[str(buffer.dtype)]
        if np.dtype(dtype) in _UNSIGNED:
            return _unwritten_array(shape, dtype)
        return np.zeros(shape, dtype=dtype)

    def _as_param(self, index, array):
        buffer = self.params[index]
        if hasattr(array, "detach"):  # a torch tensor
            array = array.detach().cpu().float().numpy() if str(array.dtype) == "torch.bfloat16" else array.detach().cpu().numpy()
        array = np.asarray(array)
        shape = _static_shape(buffer)
        if array.shape != shape:
            raise InterpreterError(f"argument {index} ({buffer.name}) must have shape {shape}, got {array.shape}")
        return round_to_dtype(array, str(buffer.dtype)).copy()

    def launch(self, arrays):
        if len(arrays) != len(self.params):
            raise InterpreterError(f"{self._name()} takes {len(self.params)} arrays, got {len(arrays)}")
        frame = _Frame(len(self.slots))
        for buffer, array in zip(self.params, arrays):
            shape = _static_shape(buffer)
            if array.shape != shape or array.dtype != NUMPY_DTYPES[str(buffer.dtype)]:
                raise InterpreterError(
                    f"{buffer.name} must be a {NUMPY_DTYPES[str(buffer.dtype)].__name__} array of shape {shape}, "
                    f"got {array.dtype} {array.shape}")
            frame.values[self._slot(buffer)] = array
        # lanes masked off still compute (vectorized) and may divide by zero; a GPU does not warn
        # either: inf and NaN show in the outputs where they matter
        with np.errstate(all="ignore"):
            self.body(frame)

    # ---- statements -----------------------------------------------------------------------------

    def _stmt(self, node):
        outer, self._statement = self._statement, node
        try:
            return self._compile_stmt(node)
        finally:
            self._statement = outer

    def _compile_stmt(self, node):
        t = self.tirx
        handler = {
            t.SeqStmt: self._seq,
            t.SBlockRealize: self._block_realize,
            t.For: self._for,
            t.Bind: self._bind,
            t.BufferStore: self._store,
            t.IfThenElse: self._if,
            t.Evaluate: self._evaluate,
            t.AttrStmt: self._attr,
        }.get(type(node))
        if handler is None:
            if hasattr(t, "LetStmt") and isinstance(node, t.LetStmt):
                return self._let(node)
            raise self._unsupported(f"the statement {type(node).__name__}", node)
        return handler(node)

    def _seq(self, node):
        parts = [self._stmt(s) for s in node.seq]

        def run_seq(frame):
            for part in parts:
                part(frame)

        return run_seq

    def _attr(self, node):
        return self._stmt(node.body)

    def _block_realize(self, node):
        block = node.block
        allocations = [(self._slot(b), b) for b in block.alloc_buffers]
        for slot, buffer in allocations:
            _static_shape(buffer)  # raises for a symbolic shape
            if not _is_var(buffer) and NUMPY_DTYPES.get(str(buffer.dtype)) in (np.float16, np.float32, np.float64):
                self.poisoned.add(slot)
        init = self._stmt(block.init) if block.init is not None else None
        body = self._stmt(block.body)
        poisoned = self.poisoned
        launched = block.annotations.get("tl.launch_threads") if block.annotations is not None else None
        threads = tuple(int(n) for n in launched) + (1,) * (3 - len(launched)) if launched is not None else None

        def run_block(frame):
            if threads is not None and self.uses_threads:
                self._start_threads(frame, threads)
            for slot, buffer in allocations:
                dtype = NUMPY_DTYPES[str(buffer.dtype)]
                if _is_var(buffer):
                    frame.values[slot] = np.zeros((), dtype)  # its value is read only once `unset` lets it
                    frame.unset[slot] = True
                else:
                    shape = _static_shape(buffer)
                    frame.values[slot] = _unwritten_array(shape, dtype) if slot in poisoned else np.zeros(shape, dtype)
                    frame.filled.discard(slot)
                    frame.origins.pop(slot, None)
            if init is not None:
                init(frame)
            body(frame)
            if threads is not None:
                frame.thread_axes = 0

        return run_block

    def _start_threads(self, frame, threads):
        """Thread mode for the block about to run: each thread index an array over the block's threads,
        numbered x fastest, as CUDA numbers them."""
        x, y, z = threads
        thread = np.arange(x * y * z, dtype=np.int64)
        for axis, index in enumerate((thread % x, thread // x % y, thread // (x * y))):
            if axis in self.thread_slots:
                frame.values[self.thread_slots[axis]] = index
        frame.threads, frame.thread_axes = threads, 1

    def _bind(self, node):
        slot = self._slot(node.var)
        value = node.value
        if isinstance(value, self.tirx.Call) and str(value.op.name) == "tl.launch_thread_idx":
            self.thread_slots[_as_int(value.args[0])] = slot  # set by the block that launches the threads
            self.thread_dependent.add(slot)
            return lambda frame: None
        if self._reads_a_thread_index(value):
            self.thread_dependent.add(slot)
        evaluate = self._expr(value)

        def run_bind(frame):
            frame.values[slot] = evaluate(frame)

        return run_bind

    def _let(self, node):
        slot = self._slot(node.var)
        evaluate, body = self._expr(node.value), self._stmt(node.body)

        def run_let(frame):
            frame.values[slot] = evaluate(frame)
            body(frame)

        return run_let

    def _for(self, node):
        kind = int(node.kind)
        step = getattr(node, "step", None)  # TileLang's frontend rewrites T.serial(a, b, s) to a unit step
        if step is not None and _as_int(step) != 1:
            raise self._unsupported(f"a loop with step {step}", node)
        # ForKind: 0 serial, 1 parallel, 2 vectorized, 3 unrolled, 4 thread binding
        if kind == 4:
            return self._grid_loop(node)
        if kind in (1, 2):
            return self._parallel_loop(node)
        if kind in (0, 3):
            return self._serial_loop(node)
        raise self._unsupported(f"a loop of kind {kind}", node)

    def _grid_loop(self, node):
        tag = str(node.thread_binding.thread_tag)
        if tag.startswith("threadIdx"):
            return self._thread_loop(node, "xyz".index(tag[-1]))
        if not tag.startswith("blockIdx"):
            raise self._unsupported(f"a loop bound to {tag}", node)
        slot, extent = self._slot(node.loop_var), self._expr(node.extent)
        self.grid_vars.append((node.loop_var.name, slot))
        body, start = self._stmt(node.body), self._expr(node.min)

        def run_grid(frame):
            first = int(start(frame))
            for block_index in range(first, first + int(extent(frame))):
                frame.values[slot] = block_index
                body(frame)

        return run_grid

    def _thread_loop(self, node, axis):
        """`for t in T.thread_binding(n, "threadIdx.x")` in a kernel of n threads along x: t is the
        thread index, as T.get_thread_binding(0) gives it."""
        slot, extent, start = self._slot(node.loop_var), self._expr(node.extent), self._expr(node.min)
        self.uses_threads = True
        self.thread_dependent.add(slot)
        self._check_thread_index_outside_parallel(node.loop_var, node)
        body = self._stmt(node.body)
        name = node.loop_var.name

        def run_thread_loop(frame):
            count, first = frame.threads[axis], int(start(frame))
            if first != 0 or int(extent(frame)) != count:
                raise InterpreterError(
                    f"{self._where(node)}: the loop over {name} is bound to threadIdx.{'xyz'[axis]} from {first} to "
                    f"{first + int(extent(frame))}, but the kernel launches {count} threads along that axis: a loop "
                    f"bound to a thread index runs once in each thread, so its range is the threads' (0 to {count})")
            frame.values[slot] = frame.values[self.thread_slots[axis]]
            body(frame)

        return run_thread_loop

    def _serial_loop(self, node):
        slot, body = self._slot(node.loop_var), self._stmt(node.body)
        start, extent = self._expr(node.min), self._expr(node.extent)

        def run_serial(frame):
            first, count = start(frame), extent(frame)
            if np.ndim(first) == 0 and np.ndim(count) == 0:
                for i in range(int(first), int(first) + int(count)):
                    frame.values[slot] = i
                    body(frame)
                return
            # inside T.Parallel, a loop whose bounds differ per lane: each lane runs its own range
            first = np.asarray(first)
            end = first + np.asarray(count)
            outer_mask = frame.mask
            for i in range(int(np.min(first)), int(np.max(end))):
                active = outer_mask & (first <= i) & (i < end)
                if not np.any(active):
                    continue
                frame.mask = active
                frame.values[slot] = i
                body(frame)
            frame.mask = outer_mask

        return run_serial

    def _parallel_loop(self, node):
        slot = self._slot(node.loop_var)
        self._parallel_nesting += 1
        try:
            body = self._stmt(node.body)
        finally:
            self._parallel_nesting -= 1
        start, extent = self._expr(node.min), self._expr(node.extent)
        lane = (str(node.loop_var.name), slot)
        tracked = self._shared_between_lanes(node)

        def run_parallel(frame):
            first, count = start(frame), extent(frame)
            if np.ndim(first) or np.ndim(count):
                raise InterpreterError(f"T.Parallel over {node.loop_var}: its extent differs between lanes")
            depth = frame.lane_depth
            if depth == 0 and frame.mask is not True:
                raise InterpreterError(
                    f"{self._where(node)}: a T.Parallel loop under a condition on the thread index: T.Parallel "
                    f"spreads its lanes over all the block's threads, so every thread must reach it; move it out of "
                    f"the `if` (or the loop whose range depends on the thread)")
            # the threads, in thread mode, are the last axis: the lanes come before it
            lanes = np.arange(int(first), int(first) + int(count), dtype=np.int64).reshape(
                (int(count),) + (1,) * (depth + frame.thread_axes))
            frame.values[slot] = lanes
            frame.lane_depth = depth + 1
            frame.lanes.append(lane)
            if depth == 0 and tracked:  # the outermost loop of a nest: no lane has written anything yet
                frame.writers = dict.fromkeys(tracked)  # each made at the nest's first store into its buffer
            outer_mask = frame.mask
            body(frame)
            frame.mask = outer_mask
            frame.lane_depth = depth
            frame.lanes.pop()
            if depth == 0:
                frame.writers = {}

        return run_parallel

    def _shared_between_lanes(self, nest):
        """The slots of the shared and fragment buffers that the T.Parallel loop `nest` (and the loops in
        it) both writes and reads, or writes by two statements, where one lane may touch another's
        element. A buffer that every access indexes by the same lane variables on the same axes (X_s[r, d]
        and X_s[j, d], d the lane) is left out: a lane touches only elements that it or its replicas own."""
        t = self.tirx
        from tvm.tirx.stmt_functor import post_order_visit

        lane_vars, accesses, stores = set(), {}, {}

        def visit(node):
            if isinstance(node, t.For) and int(node.kind) in (1, 2):
                lane_vars.add(node.loop_var.__chandle__())
            elif isinstance(node, (t.BufferStore, t.BufferLoad)) and not _is_var(node.buffer) \
                    and node.buffer.scope() != "global":
                slot = self._slot(node.buffer)
                accesses.setdefault(slot, []).append(node.indices)
                if isinstance(node, t.BufferStore):
                    stores[slot] = stores.get(slot, 0) + 1

        post_order_visit(nest, visit)

        def lane_axes(indices):
            """((axis, lane variable), ...) of an access, or None where a lane variable sits in an expression."""
            found = []
            for axis, index in enumerate(indices):
                used = lanes_in(index)
                if used and not (isinstance(index, t.Var) and index.__chandle__() in lane_vars):
                    return None
                if used:
                    found.append((axis, index.__chandle__()))
            return tuple(found)

        def lanes_in(expression):
            used = []
            post_order_visit(expression, lambda e: used.append(e) if isinstance(e, t.Var) and e.__chandle__() in lane_vars
                             else None)
            return used

        tracked = []
        for slot, count in stores.items():
            if count < 2 and len(accesses[slot]) == count:  # written once, never read in the nest
                continue
            forms = {lane_axes(indices) for indices in accesses[slot]}
            if len(forms) > 1 or None in forms:
                tracked.append(slot)
        return sorted(tracked)

    # ---- lanes: who wrote what in a T.Parallel nest ---------------------------------------------

    @staticmethod
    def _lane_ids(frame):
        """Each lane of the current T.Parallel nest numbered, as an array over the lanes' axes."""
        shape = np.broadcast_shapes(*(np.shape(frame.values[slot]) for _, slot in frame.lanes))
        return np.arange(math.prod(shape), dtype=np.int64).reshape(shape)

    @staticmethod
    def _lane_text(frame, lane_id):
        """'i = 3, j = 0': the loop variables of the lane numbered `lane_id` (see _lane_ids)."""
        shape = np.broadcast_shapes(*(np.shape(frame.values[slot]) for _, slot in frame.lanes))
        position = np.unravel_index(int(lane_id), shape)
        return ", ".join(f"{name} = {int(np.broadcast_to(frame.values[slot], shape)[position])}"
                         for name, slot in frame.lanes)

    def _elements_by_lane(self, frame, slot, where, mask):
        """(flat indices into the buffer in `slot`, the lane of each) for the active lanes' `where`."""
        *where, lane, active = np.broadcast_arrays(*where, self._lane_ids(frame), mask)
        flat = np.ravel_multi_index([np.asarray(i, dtype=np.int64)[active] for i in where], frame.values[slot].shape)
        return flat, lane[active]

    def _record_writers(self, frame, slot, where, mask):
        """Note which lane writes each element `where` selects; LaneRace where another lane of this nest
        wrote it before (no barrier between two statements of one T.Parallel loop)."""
        writers = frame.writers[slot]
        if writers is None:
            writers = frame.writers[slot] = np.full(frame.values[slot].shape, _NO_LANE, dtype=np.int64)
        flat, lane = self._elements_by_lane(frame, slot, where, mask)
        before = writers.flat[flat]
        clash = (before >= 0) & (before != lane)
        if clash.any():
            k = int(np.argmax(clash))
            element = list(map(int, np.unravel_index(int(flat[k]), writers.shape)))
            raise LaneRace(
                f"{self.buffers[slot].name}{element}: the lane {self._lane_text(frame, lane[k])} writes it after the lane "
                f"{self._lane_text(frame, before[k])} wrote it in this same T.Parallel loop: on the GPU the two lanes are "
                f"threads that run at once, with no barrier inside the loop, and which write lands last is undefined; "
                f"write each element from one lane, or split the loop in two")
        writers.flat[flat] = lane
        writers.flat[np.flatnonzero(np.bincount(flat, minlength=writers.size) > 1)] = _EVERY_LANE  # one value: replicated

    def _check_own_lane(self, frame, slot, where, mask):
        """CrossLaneRead where a lane reads an element that another lane of this nest wrote."""
        writers = frame.writers[slot]
        if writers is None:  # the nest has not written the buffer yet
            return
        flat, lane = self._elements_by_lane(frame, slot, where, mask)
        writer = writers.flat[flat]
        crossed = (writer >= 0) & (writer != lane)
        if crossed.any():
            k = int(np.argmax(crossed))
            buffer = self.buffers[slot]
            element = list(map(int, np.unravel_index(int(flat[k]), writers.shape)))
            where_it_lives = ("lives in the registers of the thread that wrote it"
                              if buffer.scope() == "local.fragment" else "is in shared memory, with no barrier inside the loop")
            raise CrossLaneRead(
                f"the lane {self._lane_text(frame, lane[k])} reads {buffer.name}{element}, which the lane "
                f"{self._lane_text(frame, writer[k])} wrote in this same T.Parallel loop: the interpreter runs the loop "
                f"statement by statement, but on the GPU its lanes are threads that run at once, and that element "
                f"{where_it_lives}; have each lane read only what it wrote, or split the loop in two (TileLang puts a "
                f"barrier, or a layout that moves the values, between loops)")

    def _if(self, node):
        condition = self._expr(node.condition)
        then_case = self._stmt(node.then_case)
        else_case = self._stmt(node.else_case) if node.else_case is not None else None

        def run_if(frame):
            taken = condition(frame)
            if np.ndim(taken) == 0 and frame.mask is True:
                if taken:
                    then_case(frame)
                elif else_case is not None:
                    else_case(frame)
                return
            outer_mask = frame.mask
            frame.mask = outer_mask & taken
            if np.any(frame.mask):
                then_case(frame)
            if else_case is not None:
                frame.mask = outer_mask & ~np.asarray(taken, dtype=bool)
                if np.any(frame.mask):
                    else_case(frame)
            frame.mask = outer_mask

        return run_if

    def _store(self, node):
        buffer = node.buffer
        slot, dtype = self._slot(buffer), str(buffer.dtype)
        value = self._expr(node.value)
        self.written.add(slot)
        if _is_var(buffer):
            def run_var_store(frame):
                new = round_to_dtype(value(frame), dtype)
                if frame.mask is not True:
                    new = np.where(frame.mask, new, frame.values[slot])
                frame.values[slot] = new
                _mark_var_written(frame, slot)

            return run_var_store
        indices = [self._expr(i) for i in node.indices]
        name = buffer.name

        def run_store(frame):
            try:
                store(frame)
            except (OutOfRange, LaneRace) as error:
                raise self._locate(error, node) from None

        def store(frame):
            target = frame.values[slot]
            where = [i(frame) for i in indices]
            new = round_to_dtype(value(frame), dtype)
            mask = frame.mask
            if slot in frame.writers:
                self._record_writers(frame, slot, _check_bounds(name, target.shape, where, mask), mask)
            if mask is True:  # every lane stores: fancy assignment broadcasts indices and value
                where = tuple(_check_bounds(name, target.shape, where, True))
                try:
                    target[where] = new
                    return
                except ValueError:  # the value varies over lanes the index does not (a race): fall through
                    pass
            lanes_per_element = np.broadcast_shapes(*(np.shape(i) for i in where))
            *where, new, mask = np.broadcast_arrays(*where, new, mask)
            where = [i[mask] for i in where]
            _check_bounds(name, target.shape, where, True)
            values = new[mask]
            if math.prod(lanes_per_element) < mask.size:  # the index leaves out a lane axis
                _check_no_race(name, target.shape, where, values, frame.thread_axes and not frame.lane_depth)
            target[tuple(where)] = values

        return run_store

    def _evaluate(self, node):
        call = node.value
        if not isinstance(call, self.tirx.Call):
            return lambda frame: None
        op = str(call.op.name) if hasattr(call.op, "name") else str(call.op)
        if op in ("tirx.tvm_storage_sync", "tl.wait_wgmma", "tl.warpgroup_fence_operand", "tl.fence_proxy_async"):
            # T.sync_threads(), T.wait_wgmma(n), T.warpgroup_fence_operand(...), T.fence_proxy_async():
            # every statement here finishes before the next starts, and one memory serves every
            # proxy, so a barrier, a wait or a fence changes nothing (and a missing one cannot show:
            # see the module docstring)
            return lambda frame: None
        if op in ("tl.annotate_producer_reg_dealloc", "tl.annotate_consumer_reg_alloc", "tl.no_set_max_nreg"):
            # how many registers a warp group holds: where values live, not what they are
            return lambda frame: None
        handler = {
            "tl.tileop.copy": self._copy,
            "tl.tileop.gemm": self._gemm,
            "tl.tileop.wgmma_gemm": self._gemm,  # T.wgmma_gemm: T.gemm without its wait
            "tl.tileop.fill": self._fill,
            "tl.tileop.reduce": self._reduce,
            "tl.tileop.cumsum": self._cumsum,
            "tl.tileop.atomicadd": self._atomic_add_tile,
            "tl.atomic_add_elem_op": lambda call, node: self._atomic_element(call, node, np.add, "T.atomic_add"),
            "tl.atomic_max_elem_op": lambda call, node: self._atomic_element(call, node, np.maximum, "T.atomic_max"),
            "tl.atomic_min_elem_op": lambda call, node: self._atomic_element(call, node, np.minimum, "T.atomic_min"),
        }.get(op)
        if handler is None:
            raise self._unsupported(f"the operation {op}", node)
        return handler(call, node)

    # ---- tile operations ------------------------------------------------------------------------

    def _region(self, arg, node):
        """A `tl.region(load, access, *extents)` argument -> (slot, buffer, start closures, extents)."""
        parts = region_parts(arg, self.tirx)
        if parts is None:
            raise self._unsupported(f"a tile operand of type {type(arg).__name__}", node)
        load, extents = parts
        buffer = load.buffer
        if any(self._reads_a_thread_index(i) for i in load.indices):
            raise self._unsupported("a tile region whose start depends on the thread index (a tile operation is "
                                    "one operation of the whole block, the same region in every thread)", node)
        starts = [self._expr(i) for i in load.indices]
        sizes = [_as_int(e) for e in extents]
        if any(s is None for s in sizes):
            raise self._unsupported("a tile region of symbolic size", node)
        return self._slot(buffer), buffer, starts, sizes

    def _tile(self, frame, slot, starts, sizes, statement, used=None, hint=""):
        """The window `starts + sizes` of the buffer in `slot` (elements outside it read as 0), after
        checking that every element of it that the statement uses has been written: `used`, a boolean
        array of the window's shape, says which (all, by default)."""
        starts = [int(s(frame)) for s in starts]
        tile = _read_window(frame.values[slot], starts, sizes)
        unwritten = self._unwritten_part(frame, slot, starts, tile, statement, used, hint)
        if unwritten is not None:
            mask, origin = unwritten
            first = np.unravel_index(int(np.argmax(mask)), mask.shape)
            raise self._read_before_write(origin, None if origin.statement is statement else (
                statement, slot, np.add(starts, first)))
        return tile

    def _unwritten_part(self, frame, slot, starts, tile, statement, used=None, hint=""):
        """None where every element of `tile` (the window at `starts` of the buffer in `slot`) that
        `used` selects has been written; else (the mask of those that have not, their _Origin)."""
        if slot not in self.poisoned or slot in frame.filled or self._filled(frame, slot):
            return None
        mask = _unwritten(tile)
        if used is not None:
            mask &= used
        if not mask.any():
            return None
        first = np.unravel_index(int(np.argmax(mask)), mask.shape)
        return mask, self._origin(frame, slot, np.add(starts, first), statement, hint)

    @staticmethod
    def _filled(frame, slot):
        """Whether every element of the allocated buffer in `slot` has been written (then remembered in
        frame.filled, so that its later reads cost nothing: a buffer is checked whole about once)."""
        if _unwritten(frame.values[slot]).any():
            return False
        frame.filled.add(slot)
        return True

    def _carry_unwritten(self, frame, slot, result, mask, origin):
        """Mark the elements of `result` (about to be written into the buffer in `slot`) that `mask`
        selects as computed from unwritten ones, blaming `origin` (the first such read is kept)."""
        _taint(result, mask)
        frame.filled.discard(slot)
        frame.origins.setdefault(slot, origin)

    def _tile_guard(self, frame, what):
        if frame.lane_depth:
            raise InterpreterError(f"{what} inside T.Parallel: tile operations run once per block")
        if frame.mask is not True:
            raise InterpreterError(f"{what} under a condition on the thread index: a tile operation is run by all "
                                   f"the block's threads together, so every thread must reach it; move it out of "
                                   f"the `if`")

    def _copy(self, call, node):
        src_slot, src, src_starts, src_sizes = self._region(call.args[0], node)
        dst_slot, dst, dst_starts, dst_sizes = self._region(call.args[1], node)
        src_tile, dst_tile = [s for s in src_sizes if s != 1], [s for s in dst_sizes if s != 1]
        if src_tile != dst_tile:
            raise self._taught(TileShapeMismatch, node, (
                f"T.copy moves {src_sizes} ({src.name}) into {dst_sizes} ({dst.name}): the two regions of a copy must "
                f"have one shape (axes of size 1 aside); slice the larger one, or give the buffer the tile's shape"))
        dtype = str(dst.dtype)
        self.written.add(dst_slot)

        carries = dst_slot in self.poisoned  # into a shared or fragment buffer: unwritten elements go along

        def run_copy(frame):
            self._tile_guard(frame, "T.copy")
            starts = [int(s(frame)) for s in dst_starts]
            if carries:
                source_starts = [int(s(frame)) for s in src_starts]
                tile = _read_window(frame.values[src_slot], source_starts, src_sizes)
                unwritten = self._unwritten_part(frame, src_slot, source_starts, tile, node)
                tile = round_to_dtype(tile.reshape(dst_sizes), dtype)
                if unwritten is not None:
                    self._carry_unwritten(frame, dst_slot, tile, unwritten[0].reshape(dst_sizes), unwritten[1])
                _write_window(frame.values[dst_slot], starts, tile)
                return
            landing = None  # the source elements that land inside the destination: the others are dropped
            inside, local = _window_slices(frame.values[dst_slot].shape, starts, dst_sizes)
            if inside is None or any(s.stop - s.start != n for s, n in zip(local, dst_sizes)):
                landing = np.zeros(dst_sizes, dtype=bool)
                if inside is not None:
                    landing[local] = True
                landing = landing.reshape(src_sizes)
            tile = self._tile(frame, src_slot, src_starts, src_sizes, node, used=landing)
            _write_window(frame.values[dst_slot], starts, round_to_dtype(tile.reshape(dst_sizes), dtype))

        return run_copy

    def _fill(self, call, node):
        slot, buffer, starts, sizes = self._region(call.args[0], node)
        value, dtype = self._expr(call.args[1]), str(buffer.dtype)
        self.written.add(slot)

        def run_fill(frame):
            self._tile_guard(frame, "T.fill")
            if _is_var(buffer):
                frame.values[slot] = round_to_dtype(value(frame), dtype)
                _mark_var_written(frame, slot)
                return
            tile = np.full(sizes, round_to_dtype(value(frame), dtype), dtype=NUMPY_DTYPES[dtype])
            _write_window(frame.values[slot], [int(s(frame)) for s in starts], tile)

        return run_fill

    def _atomic_element(self, call, node, combine, what):
        """`T.atomic_add(X[i], value)` (and T.atomic_max, T.atomic_min): every lane or thread that
        executes it combines its value into its element, one after another, so lanes that share an
        element all count (an `X[i] = X[i] + value` keeps one of them)."""
        pointer = call.args[0]
        if not (isinstance(pointer, self.tirx.Call) and str(pointer.op.name) == "tl.access_ptr"
                and isinstance(pointer.args[0], self.tirx.BufferLoad)):
            raise self._unsupported(f"{what} on {pointer}", node)
        load = pointer.args[0]
        buffer = load.buffer
        slot, name, dtype = self._slot(buffer), buffer.name, str(buffer.dtype)
        if _is_var(buffer):
            raise self._unsupported(f"{what} on the variable {name}", node)
        indices, value = [self._expr(i) for i in load.indices], self._expr(call.args[1])
        self.written.add(slot)

        def run_atomic(frame):
            target = frame.values[slot]
            try:
                where = _check_bounds(name, target.shape, [i(frame) for i in indices], frame.mask)
            except OutOfRange as error:
                raise self._locate(error, node) from None
            *where, values, active = np.broadcast_arrays(*where, round_to_dtype(value(frame), dtype), frame.mask)
            elements = tuple(np.asarray(i, dtype=np.int64)[active] for i in where)
            values = values[active]
            if target.dtype in _UNSIGNED:
                unwritten = _unwritten(target[elements])
                if np.any(unwritten):
                    element = [int(i[np.argmax(unwritten)]) for i in elements]
                    raise ReadBeforeWrite(
                        f"{self._where(node)}: {what} combines into {name}{element}, which holds no value yet: an "
                        f"atomic reads the element it adds into, so the element needs its start before the first "
                        f"atomic (an output of the launch: zeros passed in, not allocated by out_idx) (read the "
                        f"interpreter page, \"{ReadBeforeWrite.section}\")")
            if dtype == "bfloat16":  # bf16 has no NumPy type: round after each combination, as the GPU does
                for k in range(values.size):
                    element = tuple(int(i[k]) for i in elements)
                    target[element] = round_to_dtype(combine(target[element], values[k]), dtype)
                return
            combine.at(target, elements, values)

        return run_atomic

    def _atomic_add_tile(self, call, node):
        """`T.atomic_add(X[region], tile)`: the tile added into the region, element by element."""
        src_slot, src, src_starts, src_sizes = self._region(call.args[0], node)
        dst_slot, dst, dst_starts, dst_sizes = self._region(call.args[1], node)
        if [s for s in src_sizes if s != 1] != [s for s in dst_sizes if s != 1]:
            raise self._taught(TileShapeMismatch, node, (
                f"T.atomic_add adds {src_sizes} ({src.name}) into {dst_sizes} ({dst.name}): the two regions must "
                f"have one shape (axes of size 1 aside)"))
        dtype = str(dst.dtype)
        self.written.add(dst_slot)

        def run_atomic_add(frame):
            self._tile_guard(frame, "T.atomic_add")
            tile = self._tile(frame, src_slot, src_starts, src_sizes, node).reshape(dst_sizes)
            starts = [int(s(frame)) for s in dst_starts]
            before = _read_window(frame.values[dst_slot], starts, dst_sizes)
            if before.dtype in _UNSIGNED and np.any(_unwritten(before)):
                first = [int(i) for i in np.add(starts, np.unravel_index(int(np.argmax(_unwritten(before))), before.shape))]
                raise ReadBeforeWrite(
                    f"{self._where(node)}: T.atomic_add adds into {dst.name}{first}, which holds no value yet: the "
                    f"region an atomic adds into needs its start before the first atomic (read the interpreter "
                    f"page, \"{ReadBeforeWrite.section}\")")
            _write_window(frame.values[dst_slot], starts, round_to_dtype(before + tile.astype(before.dtype), dtype))

        return run_atomic_add

    def _matrix(self, frame, slot, starts, sizes, shape, statement, hint=""):
        """The operand in the window `starts + sizes` of the buffer in `slot` as a `shape` matrix, and
        None or (the mask of its unwritten elements, their _Origin)."""
        starts = [int(s(frame)) for s in starts]
        tile = _read_window(frame.values[slot], starts, sizes)
        if tile.size != shape[0] * shape[1]:
            raise self._taught(TileShapeMismatch, statement, (
                f"T.gemm: the region {sizes} of {self.buffers[slot].name} is not the {shape[0]} x {shape[1]} operand "
                f"that the GEMM's M, N, K and transpose flags ask for"))
        unwritten = self._unwritten_part(frame, slot, starts, tile, statement, hint=hint)
        if unwritten is not None:
            unwritten = unwritten[0].reshape(shape), unwritten[1]
        return tile.reshape(shape), unwritten

    def _gemm(self, call, node):
        args = call.args
        a_slot, a, a_starts, a_sizes = self._region(args[0], node)
        b_slot, b, b_starts, b_sizes = self._region(args[1], node)
        c_slot, c, c_starts, c_sizes = self._region(args[2], node)
        transpose_a, transpose_b = bool(_as_int(args[3])), bool(_as_int(args[4]))
        # the operands' 2-D shapes from the call's M, N, K (a region may carry unit axes anywhere)
        M, N, K = (_as_int(x) for x in args[5:8])
        if None in (M, N, K):
            raise self._unsupported("T.gemm of symbolic M, N, K", node)
        a_shape, b_shape = ((K, M) if transpose_a else (M, K)), ((N, K) if transpose_b else (K, N))
        clear_accum = self._expr(args[9])
        operand_dtypes = {str(a.dtype), str(b.dtype)}
        c_dtype = str(c.dtype)
        self.written.add(c_slot)

        def operand(tile, dtype):
            if dtype == "float32":
                return _to_tf32(tile)
            return tile.astype(np.float64 if dtype == "float64" else np.float32)

        def run_gemm(frame):
            self._tile_guard(frame, "T.gemm")
            lhs, lhs_unwritten = self._matrix(frame, a_slot, a_starts, a_sizes, a_shape, node)
            rhs, rhs_unwritten = self._matrix(frame, b_slot, b_starts, b_sizes, b_shape, node)
            lhs, rhs = operand(lhs, str(a.dtype)), operand(rhs, str(b.dtype))
            lhs = lhs.T if transpose_a else lhs
            rhs = rhs.T if transpose_b else rhs
            if int(np.prod(c_sizes)) != M * N:
                raise self._taught(TileShapeMismatch, node, (
                    f"T.gemm shapes: {a.name} {lhs.shape} x {b.name} {rhs.shape} does not fit {c.name} {c_sizes}"))
            product = lhs @ rhs
            starts = [int(s(frame)) for s in c_starts]
            accumulator_unwritten = None
            if not clear_accum(frame):
                accumulator, accumulator_unwritten = self._matrix(frame, c_slot, c_starts, c_sizes, (M, N), node,
                                                                  hint=_ACCUMULATES)
                product = product + accumulator.astype(product.dtype)
            result = round_to_dtype(product, c_dtype)
            if lhs_unwritten or rhs_unwritten or accumulator_unwritten:
                # an unwritten element of A reaches its row of C, one of B its column, one of C itself
                reached = np.zeros((M, N), dtype=bool)
                if lhs_unwritten:
                    reached |= (lhs_unwritten[0].T if transpose_a else lhs_unwritten[0]).any(axis=1)[:, None]
                if rhs_unwritten:
                    reached |= (rhs_unwritten[0].T if transpose_b else rhs_unwritten[0]).any(axis=0)[None, :]
                if accumulator_unwritten:
                    reached |= accumulator_unwritten[0]
                origin = next(u[1] for u in (lhs_unwritten, rhs_unwritten, accumulator_unwritten) if u)
                self._carry_unwritten(frame, c_slot, result, reached, origin)
            _write_window(frame.values[c_slot], starts, result.reshape(c_sizes))

        if operand_dtypes - {"float16", "bfloat16", "float32", "float64"}:
            raise self._unsupported(f"T.gemm on {sorted(operand_dtypes)} operands", node)
        return run_gemm

    def _reduce(self, call, node):
        src_slot, src, src_starts, src_sizes = self._region(call.args[0], node)
        dst_slot, dst, dst_starts, dst_sizes = self._region(call.args[1], node)
        kind = str(call.args[2].value) if hasattr(call.args[2], "value") else str(call.args[2])
        dim = _as_int(call.args[3])
        clear = self._expr(call.args[4])
        reducers = {
            "sum": (np.sum, np.add), "max": (np.max, np.maximum), "min": (np.min, np.minimum),
            "abssum": (lambda x, axis: np.sum(np.abs(x), axis=axis), np.add),
            "absmax": (lambda x, axis: np.max(np.abs(x), axis=axis), np.maximum),
        }
        if kind not in reducers:
            raise self._unsupported(f"T.reduce of kind {kind!r}", node)
        reduce_all, combine = reducers[kind]
        dtype = str(dst.dtype)
        self.written.add(dst_slot)

        def run_reduce(frame):
            self._tile_guard(frame, f"T.reduce_{kind}")
            tile = self._tile(frame, src_slot, src_starts, src_sizes, node)
            reduced = reduce_all(tile.astype(np.float32 if tile.dtype == np.float16 else tile.dtype), axis=dim)
            starts = [int(s(frame)) for s in dst_starts]
            if _is_var(dst):
                cleared = clear(frame)
                if not cleared and _lanes_meet(frame.unset.get(dst_slot, False), frame.mask):
                    raise self._variable_read_before_write(frame, node, dst, _ACCUMULATES)
                old = frame.values[dst_slot]
                frame.values[dst_slot] = round_to_dtype(reduced if cleared else combine(old, reduced), dtype)
                _mark_var_written(frame, dst_slot)
                return
            reduced = reduced.reshape(dst_sizes)
            if not clear(frame):
                reduced = combine(self._tile(frame, dst_slot, dst_starts, dst_sizes, node, hint=_ACCUMULATES), reduced)
            _write_window(frame.values[dst_slot], starts, round_to_dtype(reduced, dtype))

        return run_reduce

    def _cumsum(self, call, node):
        src_slot, src, src_starts, src_sizes = self._region(call.args[0], node)
        dst_slot, dst, dst_starts, dst_sizes = self._region(call.args[1], node)
        dim, reverse = _as_int(call.args[2]), bool(_as_int(call.args[3]))
        dtype = str(dst.dtype)
        self.written.add(dst_slot)

        def run_cumsum(frame):
            self._tile_guard(frame, "T.cumsum")
            tile = self._tile(frame, src_slot, src_starts, src_sizes, node)
            if reverse:
                summed = np.flip(np.cumsum(np.flip(tile, dim), axis=dim, dtype=tile.dtype), dim)
            else:
                summed = np.cumsum(tile, axis=dim, dtype=tile.dtype)
            _write_window(frame.values[dst_slot], [int(s(frame)) for s in dst_starts],
                          round_to_dtype(summed.reshape(dst_sizes), dtype))

        return run_cumsum

    # ---- expressions ----------------------------------------------------------------------------

    def _expr(self, node):
        """`node` as a closure frame -> value (a NumPy scalar or an array over the lanes)."""
        t = self.tirx
        if isinstance(node, (int, float, bool)):
            return lambda frame, value=node: value
        if isinstance(node, t.IntImm):
            value = bool(node.value) if str(node.dtype) == "bool" else int(node.value)
            return lambda frame: value
        if isinstance(node, t.FloatImm):
            value = round_to_dtype(node.value, str(node.dtype))[()]
            return lambda frame: value
        if isinstance(node, t.StringImm):
            value = node.value
            return lambda frame: value
        if isinstance(node, t.Var):
            return self._var(node)
        if isinstance(node, t.BufferLoad):
            return self._load(node)
        if isinstance(node, t.Cast):
            inner, dtype = self._expr(node.value), str(node.dtype)
            return lambda frame: round_to_dtype(inner(frame), dtype)
        binary = _BINARY.get(type(node).__name__)
        if binary is not None:
            return self._binary(node, binary)
        if isinstance(node, t.Not):
            inner = self._expr(node.a)
            return lambda frame: np.logical_not(inner(frame))
        if isinstance(node, t.Select):
            return self._select(node.condition, node.true_value, node.false_value)
        if isinstance(node, t.Call):
            return self._call(node)
        if isinstance(node, t.Let):
            slot, value, body = self._slot(node.var), self._expr(node.value), self._expr(node.body)

            def run_let(frame):
                frame.values[slot] = value(frame)
                return body(frame)

            return run_let
        raise self._unsupported(f"the expression {type(node).__name__}", node)

    def _var(self, node):
        slot = self._slot(node)
        if slot in self.thread_dependent:
            self.uses_threads = True
            self._check_thread_index_outside_parallel(node, self._statement or node)
        name = node.name

        def read_var(frame):
            value = frame.values[slot]
            if value is None:
                raise InterpreterError(f"variable {name} is read before it is bound")
            return value

        return read_var

    def _check_thread_index_outside_parallel(self, var, node):
        if self._parallel_nesting:
            raise self._unsupported(
                f"the thread index {var.name} (or a value bound from it) inside T.Parallel: T.Parallel spreads its "
                f"lanes over the threads itself, so index by the loop's variables there, or write the loop as "
                f"`for ... in T.serial(...)` in each thread", node)

    def _reads_a_thread_index(self, expression):
        """Whether `expression` reads a thread index, or a variable bound from one."""
        from tvm.tirx.stmt_functor import post_order_visit

        found = []
        post_order_visit(expression, lambda e: found.append(e) if isinstance(e, self.tirx.Var)
                         and self.slots.get(e.__chandle__()) in self.thread_dependent else None)
        return bool(found)

    def _load(self, node):
        buffer = node.buffer
        slot, name = self._slot(buffer), buffer.name
        if _is_var(buffer):
            statement = self._statement

            def read_var(frame):
                unset = frame.unset.get(slot)
                if unset is not None and _lanes_meet(unset, frame.mask):
                    raise self._variable_read_before_write(frame, statement, buffer)
                return frame.values[slot]

            return read_var
        indices = [self._expr(i) for i in node.indices]
        statement = self._statement

        def checked_indices(frame, source):
            """The indices, inside the buffer; from the lane that wrote the element, in a T.Parallel nest."""
            try:
                where = _check_bounds(name, source.shape, [i(frame) for i in indices], frame.mask)
                if slot in frame.writers:
                    self._check_own_lane(frame, slot, where, frame.mask)
                return where
            except (OutOfRange, CrossLaneRead) as error:
                raise self._locate(error, statement) from None

        if slot not in self.poisoned:
            def read(frame):
                source = frame.values[slot]
                return source[tuple(checked_indices(frame, source))]

            return read

        def read_written(frame):
            source = frame.values[slot]
            where = checked_indices(frame, source)
            values = source[tuple(where)]
            if slot in frame.filled or self._filled(frame, slot):
                return values
            unwritten = _unwritten(values)
            if unwritten.any() and np.any(unwritten & frame.mask):  # lanes that do not execute may read anything
                *where, active = np.broadcast_arrays(*where, unwritten & frame.mask)
                first = np.unravel_index(int(np.argmax(active)), active.shape)
                element = [int(index[first]) for index in where]
                origin = self._origin(frame, slot, element, statement)
                raise self._read_before_write(origin, None if origin.statement is statement else (
                    statement, slot, element))
            return values

        return read_written

    def _binary(self, node, operator):
        a, b, dtype = self._expr(node.a), self._expr(node.b), str(node.dtype)
        if dtype == "bool":
            return lambda frame: operator(a(frame), b(frame))
        if dtype.startswith(("int", "uint")):
            if type(node).__name__ == "Div":  # TIR's integer Div truncates toward zero
                return lambda frame: _truncating_divide(a(frame), b(frame))
            return lambda frame: operator(a(frame), b(frame))
        return lambda frame: round_to_dtype(operator(a(frame), b(frame)), dtype)

    def _select(self, condition, true_value, false_value):
        condition, when_true, when_false = self._expr(condition), self._expr(true_value), self._expr(false_value)

        def select(frame):
            taken = condition(frame)
            if np.ndim(taken) == 0:
                return when_true(frame) if taken else when_false(frame)
            outer_mask = frame.mask
            frame.mask = outer_mask & taken  # each branch is read only where it is taken
            yes = when_true(frame) if np.any(frame.mask) else 0
            frame.mask = outer_mask & ~taken
            no = when_false(frame) if np.any(frame.mask) else 0
            frame.mask = outer_mask
            return np.where(taken, yes, no)

        return select

    def _call(self, node):
        op = str(node.op.name) if hasattr(node.op, "name") else str(node.op)
        name = op.split(".")[-1]
        dtype = str(node.dtype)
        if name == "if_then_else":
            return self._select(*node.args)
        if name == "infinity":
            value = round_to_dtype(np.inf, dtype)[()]
            return lambda frame: value
        if name in ("max_value", "min_value"):
            value = np.finfo(NUMPY_DTYPES[dtype]).max if name == "max_value" else np.finfo(NUMPY_DTYPES[dtype]).min
            value = round_to_dtype(value, dtype)[()]
            return lambda frame: value
        function = _MATH.get(name)
        if function is None or op.startswith("tl."):
            raise self._unsupported(f"the call {op}", node)
        args = [self._expr(a) for a in node.args]

        def call(frame):
            # compute in float32 (fp16 and bf16 inputs too), then round to the call's dtype
            values = [np.asarray(a(frame), dtype=np.float64 if dtype == "float64" else np.float32) for a in args]
            with np.errstate(all="ignore"):
                return round_to_dtype(function(*values), dtype)

        return call


# ------------------------------------------------------------------------------------------ helpers


def _is_var(buffer):
    return buffer.scope() == "local.var"


def _as_int(value):
    if isinstance(value, (int, bool)):
        return int(value)
    if hasattr(value, "value") and not isinstance(value.value, str):
        return int(value.value)
    return None


def _static_shape(buffer):
    shape = tuple(_as_int(s) for s in buffer.shape)
    if any(s is None for s in shape):
        raise UnsupportedConstruct(f"buffer {buffer.name} of symbolic shape {list(buffer.shape)}")
    return shape


def _mark_var_written(frame, slot):
    """A store into the variable in `slot` by the lanes of frame.mask: those lanes now hold a value."""
    unset = frame.unset.get(slot)
    if unset is None:
        return
    if frame.mask is True:
        del frame.unset[slot]
        return
    remaining = np.logical_and(unset, np.logical_not(frame.mask))
    if remaining.any():
        frame.unset[slot] = remaining
    else:
        del frame.unset[slot]


def _lanes_meet(unset, mask):
    """Whether a lane that executes (`mask`: True, or an array over the lanes) is one of the lanes of a
    variable that hold no value yet (`unset`: True, False or such an array)."""
    if unset is False:
        return False
    return bool(np.any(unset if mask is True else np.logical_and(unset, mask)))


def _truncating_divide(a, b):
    quotient = np.abs(a) // np.abs(b)
    return np.where((np.asarray(a) < 0) != (np.asarray(b) < 0), -quotient, quotient)


def _check_bounds(name, shape, where, mask):
    """Raise for an index outside `shape` on an active lane; return indices safe to gather with.

    The hottest function of the interpreter (every load and store): ndarray methods, not np.min."""
    if len(where) != len(shape):
        raise InterpreterError(f"{name}: {len(where)} indices for a buffer of rank {len(shape)}")
    safe = []
    for axis, (index, size) in enumerate(zip(where, shape)):
        if type(index) is not np.ndarray or index.ndim == 0:
            if not 0 <= index < size and (mask is True or np.any(mask)):
                raise OutOfRange(f"{name}: index {int(index)} is outside axis {axis} of size {size}")
            safe.append(int(index))
            continue
        if index.size and (index.min() < 0 or index.max() >= size):
            outside = (index < 0) | (index >= size)
            if np.any(outside & mask):
                # the mask may span more lanes than this index varies over: broadcast both
                index_b, bad_b = np.broadcast_arrays(index, outside & mask)
                bad = index_b[bad_b][0]
                raise OutOfRange(f"{name}: index {int(bad)} is outside axis {axis} of size {size}")
            index = np.clip(index, 0, size - 1)  # lanes that do not execute read any valid element
        safe.append(index)
    return safe


def _check_no_race(name, shape, where, values, threads=False):
    """Raise if lanes of one T.Parallel (`threads`: threads of one block) store different values into one
    element: on a GPU which lane wins is undefined. Lanes that store the same value (a flag, say) are
    no race."""
    flat = np.ravel_multi_index([np.asarray(i, dtype=np.int64) for i in where], shape)
    order = np.argsort(flat, kind="stable")
    flat, values = flat[order], values[order]
    same_element = flat[1:] == flat[:-1]
    before, after = values[:-1], values[1:]
    differ = before != after
    if np.issubdtype(values.dtype, np.floating):
        differ &= ~(np.isnan(before) & np.isnan(after))
    clash = same_element & differ
    if np.any(clash):
        element = np.unravel_index(int(flat[1:][clash][0]), shape)
        if threads:
            raise LaneRace(
                f"{name}{list(map(int, element))}: threads of the block store different values into this element in "
                f"one statement (a race on the GPU: which thread's store lands last is undefined); give each thread "
                f"its own element, or combine them with T.atomic_add")
        raise LaneRace(
            f"{name}{list(map(int, element))}: lanes of one T.Parallel store different values into this element "
            f"(a race on the GPU: which lane wins is undefined); give each lane its own element, or reduce "
            f"with T.reduce_* / a serial loop")


def _window_slices(shape, starts, sizes):
    """The part of the window starts + [0, sizes) inside an array of `shape`, on both sides."""
    inside, local = [], []
    for start, size, length in zip(starts, sizes, shape):
        lo, hi = max(start, 0), min(start + size, length)
        if hi <= lo:
            return None, None
        inside.append(slice(lo, hi))
        local.append(slice(lo - start, hi - start))
    return tuple(inside), tuple(local)


def _read_window(array, starts, sizes):
    """array[starts : starts + sizes]; elements outside the array read as 0 (a guarded load)."""
    if len(starts) != array.ndim:
        raise InterpreterError(f"a region of rank {len(starts)} on a buffer of rank {array.ndim}")
    inside, local = _window_slices(array.shape, starts, sizes)
    if inside is not None and all(s.stop - s.start == n for s, n in zip(local, sizes)):
        return array[inside].copy()
    tile = np.zeros(sizes, dtype=array.dtype)
    if inside is not None:
        tile[local] = array[inside]
    return tile


def _write_window(array, starts, tile):
    """array[starts : starts + tile.shape] = tile; elements outside the array are dropped."""
    inside, local = _window_slices(array.shape, starts, tile.shape)
    if inside is not None:
        array[inside] = tile[local]


def _span(stmt):
    """(file, line) where TileLang recorded the Python line of `stmt` (it stamps statements with their
    source span by default), else None."""
    try:
        from tilelang.ir import get_stmt_span

        span = get_stmt_span(stmt) if stmt is not None else None
    except (ImportError, AttributeError, TypeError):  # an older TileLang, or a node without a span
        return None
    if span is None or not span.line or span.source_name is None:
        return None
    return str(span.source_name.name), int(span.line)


def _declaration_line(path, name, used_at):
    """The line of `path` where `name = T.alloc_...(...)` declares a buffer, the last such line before
    `used_at` (a file may hold several programs), or None."""
    import linecache

    declaration = re.compile(rf"^\s*{re.escape(name)}\s*=\s*T\.alloc_")
    found = None
    for number, line in enumerate(linecache.getlines(path)[:used_at], start=1):
        if declaration.match(line):
            found = number
    return found


class _Origin:
    """The first read of an unwritten element that a run met: the statement, the buffer's slot, the
    element, a hint for the message, and the block indices as text."""

    __slots__ = ("statement", "slot", "element", "hint", "blocks")

    def __init__(self, statement, slot, element, hint, blocks):
        self.statement, self.slot, self.element, self.hint, self.blocks = statement, slot, element, hint, blocks


# A tile operation that adds into its destination reads it first.
_ACCUMULATES = ": T.gemm without clear_accum=True adds into what its C holds, and T.reduce with clear=False too"


def _rsqrt(x):
    return 1.0 / np.sqrt(x)


# `X = T.Buffer(...)`, `tx = T.int32()`: the declarations str(stmt) prints above a statement (a statement
# itself prints as `X[i] = ...`, `x: T.int32 = ...` or a call, never as `name = T.`)
_DECLARATION = re.compile(r"^[A-Za-z_][A-Za-z0-9_]* = T\.")

_BINARY = {
    "Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.true_divide,
    "FloorDiv": np.floor_divide, "FloorMod": np.mod, "Mod": np.fmod,
    "Min": np.minimum, "Max": np.maximum,
    "EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal, "GT": np.greater, "GE": np.greater_equal,
    "And": np.logical_and, "Or": np.logical_or,
}

_MATH = {
    "exp": np.exp, "exp2": np.exp2, "exp10": lambda x: np.power(np.float32(10), x), "log": np.log,
    "log2": np.log2, "log10": np.log10, "log1p": np.log1p, "expm1": np.expm1,
    "sqrt": np.sqrt, "rsqrt": _rsqrt, "fabs": np.abs, "abs": np.abs,
    "floor": np.floor, "ceil": np.ceil, "round": np.rint, "nearbyint": np.rint, "trunc": np.trunc,
    "sin": np.sin, "cos": np.cos, "tan": np.tan, "tanh": np.tanh, "sigmoid": lambda x: 1 / (1 + np.exp(-x)),
    "pow": np.power, "fmod": np.fmod, "erf": None, "isnan": np.isnan, "isinf": np.isinf,
    "isfinite": np.isfinite,
}
_MATH = {name: f for name, f in _MATH.items() if f is not None}
