"""What the build exercises check beyond values, on any program a student writes (not only the
course's): that it writes only its outputs, that its TIR keeps the ordering constraints, and that it
fits the H200's shared memory. Each reads the program's TIR through tir_facts, so a program built in
the grading sandbox is read in a sandboxed process that runs no student code."""

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
