"""What a TileLang program computes and moves, counted from the program itself, without a GPU.

The count reads the program as TileLang parses it, before lowering (the TIR that
stages.common.interpreter runs): the grid as loops bound to blockIdx, tile operations as calls, and
`T.Parallel` loops as parallel `For` nodes. It walks that program once, and every statement runs as
often as the loops around it and the grid say:

- **GEMM FLOPs**: each `T.gemm` (`tl.tileop.gemm`) is 2 M N K floating-point operations, by the dtype
  of its operands (float32 operands run as TF32 on Hopper's tensor cores);
- **bytes**: each `T.copy` (`tl.tileop.copy`) with a global side moves its region's elements at the
  global buffer's width (read from the source, written to the destination); `T.fill`, `T.reduce`
  and `T.cumsum` likewise; each element a statement loads from or stores to a global buffer directly
  (`O[b, t0 + r, h, d] = ...` in a `T.Parallel` loop) is one read or one write per lane;
- **element-wise FLOPs**: each floating-point +, -, *, /, min, max or math call (exp2 say) in a
  statement counts once per lane (a `T.if_then_else` counts both its branches): the work of the CUDA
  cores, beside the tensor cores';
- **shared memory**: the bytes of the buffers a program allocates in shared memory (`T.alloc_shared`),
  per block, as the program declares them: the compile report's figure (stages.common.tilelang_tools)
  adds what lowering adds, a pipelined loop's extra copies of the buffers its `T.copy`s fill.

A loop whose extent depends on an outer loop (`for j in T.serial(r)`) and an `if` on loop variables
(`if j < r`) are counted exactly: every loop variable becomes one axis of a NumPy array of index
values, and an `if` masks it. The bytes are those the program asks of global memory; a read that
another program of the grid also makes counts again (the L2 cache may serve it, not DRAM). What the
count cannot see: conditions that read a buffer (refused with CostError where their branches move
global bytes or run a GEMM; otherwise counted as not taken, as stage 5's any-gate branch, whose cost
its page tells), and the traffic between shared memory and registers.

    cost = program_cost(build_program(1, 4096, 32, 128, 128))
    cost.gemm_flops, cost.bytes, cost.intensity     # FLOPs, bytes, FLOPs per byte
    counted_cost(program)                            # the four counts a tuning exercise is graded on
"""

import re
from dataclasses import dataclass, field

import numpy as np

from stages.common.tile_regions import region_parts

__all__ = ["Cost", "CostError", "CountedCost", "counted_cost", "program_cost"]

_ARITHMETIC = {"Add", "Sub", "Mul", "Div", "Min", "Max"}
_COMPARE = {"EQ": np.equal, "NE": np.not_equal, "LT": np.less, "LE": np.less_equal, "GT": np.greater,
            "GE": np.greater_equal, "And": np.logical_and, "Or": np.logical_or}
_INTEGER = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "FloorDiv": np.floor_divide, "FloorMod": np.mod,
            "Div": lambda a, b: np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b)),  # TIR's Div truncates
            "Mod": np.fmod, "Min": np.minimum, "Max": np.maximum}
_MATH_CALLS = {"exp", "exp2", "exp10", "log", "log2", "log10", "log1p", "expm1", "sqrt", "rsqrt", "pow", "tanh",
               "sigmoid", "sin", "cos", "erf", "fabs", "abs"}


class CostError(ValueError):
    """The program has something the count cannot follow (a condition that reads a buffer, say)."""


@dataclass
class Cost:
    """FLOPs and global-memory bytes of one launch of a program (the whole grid)."""

    gemm_flops: int = 0
    gemm_flops_by_dtype: dict = field(default_factory=dict)  # operand dtype -> FLOPs
    elementwise_flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    bytes_by_buffer: dict = field(default_factory=dict)  # global buffer name -> bytes read and written
    shared_bytes: int = 0  # shared memory a block allocates (T.alloc_shared), before lowering adds copies

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """GEMM FLOPs per byte of global memory: the x axis of a roofline."""
        return self.gemm_flops / self.bytes if self.bytes else float("inf")

    def as_row(self) -> dict:
        """The counts as flat fields (a CSV row's)."""
        return dict(gemm_flops=self.gemm_flops, elementwise_flops=self.elementwise_flops,
                    bytes_read=self.bytes_read, bytes_written=self.bytes_written)


