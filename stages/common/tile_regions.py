"""The one reading of a tile operation's operand in TileLang's TIR before lowering, shared by the
tile interpreter (stages.common.interpreter) and the cost counter (stages.common.program_cost).

`T.copy(A[i, j], A_s)`, `T.gemm(A_s, B_s, C_f)` and the other tile operations reach the TIR as calls
whose operands are `tl.region(load, access, *extents)`: the load names the buffer and the start of
the window, the extents its size. An operand written as a plain element, `A[i, j]`, is a window of
one element on every axis.
"""


def region_parts(operand, tirx):
    """(load, extents) of a tile operand, or None for an operand of another form."""
    if isinstance(operand, tirx.Call) and str(operand.op.name) == "tl.region":
        return operand.args[0], list(operand.args[2:])
    if isinstance(operand, tirx.BufferLoad):
        return operand, [1] * len(operand.indices)
    return None
