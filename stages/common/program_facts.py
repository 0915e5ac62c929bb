"""Three facts about a TileLang program, read from its TIR before lowering (no GPU, no nvcc): which of
its parameters it writes, how much shared memory one block of it asks for, and which of its stores
from shared to global memory may read a tile before its writes are seen.

The build exercises check any program a student writes with them, not only the course's: a program
must leave its inputs as it found them (`parameters_written` finds only its outputs), must fit in an
H200 block's shared memory (`shared_memory_bytes` at most SHARED_MEMORY_PER_BLOCK), and must fence a
staged tile before storing it (`unfenced_stores` finds none; stages.kda.tiles, "TMA stores", says
why). All read the program as the tile interpreter and the cost counter do (stages.common.tile_regions).
"""

import re

from stages.common.tile_regions import region_parts

__all__ = ["SHARED_MEMORY_PER_BLOCK", "parameters_written", "shared_memory_bytes", "unfenced_stores"]

SHARED_MEMORY_PER_BLOCK = 227 * 1024  # bytes an sm_90 block may use (the H100's and the H200's)

# A tile operand's access in `tl.region(load, access, *extents)`: 1 read, 2 write, 3 read and write.
_WRITTEN = (2, 3)


def parameters_written(program):
    """The program's parameters (its global buffers) that a statement writes, as [position, name]
    pairs in parameter order: stored to element by element, or a tile operation's operand marked as
    written (the destination of a copy, a GEMM's accumulator, a fill)."""
    from tvm import tirx

    written = set()

    def visit(node):
        if isinstance(node, tirx.BufferStore):
            written.add(node.buffer.name)
        elif isinstance(node, tirx.Call) and str(getattr(node.op, "name", "")) == "tl.region":
            load, _ = region_parts(node, tirx)
            if int(node.args[1]) in _WRITTEN:
                written.add(load.buffer.name)
        return True

    tirx.stmt_functor.pre_order_visit(program.body, visit)
    parameters = [program.buffer_map[handle].name for handle in program.params]
    return [[position, name] for position, name in enumerate(parameters) if name in written]


def shared_memory_bytes(program):
    """Bytes of shared memory one block allocates: each `T.alloc_shared` buffer once, or once per
    pipeline stage (`num_stages`) when a `T.copy` inside a pipelined loop fills it from global memory,
    since TileLang keeps that many copies of it so the loads of the next iterations overlap this one's
    work. The compile report (stages.common.tilelang_tools) adds about 1 KiB for the pipeline's barriers."""
    from tvm import tirx

    shared = {}  # name -> bytes of one copy
    stages_of = {}  # name -> copies kept by the pipelined loop that loads it

    def visit_allocations(node):
        if isinstance(node, tirx.SBlockRealize):
            for buffer in node.block.alloc_buffers:
                if buffer.scope().startswith("shared"):
                    elements = 1
                    for extent in buffer.shape:
                        elements *= int(extent)
                    shared[buffer.name] = elements * _itemsize(buffer.dtype)
        elif isinstance(node, tirx.For) and "num_stages" in node.annotations:
            num_stages = int(node.annotations["num_stages"])
            for destination in _loaded_from_global(node.body, tirx):
                stages_of[destination] = max(stages_of.get(destination, 1), num_stages)
        return True

    tirx.stmt_functor.pre_order_visit(program.body, visit_allocations)
    return sum(size * stages_of.get(name, 1) for name, size in shared.items())


def unfenced_stores(program):
    """The copies from a shared tile to a global buffer (`T.copy(X_s, Out[...])`, a TMA store on sm_90)
    that may run while a write to the tile since the last `T.fence_proxy_async()` is unfenced: [source,
    destination] name pairs in program order, none for a right program. The threads write a tile
    through the generic proxy, the TMA engine reads it through the async proxy; each writer must fence
    between its writes and the store. Read in program order, a loop's body twice (a write late in one
    iteration, a store early in the next) and both arms of a branch (a fence in one arm only leaves
    the other's writes unfenced)."""
    from tvm import tirx

    found = []

    def walk(stmt, unfenced):  # unfenced: the shared tiles written since the last fence
        def visit(node):
            if isinstance(node, tirx.For):
                for _ in range(2):
                    walk(node.body, unfenced)
                return False
            if isinstance(node, tirx.IfThenElse):
                other = set(unfenced)
                walk(node.then_case, unfenced)
                if node.else_case is not None:
                    walk(node.else_case, other)
                unfenced.update(other)
                return False
            if isinstance(node, tirx.BufferStore) and node.buffer.scope().startswith("shared"):
                unfenced.add(node.buffer.name)
            elif isinstance(node, tirx.Call):
                name = str(getattr(node.op, "name", ""))
                if name == "tl.fence_proxy_async":
                    unfenced.clear()
                elif name == "tl.tileop.copy":
                    source, destination = (region_parts(operand, tirx)[0].buffer for operand in node.args[:2])
                    store = [source.name, destination.name]
                    if source.name in unfenced and destination.scope() == "global" and store not in found:
                        found.append(store)
                if name.startswith("tl.tileop."):  # a tile operation writes the operands marked written
                    for operand in node.args:
                        if isinstance(operand, tirx.Call) and str(operand.op.name) == "tl.region":
                            buffer, access = operand.args[0].buffer, int(operand.args[1])
                            if access in _WRITTEN and buffer.scope().startswith("shared"):
                                unfenced.add(buffer.name)
                    return False  # its operands are read here, not as stores of their own
            return True

        tirx.stmt_functor.pre_order_visit(stmt, visit)

    walk(program.body, set())
    return found


def _itemsize(dtype):
    """Bytes per element of a TIR dtype ("float16" -> 2, "bool" -> 1)."""
    name = str(dtype)
    return 1 if name == "bool" else int(re.search(r"(\d+)$", name).group(1)) // 8


def _loaded_from_global(stmt, tirx):
    """Names of the buffers that a `T.copy` in `stmt` fills from a global buffer."""
    loaded = []

    def visit(node):
        if isinstance(node, tirx.Call) and str(getattr(node.op, "name", "")) == "tl.tileop.copy":
            source, destination = (region_parts(operand, tirx) for operand in node.args[:2])
            if source and destination and source[0].buffer.scope() == "global":
                loaded.append(destination[0].buffer.name)
        return True

    tirx.stmt_functor.pre_order_visit(stmt, visit)
    return loaded
