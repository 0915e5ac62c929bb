"""What every kernel exercise's tests do with the program a student wrote, in three places:

- `run_on_cpu`: through the course's tile interpreter (stages.common.interpreter), on any machine;
- `compile_for_sm90a`: lowered and compiled with nvcc for Hopper, where nvcc exists (marked compile);
- `run_on_gpu`: JIT-compiled and run by TileLang where torch sees a CUDA device (marked gpu).

Each turns a failure of the student's program (it does not build, the interpreter meets something it
does not run, it spills) into one short message, never a TileLang traceback.
"""

import contextlib
import logging

import numpy as np
import pytest

# The dtypes a kernel exercise is checked in, with the unit roundoff u of each. fp16 and bf16 are the
# kernel's; float64 runs the same program with exact operands, so only the fp32 accumulators round.
UNIT_ROUNDOFF = {"float64": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}


# Past a rel L2 bound of a few units of fp16's roundoff, single entries are off by more than that bound
# times the RMS through rounding alone. Where a program fails such a bound, the entries it calls wrong
# are those off by this many times more: what rounding does not explain, so the message's chunk hint
# (first chunk right, later ones wrong: the state) is not drowned by rounding in chunk 0.
ROUNDING_SPREAD = 8


def assert_close_in_precision(actual, expected, *, rel_l2, chunk_size, name):
    """assert_close(actual, expected, rel_l2=...) for a low-precision program; its failure message
    says where the entries are wrong beyond rounding (ROUNDING_SPREAD), and so which chunks to suspect."""
    __tracebackhide__ = True
    from stages.common.compare import assert_close

    try:
        assert_close(actual, expected, rel_l2=rel_l2, chunk_size=chunk_size, name=name)
    except AssertionError as within_rounding:
        try:
            assert_close(actual, expected, rel_l2=ROUNDING_SPREAD * rel_l2, chunk_size=chunk_size, name=name)
        except AssertionError as beyond_rounding:  # the bound's line, then where the gross errors are
            lines = str(within_rounding).splitlines()[:1] + str(beyond_rounding).splitlines()[1:]
            raise AssertionError("\n".join(lines)) from None
        raise


def build(build_program, *args, **kwargs):
    """build_program(*args, **kwargs), or a test failure that says why it did not build."""
    __tracebackhide__ = True
    try:
        with _quiet_tilelang():
            return build_program(*args, **kwargs)
    except NotImplementedError as todo:
        problem = f"{getattr(build_program, '__name__', 'build_program')} raised NotImplementedError: {todo}"
    except Exception as error:  # named by the line of the student's file that TileLang could not build
        from stages.common.tilelang_tools import build_error_message

        problem = build_error_message(error, build_program)
    pytest.fail(problem, pytrace=False)  # outside the except: no chained traceback


@contextlib.contextmanager
def _quiet_tilelang():
    """TileLang logs the whole generated builder source when a program fails to build: the failure
    message below says what a student needs, so its logger is silenced for the build."""
    logger = logging.getLogger("tilelang.language.eager.builder")
    was_disabled, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = was_disabled


def run_on_cpu(program, inputs, out_idx):
    """Run `program` through the tile interpreter on NumPy `inputs`; returns its outputs."""
    __tracebackhide__ = True
    from kdacourse.remote import RemoteError, RemoteProgram
    from stages.common.interpreter import InterpreterError, interpret

    if isinstance(program, RemoteProgram):  # untrusted grading: interpreted in the sandbox
        try:
            return program.interpret(inputs, out_idx)
        except RemoteError as error:
            if error.remote_type not in {cls.__name__ for cls in (InterpreterError, *InterpreterError.__subclasses__())}:
                raise
            problem = f"the tile interpreter stopped: {error}"
        pytest.fail(problem, pytrace=False)
    try:
        return interpret(program, out_idx=out_idx)(*inputs)
    except InterpreterError as error:
        pytest.fail(f"the tile interpreter stopped: {error}", pytrace=False)


def tir_facts(analysis, program):
    """analysis(program) for a TIR analysis of the course library (e.g. ordering_constraints); a
    program built in the grading sandbox is analyzed in a sandboxed process that runs no student code."""
    from kdacourse.remote import RemoteProgram

    if isinstance(program, RemoteProgram):
        return program.analyze(analysis)
    return analysis(program)


def compile_for_sm90a(program, pass_configs=None):
    """Lower and compile `program` for sm_90a; fails if it spills, asks for too much shared memory, or
    has a barrier that some warps skip (a hang on the GPU the interpreter cannot show)."""
    __tracebackhide__ = True
    from stages.common.tilelang_tools import compile_report

    report = compile_report(program, pass_configs)
    if report.spill_stores or report.spill_loads:
        pytest.fail(f"the kernel spills registers to local memory: {report.summary()}", pytrace=False)
    if report.divergent_barriers:
        line, branch = report.divergent_barriers[0]
        pytest.fail(f"the generated CUDA has a __syncthreads() at line {line} inside `{branch}`: the warps "
                    "that skip the branch never reach it, and the kernel hangs on the GPU. A T.Parallel loop with an "
                    "`if` around a statement that needs a barrier does this; compute on every lane and select with "
                    "T.if_then_else instead", pytrace=False)
    if report.misplaced_warp_group_operands:
        descriptor, buffer, offset, atom = report.misplaced_warp_group_operands[0]
        pytest.fail(f"the generated CUDA moves the second warp group {offset} bytes into `{buffer}` ({descriptor}), "
                    f"not a whole number of its {atom}-byte swizzle atoms: that group reads the first group's columns. "
                    "TileLang 0.1.15 does this for a row slice of a larger buffer (buf[0:16, :]) used as a GEMM operand "
                    "whose columns the two warp groups split; give that operand a buffer of its own", pytrace=False)
    if report.shared_memory > 227 * 1024:
        pytest.fail(f"the kernel asks for more shared memory than an H200 block has (227 KiB): "
                    f"{report.summary()}", pytrace=False)
    return report


def run_on_gpu(program, inputs, out_idx, dtypes, pass_configs=None):
    """JIT-compile `program` for the GPU and run it on `inputs` (NumPy) cast to `dtypes`; returns
    its outputs as float64 NumPy arrays."""
    import tilelang
    import torch

    kernel = tilelang.compile(program, out_idx=out_idx, target="cuda", pass_configs=pass_configs or {})
    tensors = [torch.tensor(np.asarray(x), dtype=getattr(torch, dtype), device="cuda") for x, dtype in zip(inputs, dtypes)]
    outputs = kernel(*tensors)
    outputs = outputs if isinstance(outputs, (list, tuple)) else [outputs]
    results = [output.double().cpu().numpy() for output in outputs]
    return results[0] if len(results) == 1 else results
