"""The ordering constraints of a chunked kernel, read from its TIR as written, before any lowering (no
GPU, no nvcc).

A kernel of stages 1-4 keeps the state S^T in the fragment `S_f` across a pipelined loop over chunks,
hands it to the output's GEMMs through `S_s`, and sums each chunk's output in `acc_o`. Three of the
seed's seven constraints are facts about the order of the writes to those buffers, which any right
kernel of that layout satisfies; the others are about values, which only running the code shows.
The third reader of TileLang's TIR beside the tile interpreter and the cost counter, it reads tile
operands as they do (stages.common.tile_regions).
"""

from stages.common.tile_regions import region_parts


# --8<-- [start:ordering]
def ordering_constraints(program):
    """Check constraints 1, 2 and 7 on a program's TIR: [(constraint number, statement, holds)].
    Each is necessary for a right answer. The others are about values (the masks, beta's place,
    q ⊙ e^{gamma}), which only running the code shows, or, for 5, a rule of stage 4's style: writing
    K_s after its last read would be harmless."""
    chunk_loop = _chunk_loop(program)
    before, inside = _writes(program.body, skip=chunk_loop), _writes(chunk_loop.body)
    position = {}  # (op, buffer, detail) -> the positions in `inside` of that write
    for n, event in enumerate(inside):
        position.setdefault(event, []).append(n)
    state_writes = [n for n, (_, buffer, _) in enumerate(inside) if buffer == "S_f"]
    state_reads = position.get(("copy", "S_s", "S_f"), [])  # the output's GEMMs read the state in S_s
    state_decay, state_gemms = position.get(("store", "S_f", None), []), position.get(("gemm", "S_f", False), [])
    state_clears = position.get(("fill", "S_f", None), []) + position.get(("gemm", "S_f", True), [])
    output_writes = [event for event in inside if event[1] == "acc_o"]
    return [
        (1, "the output reads the state before the chunk changes it",
         bool(state_reads and state_writes) and max(state_reads) < min(state_writes)),
        (2, "the state's rows decay before the GEMM adds the chunk to it",
         bool(state_decay and state_gemms) and max(state_decay) < min(state_gemms)),
        (7, "the state is cleared once, before the chunk loop; the output accumulator in every chunk",
         ("fill", "S_f", None) in before and not state_clears
         and bool(output_writes) and output_writes[0] in (("fill", "acc_o", None), ("gemm", "acc_o", True))),
    ]


def _chunk_loop(program):
    """The one pipelined loop of the program: the loop over chunks."""
    from tvm import tirx

    loops = []

    def visit(node):
        if isinstance(node, tirx.For) and "num_stages" in node.annotations:
            loops.append(node)
        return True

    tirx.stmt_functor.pre_order_visit(program.body, visit)
    if len(loops) != 1:
        raise ValueError(f"expected one pipelined chunk loop, found {len(loops)}")
    return loops[0]


def _writes(stmt, skip=None):
    """The buffer writes of `stmt` in program order, without entering `skip`: (op, buffer, detail),
    detail being the source buffer of a copy, clear_accum of a GEMM, None otherwise."""
    from tvm import tirx

    events = []

    def visit(node):
        if skip is not None and node.same_as(skip):
            return False
        if isinstance(node, tirx.BufferStore):
            events.append(("store", node.buffer.name, None))
        elif isinstance(node, tirx.Call) and getattr(node.op, "name", "") in _TILE_OPS:
            op, destination = _TILE_OPS[node.op.name]
            detail = _buffer_name(node.args[0], tirx) if op == "copy" else bool(node.args[9]) if op == "gemm" else None
            events.append((op, _buffer_name(node.args[destination], tirx), detail))
        return True

    tirx.stmt_functor.pre_order_visit(stmt, visit)
    return events


# tile operator -> (name, index of the argument it writes); a GEMM's clear_accum is its argument 9
_TILE_OPS = {"tl.tileop.copy": ("copy", 1), "tl.tileop.gemm": ("gemm", 2), "tl.tileop.fill": ("fill", 0)}


def _buffer_name(operand, tirx):
    """The name of the buffer a tile operand points into."""
    load, _ = region_parts(operand, tirx)
    return load.buffer.name
# --8<-- [end:ordering]
