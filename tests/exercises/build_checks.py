"""What the build exercises check beyond values, on any program a student writes (not only the
course's): that it writes only its outputs, that its TIR keeps the ordering constraints, that it fits
the H200's shared memory, and that it fences a staged tile before storing it. Each reads the program's
TIR through tir_facts, so a program built in the grading sandbox is read in a sandboxed process that
runs no student code."""

import numpy as np

from stages.common.compare import assert_rule
from tests.exercises.kernel_checks import tir_facts

# The shape at which a build exercise's budgets are checked: the course's benchmark head size.
BUDGET_HEAD_DIM = 128


def assert_writes_only(program, outputs):
    """The program writes the parameters at the positions `outputs` (0-based, as out_idx counts them)
    and no other: its inputs are unchanged."""
    __tracebackhide__ = True
    from stages.common.program_facts import parameters_written

    inputs_written = [f"{name} (parameter {position})" for position, name in tir_facts(parameters_written, program)
                      if position not in outputs]
    assert_rule(not inputs_written, f"the program writes only its outputs, parameters {', '.join(map(str, outputs))}",
                f"it also writes {', '.join(inputs_written)}: a caller's input must come back as it went in; "
                "copy it to a shared or fragment buffer and change that instead")


def assert_respects_ordering_constraints(program, constraints):
    """The ordering constraints numbered in `constraints` hold on the program's TIR."""
    __tracebackhide__ = True
    from stages.common.ordering import ordering_constraints

    facts = {number: (statement, holds) for number, statement, holds in tir_facts(ordering_constraints, program)}
    broken = [f"{number}: {facts[number][0]}" for number in constraints if not facts[number][1]]
    assert_rule(not broken, "the ordering constraints " + ", ".join(map(str, constraints)),
                "broken: " + "; ".join(broken))


def assert_stores_fenced(program):
    """Every store of a shared tile to global memory (a TMA store on the H200) follows a
    `T.fence_proxy_async()` placed after the last write to the tile (stages/kda/tiles.py, "TMA stores")."""
    __tracebackhide__ = True
    from stages.common.program_facts import unfenced_stores

    unfenced = ", ".join(f"{tile} -> {out}" for tile, out in tir_facts(unfenced_stores, program))
    assert_rule(not unfenced, "every staged tile fenced between its last write and its store to global memory",
                f"stored before a fence that follows their writes: {unfenced}. The threads write shared memory "
                "through the generic proxy and the TMA store reads it through the async proxy; without "
                "`T.fence_proxy_async()` after the writes (every thread, before the barrier) the store may send "
                "what the tile held before")


def assert_fits_shared_memory(program):
    """The program's shared buffers fit one H200 block (a count from the TIR, an upper bound of the
    compile report's to within the report's 1 KiB of barriers: stages.common.program_facts)."""
    __tracebackhide__ = True
    from stages.common.program_facts import SHARED_MEMORY_PER_BLOCK, shared_memory_bytes

    used = tir_facts(shared_memory_bytes, program)
    assert_rule(used <= SHARED_MEMORY_PER_BLOCK, "at most 227 KiB of shared memory per block",
                f"the shared buffers take {used / 1024:.1f} KiB (a tile copied from global memory inside the "
                "pipelined loop counts once per pipeline stage): use smaller tiles, fewer stages, or fragments")


def padded_to_chunks(x, chunk_size, token_axis=1):
    """x zero-padded along its token axis to a multiple of chunk_size, as the stage's wrapper pads."""
    N = x.shape[token_axis]
    widths = [(0, 0)] * x.ndim
    widths[token_axis] = (0, -N % chunk_size)
    return np.pad(x, widths)


# A build exercise asks for a kernel as economical as the course's in what the H200 pays most for: the
# bytes it moves through HBM (these kernels are bound by them) and the tensor cores' work. The waste the
# course teaches, a tile loaded from global memory twice, costs a third or more of the bytes at the
# build tests' cost shape; a quarter leaves room for other grids and tilings (a second program of stage
# 5, which reads the state's decay where it uses it, moves 23% more). The tune exercises ask for all
# four counts within 5%; here element-wise FLOPs and shared memory are free, within the H200's budget.
BUILD_COST_FACTOR = 1.25
BUILD_COUNTS = ("global_bytes", "gemm_flops")
# The chunked kernel exists to put its products on the tensor cores; a program that computes them
# element by element (the recurrence token by token, or loops of products) is another kernel, right
# but with a serial depth of N and d_k x d_v work per token on the CUDA cores. A build answer does at
# least this share of the course kernel's GEMM FLOPs (stage 1's second program, which skips a product
# the course's kernel makes, does 2/3 of them).
BUILD_MIN_GEMM_SHARE = 0.5


def assert_cost_near_the_course_kernel(program, target):
    """The program's global bytes and GEMM FLOPs are each at most BUILD_COST_FACTOR times `target`'s
    (the course kernel's CountedCost at the same shape), and its GEMM FLOPs at least BUILD_MIN_GEMM_SHARE
    of them; the failure names the count and, for bytes, the bytes of each global buffer."""
    __tracebackhide__ = True
    from stages.common.program_cost import counted_cost, program_cost
    from tests.exercises.tune_checks import COUNTS

    counted = tir_facts(counted_cost, program)
    over = []
    for count in BUILD_COUNTS:
        mine, theirs = getattr(counted, count), getattr(target, count)
        if mine > BUILD_COST_FACTOR * theirs:
            name, causes = COUNTS[count]
            over.append(f"{name}: {mine:,}, {mine / theirs:.2f} times the course kernel's {theirs:,} (usually: {causes})")
    if counted.gemm_flops < BUILD_MIN_GEMM_SHARE * target.gemm_flops:
        over.append(f"GEMM FLOPs: {counted.gemm_flops:,}, {counted.gemm_flops / target.gemm_flops:.2f} times the course "
                    f"kernel's {target.gemm_flops:,}: the chunked kernel makes its products with T.gemm on the tensor "
                    "cores, where a program of element-wise products (token by token, or loops of sums) leaves them "
                    "to the CUDA cores")
    if over and any(line.startswith("global bytes") for line in over):
        by_buffer = tir_facts(program_cost, program).bytes_by_buffer
        over.append("bytes by global buffer: " + ", ".join(f"{buffer} {moved:,}" for buffer, moved in by_buffer.items()))
    assert_rule(not over, f"at most {BUILD_COST_FACTOR:g} times the course kernel's global bytes and GEMM FLOPs, and "
                f"at least {BUILD_MIN_GEMM_SHARE:g} times its GEMM FLOPs (stages.common.program_cost)", "; ".join(over))
