"""What every tuning exercise's tests check about the cost of a student's program.

A tuning exercise ships a right but wasteful TileLang program; the student makes it cheaper. The
course counts the cost from the program itself (stages.common.program_cost), so the grading needs no
GPU: each of the four counts must be within TOLERANCE of what the stage's library kernel counts at the
same shape. The target is computed by the test, from the library kernel as it is now (from_library:
in a handout, the value `course handout` recorded), never typed in.
"""

import pytest

from stages.common.program_cost import counted_cost, program_cost
from tests.exercises.kernel_checks import tir_facts

TOLERANCE = 0.05  # a count may exceed the library kernel's by at most 5%

# Each count: how a message names it, and the wastes that usually put a program over it.
COUNTS = {
    "global_bytes": ("global bytes", "a tile copied from global memory twice (the same rows of q, k or v loaded "
                     "again for a second product), a value kept in a global buffer between chunks instead of on "
                     "chip, or smaller tiles that make more programs read the same rows"),
    "gemm_flops": ("GEMM FLOPs", "a product computed twice, or a T.gemm over a larger tile than the result needs "
                   "(a whole C x C block where a triangle or a sub-block would do)"),
    "elementwise_flops": ("element-wise FLOPs", "a value that depends on no chunk (a decay, a table, an "
                          "exponential) computed inside the chunk loop instead of once before it, or the same "
                          "exponential computed in several loops instead of kept in a buffer"),
    "shared_bytes": ("shared memory", "a second shared buffer holding what another already holds (a tile loaded "
                     "twice, a copy kept \"just in case\"), or a buffer in fp32 where the input dtype would do"),
}


def assert_cost_within_target(program, target, count):
    """The program's `count` (a field of CountedCost) is at most (1 + TOLERANCE) times `target`'s (the
    library kernel's CountedCost); the failure says by how much it is over and what usually causes it."""
    __tracebackhide__ = True
    counted = tir_facts(counted_cost, program)
    mine, theirs = getattr(counted, count), getattr(target, count)
    limit = int(theirs * (1 + TOLERANCE))
    if mine <= limit:
        return
    name, causes = COUNTS[count]
    message = (f"{name}: the program counts {mine:,}, {100 * (mine / theirs - 1):.0f}% more than the course's kernel "
               f"({theirs:,}); the target is at most {limit:,} (+{TOLERANCE:.0%}). Over by {mine - limit:,}. "
               f"Usually: {causes}.")
    if count == "global_bytes":
        by_buffer = tir_facts(program_cost, program).bytes_by_buffer
        message += " Bytes by global buffer: " + ", ".join(f"{buffer} {moved:,}" for buffer, moved in by_buffer.items())
    pytest.fail(message, pytrace=False)


TIME_TOLERANCE = 0.10  # on a GPU, a tuned program may take at most 10% longer than the library kernel


def assert_time_within_target(program, build_library_program, inputs, dtypes, out_idx, pass_configs=None):
    """On a GPU: `program`'s median time (CUDA events, triton's do_bench, after warm-up) is at most
    (1 + TIME_TOLERANCE) times that of the library kernel that `build_library_program()` builds, on the
    same inputs (NumPy, cast to `dtypes`). In a handout, where that kernel is an exercise (a stub), skips."""
    __tracebackhide__ = True
    try:
        library_program = build_library_program()
    except NotImplementedError:
        pytest.skip("the course's kernel is an exercise in this handout: the instructor's grading times the "
                    "program against it")
    import numpy as np
    import tilelang
    import torch
    from triton.testing import do_bench

    tensors = [torch.tensor(np.asarray(x), dtype=getattr(torch, dtype), device="cuda") for x, dtype in zip(inputs, dtypes)]
    times = [float(do_bench(lambda kernel=tilelang.compile(p, out_idx=out_idx, target="cuda",
                                                                   pass_configs=pass_configs or {}): kernel(*tensors),
                            warmup=25, rep=100, return_mode="median")) for p in (program, library_program)]
    mine, theirs = times
    print(f"the program: {mine:.3f} ms, the course's kernel: {theirs:.3f} ms ({mine / theirs:.2f}x)")
    if mine > theirs * (1 + TIME_TOLERANCE):
        pytest.fail(f"time: the program takes {mine:.3f} ms, {100 * (mine / theirs - 1):.0f}% longer than the course's "
                    f"kernel ({theirs:.3f} ms); the target is at most +{TIME_TOLERANCE:.0%}", pytrace=False)