def program_cost(prim_func) -> Cost:
    """Count the FLOPs and bytes of one launch of a `@T.prim_func` (see the module docstring)."""
    return _Counter(prim_func).cost


@dataclass(frozen=True)
class CountedCost:
    """The four counts of one launch that a tuning exercise is graded on (the fields of Cost it names):
    global memory traffic, tensor-core work, CUDA-core work, and the shared memory one block holds."""

    global_bytes: int
    gemm_flops: int
    elementwise_flops: int
    shared_bytes: int


def counted_cost(prim_func) -> CountedCost:
    """program_cost(prim_func) as the four counts a tuning exercise is graded on."""
    cost = program_cost(prim_func)
    return CountedCost(global_bytes=cost.bytes, gemm_flops=cost.gemm_flops,
                       elementwise_flops=cost.elementwise_flops, shared_bytes=cost.shared_bytes)


class _Unknown:
    """A value the count does not know: a block index, a thread index, a value loaded from a buffer."""

    def __init__(self, what):
        self.what = what


def _itemsize(dtype):
    name = str(dtype)
    if name == "bool":
        return 1
    match = re.search(r"(\d+)(x(\d+))?$", name)
    if not match:
        raise CostError(f"the width of dtype {name!r}")
    return int(match.group(1)) * int(match.group(3) or 1) // 8


def _as_int(value):
    if isinstance(value, _Unknown):
        return None
    if np.ndim(value):
        return None
    return int(value)


