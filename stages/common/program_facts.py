"""Two facts about a TileLang program, read from its TIR before lowering (no GPU, no nvcc): which of
its parameters it writes, and how much shared memory one block of it asks for.

The build exercises check any program a student writes with them, not only the course's: a program
must leave its inputs as it found them (`parameters_written` finds only its outputs), and must fit
in an H200 block's shared memory (`shared_memory_bytes` at most SHARED_MEMORY_PER_BLOCK). Both read
the program as the tile interpreter and the cost counter do (stages.common.tile_regions).
"""

import re

from stages.common.tile_regions import region_parts

__all__ = ["SHARED_MEMORY_PER_BLOCK", "parameters_written", "shared_memory_bytes"]

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