class _Counter:
    def __init__(self, prim_func):
        import tilelang  # noqa: F401  (registers TileLang's ops with TVM)
        from tvm import tirx

        self.tirx = tirx
        self.cost = Cost()
        self.env = {}  # loop and bound variables (by node) -> int, index array over the axes, or _Unknown
        self.depth = 0  # loop axes entered; axis i has shape (extent,) + (1,) * i (inner axes lead)
        self.shape = ()  # the axes' extents, innermost first
        self.mask = True  # which points of the axes run the current statement
        self.grid = 1  # blocks of the grid around the current statement
        self._stmt(prim_func.body)

    # ---- how often the current statement runs ---------------------------------------------------

    def _count(self):
        if self.mask is True:
            points = int(np.prod(self.shape, dtype=np.int64))
        else:
            points = int(np.count_nonzero(np.broadcast_to(self.mask, self.shape)))
        return self.grid * points

    def _global(self, buffer):
        return buffer.scope() == "global"

    def _move(self, buffer, elements, written):
        moved = elements * _itemsize(buffer.dtype) * self._count()
        if written:
            self.cost.bytes_written += moved
        else:
            self.cost.bytes_read += moved
        name = str(buffer.name)
        self.cost.bytes_by_buffer[name] = self.cost.bytes_by_buffer.get(name, 0) + moved

    # ---- statements -----------------------------------------------------------------------------

    def _stmt(self, node):
        t = self.tirx
        if isinstance(node, t.SeqStmt):
            for statement in node.seq:
                self._stmt(statement)
        elif isinstance(node, t.SBlockRealize):
            for buffer in node.block.alloc_buffers:
                if str(buffer.scope()).startswith("shared"):
                    elements = int(np.prod([self._known(n, "a shared buffer's shape") for n in buffer.shape], dtype=np.int64))
                    self.cost.shared_bytes += elements * _itemsize(buffer.dtype)
            if node.block.init is not None:
                self._stmt(node.block.init)
            self._stmt(node.block.body)
        elif isinstance(node, t.AttrStmt):
            self._stmt(node.body)
        elif isinstance(node, t.Bind):
            self._expression_cost(node.value)
            self.env[node.var.__chandle__()] = self._value(node.value)
        elif hasattr(t, "LetStmt") and isinstance(node, t.LetStmt):
            self._expression_cost(node.value)
            self.env[node.var.__chandle__()] = self._value(node.value)
            self._stmt(node.body)
        elif isinstance(node, t.For):
            self._for(node)
        elif isinstance(node, t.IfThenElse):
            self._if(node)
        elif isinstance(node, t.BufferStore):
            self._expression_cost(node.value)
            for index in node.indices:
                self._expression_cost(index, flops=False)
            if self._global(node.buffer):
                self._move(node.buffer, 1, written=True)
        elif isinstance(node, t.Evaluate):
            if isinstance(node.value, t.Call):
                self._call_statement(node.value)
        else:
            raise CostError(f"the statement {type(node).__name__}")

    def _for(self, node):
        var = node.loop_var.__chandle__()
        if int(node.kind) == 4:  # bound to a block or thread index
            tag = str(node.thread_binding.thread_tag)
            extent = _as_int(self._value(node.extent))
            if extent is None:
                raise CostError(f"a grid of symbolic extent {node.extent}")
            self.env[var] = _Unknown(tag)
            if tag.startswith("blockIdx"):
                self.grid *= extent
                self._stmt(node.body)
                self.grid //= extent
            else:
                self._stmt(node.body)
            return
        step = getattr(node, "step", None)  # TileLang's frontend rewrites T.serial(a, b, s) to a unit step
        if step is not None and _as_int(self._value(step)) != 1:
            raise CostError(f"a loop with step {step}")
        start, extent = self._known(node.min, "a loop's start"), self._known(node.extent, "a loop's extent")
        size = max(int(np.max(extent)), 0) if np.size(extent) else 0
        steps = np.arange(size, dtype=np.int64).reshape((size,) + (1,) * self.depth)
        saved = self.shape, self.mask, self.depth
        self.env[var] = start + steps
        self.shape = (size,) + self.shape
        self.depth += 1
        if np.ndim(extent):  # an extent that differs between the outer points: mask the steps past it
            self.mask = self.mask & (steps < extent)
        self._stmt(node.body)
        self.shape, self.mask, self.depth = saved

    def _if(self, node):
        if isinstance(self._value(node.condition), _Unknown):
            self._untaken_if(node)
            return
        taken = self._known(node.condition, "an if's condition")
        outer = self.mask
        self.mask = outer & np.asarray(taken, dtype=bool)
        self._stmt(node.then_case)
        if node.else_case is not None:
            self.mask = outer & ~np.asarray(taken, dtype=bool)
            self._stmt(node.else_case)
        self.mask = outer

    def _untaken_if(self, node):
        """An if whose condition reads a buffer: the data decide, so it is counted as not taken, and
        only if its branches move no global bytes and run no GEMM (on-chip work the count may leave
        out, as stage 5's any-gate branch); otherwise refused."""
        import copy

        before = copy.deepcopy(self.cost)
        self._stmt(node.then_case)
        if node.else_case is not None:
            self._stmt(node.else_case)
        moved = (self.cost.bytes, self.cost.gemm_flops) != (before.bytes, before.gemm_flops)
        self.cost = before
        if moved:
            self._known(node.condition, "an if's condition")  # raises CostError, naming the buffer

    # ---- tile operations ------------------------------------------------------------------------

    def _region(self, arg):
        """A tile operand -> (buffer, elements)."""
        parts = region_parts(arg, self.tirx)
        if parts is None:
            raise CostError(f"a tile operand of type {type(arg).__name__}")
        load, extents = parts
        sizes = [_as_int(self._value(e)) for e in extents]
        if None in sizes:
            raise CostError(f"a tile region of symbolic size {list(extents)}")
        return load.buffer, int(np.prod(sizes, dtype=np.int64))

    def _call_statement(self, call):
        op = str(call.op.name) if hasattr(call.op, "name") else str(call.op)
        if op == "tl.tileop.gemm":
            a, _ = self._region(call.args[0])
            M, N, K = (_as_int(self._value(x)) for x in call.args[5:8])
            if None in (M, N, K):
                raise CostError("a T.gemm of symbolic M, N, K")
            flops = 2 * M * N * K * self._count()
            self.cost.gemm_flops += flops
            dtype = str(a.dtype)
            self.cost.gemm_flops_by_dtype[dtype] = self.cost.gemm_flops_by_dtype.get(dtype, 0) + flops
        elif op in ("tl.tileop.copy", "tl.tileop.reduce", "tl.tileop.cumsum"):
            (source, elements), (destination, written) = self._region(call.args[0]), self._region(call.args[1])
            if self._global(source):
                self._move(source, elements, written=False)
            if self._global(destination):
                self._move(destination, written, written=True)
            if op != "tl.tileop.copy":
                self.cost.elementwise_flops += elements * self._count()
        elif op == "tl.tileop.fill":
            destination, elements = self._region(call.args[0])
            if self._global(destination):
                self._move(destination, elements, written=True)
        # anything else (barriers, TileLang's annotations) moves no global bytes and computes nothing

    # ---- expressions ----------------------------------------------------------------------------

    def _expression_cost(self, node, flops=True):
        """Count the global loads (bytes read) and the floating-point operations of an expression."""
        t = self.tirx
        counted = {"flops": 0}
        loads = []

        def visit(expr):
            if isinstance(expr, t.BufferLoad):
                if self._global(expr.buffer):
                    loads.append(expr.buffer)
            elif flops and str(getattr(expr, "dtype", "")).startswith(("float", "bfloat")):
                if type(expr).__name__ in _ARITHMETIC:
                    counted["flops"] += 1
                elif isinstance(expr, t.Call) and str(getattr(expr.op, "name", "")).split(".")[-1] in _MATH_CALLS:
                    counted["flops"] += 1

        from tvm.tirx.stmt_functor import post_order_visit

        post_order_visit(node, visit)
        for buffer in loads:
            self._move(buffer, 1, written=False)
        self.cost.elementwise_flops += counted["flops"] * self._count()

    def _known(self, node, what):
        value = self._value(node)
        if isinstance(value, _Unknown):
            raise CostError(f"{what} depends on {value.what}: {node}")
        return value

    def _value(self, node):
        """An integer or boolean expression over the loop variables: an int, a bool, an index array, or
        _Unknown (it reads a buffer, or a block or thread index)."""
        t = self.tirx
        if isinstance(node, (int, bool)):
            return node
        if isinstance(node, t.IntImm):
            return bool(node.value) if str(node.dtype) == "bool" else int(node.value)
        if isinstance(node, t.Var):
            return self.env.get(node.__chandle__(), _Unknown(f"the variable {node.name}"))
        if isinstance(node, t.BufferLoad):
            return _Unknown(f"a value loaded from {node.buffer.name}")
        if isinstance(node, t.Cast):
            return self._value(node.value)
        name = type(node).__name__
        if name in _INTEGER or name in _COMPARE:
            a, b = self._value(node.a), self._value(node.b)
            for side in (a, b):
                if isinstance(side, _Unknown):
                    return side
            return (_INTEGER.get(name) or _COMPARE[name])(a, b)
        if isinstance(node, t.Not):
            inner = self._value(node.a)
            return inner if isinstance(inner, _Unknown) else np.logical_not(inner)
        if isinstance(node, t.Select) or (isinstance(node, t.Call) and str(node.op.name).endswith("if_then_else")):
            parts = (node.condition, node.true_value, node.false_value) if isinstance(node, t.Select) else node.args
            values = [self._value(p) for p in parts]
            unknown = [v for v in values if isinstance(v, _Unknown)]
            return unknown[0] if unknown else np.where(*values)
        return _Unknown(f"the expression {name}")
