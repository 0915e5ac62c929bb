"""The fast path's programs compiled for the GPU, each once per shape (functools.cache), and their
compile-only reports (lowered and compiled for sm_90a without a GPU: registers, spills, shared memory).

A program is built one at a time (build_in_turn: TileLang builds with Python's ast, which is not safe
in threads) and compiled with its outputs allocated by the call (out_idx), except the packed-batch
kernels, whose sizes are run-time symbols and whose outputs the caller allocates.
"""

import functools

from stages.common.tilelang_tools import build_in_turn, compile_in_threads, gpu_target
from stages.common.tilelang_tools import compile_report as lower_and_report
from stages.common.torch_checks import KERNEL_DTYPES
from stages.kda.activation import activation_outputs, build_activate_program, build_activation_gradients_program
from stages.kda.backward import BUILDERS, kernel_arguments
from stages.kda.checks import check_block, check_kernel_sizes
from stages.kda.config import (CHANNEL_PASSES, DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE, DEFAULT_THREADS,
                               default_prepare_threads)
from stages.kda.decode import build_decode_program
from stages.kda.inputs import InputForm
from stages.kda.prepare import PackedBatch, build_prepare_program, prepare_outputs, run_time_sizes
from stages.kda.recurrence import build_recurrence_program

PLAIN = InputForm()


def packed_sizes():
    """(rows of the chunk-aligned outputs, PackedBatch) as run-time symbols: the packed kernels compiled
    with them serve every batch."""
    tokens, rows, chunks, sequences = run_time_sizes()
    return rows, PackedBatch(tokens, chunks, sequences)


def compiled_prepare(B, N, H, d_k, d_v, chunk_size, dtype, threads, value_flags=False, solve_outputs=False,
                     form=PLAIN, group=1, gate_dtype="float32", beta_dtype="float32", tokens=None,
                     channel_passes=CHANNEL_PASSES):
    """The prepare kernel (build_prepare_program, dense) compiled for the GPU: value_flags, the kernel
    that flags bad values (checks="device"); solve_outputs, A_kk and T too (the backward); form, group,
    gate_dtype, beta_dtype and tokens: the inputs as a model passes them; channel_passes: the score
    GEMMs' (build_prepare_program). One cache entry per program, however its options are passed."""
    return _compiled_prepare(B, N, H, d_k, d_v, chunk_size, dtype, threads, value_flags, solve_outputs, form, group,
                             gate_dtype, beta_dtype, tokens, channel_passes)


@functools.cache
def _compiled_prepare(B, N, H, d_k, d_v, chunk_size, dtype, threads, value_flags, solve_outputs, form, group,
                      gate_dtype, beta_dtype, tokens, channel_passes):
    import tilelang

    program = build_in_turn(build_prepare_program, B, N, H, d_k, d_v, chunk_size, dtype, threads,
                            channel_passes=channel_passes, value_flags=value_flags, solve_outputs=solve_outputs,
                            form=form, group=group, gate_dtype=gate_dtype, beta_dtype=beta_dtype, tokens=tokens)
    out_idx = prepare_outputs(value_flags, solve_outputs, raw_gate=form.raw_gate)
    return tilelang.compile(program, out_idx=out_idx, target=gpu_target())


compiled_prepare.cache_clear = _compiled_prepare.cache_clear  # as the other caches: tests empty them


@functools.cache
def compiled_recurrence(B, N, H, d_k, d_v, chunk_size, block_dv, dtype, num_stages, threads, programs_per_sm=1):
    """The recurrence kernel (dense) compiled for the GPU, o and the final state allocated by the call."""
    import tilelang

    program = build_in_turn(build_recurrence_program, B, N, H, d_k, d_v, chunk_size, block_dv, dtype, num_stages,
                            threads, programs_per_sm=programs_per_sm)
    return tilelang.compile(program, out_idx=[7, 8], target=gpu_target())


@functools.cache
def compiled_backward_kernel(kernel, *arguments, value_flags=False):
    """One kernel of the backward (backward.BUILDERS) compiled for the GPU, with kernel_arguments'
    arguments for it; the prepare is the forward's, with solve_outputs (and value_flags)."""
    import tilelang

    if kernel == "prepare":  # in the call's form that forward_and_prepared makes: one cache entry for both
        chunk_size = arguments[5]
        return compiled_prepare(*arguments, default_prepare_threads(chunk_size), value_flags, solve_outputs=True)
    build, outputs = BUILDERS[kernel]
    return tilelang.compile(build_in_turn(build, *arguments), out_idx=outputs, target=gpu_target())


@functools.cache
def compiled_activation(B, N, H, d_k, dtype, form, group, gate_dtype, beta_dtype):
    """(activate, activation_gradients) compiled for the GPU (stages.kda.activation), their outputs
    allocated by the call: the backward's kernels for the tensors as a model passes them."""
    import tilelang

    sizes = (B, N, H, d_k, dtype, form, group, gate_dtype, beta_dtype)
    activate_outputs, gradients_outputs = activation_outputs(form)
    activate = tilelang.compile(build_in_turn(build_activate_program, *sizes), out_idx=activate_outputs,
                                target=gpu_target())
    gradients = tilelang.compile(build_in_turn(build_activation_gradients_program, *sizes),
                                 out_idx=gradients_outputs, target=gpu_target())
    return activate, gradients


@functools.cache
def compiled_backward_kernels(B, N, H, d_k, d_v, chunk_size, block_dv, dtype, value_flags=False):
    """{kernel: compiled for the GPU} for one backward shape (kernel_arguments' arguments). The five
    compile at once in threads on the first call: about the time of the slowest, not of all five."""
    arguments = kernel_arguments(B, N, H, d_k, d_v, chunk_size, block_dv, dtype)
    return compile_all({name: functools.partial(compiled_backward_kernel, name, *arguments[name],
                                                value_flags=value_flags and name == "prepare")
                        for name in arguments})


@functools.cache
def compiled_packed_prepare(H, d_k, d_v, chunk_size, dtype, value_flags, form=PLAIN, group=1, gate_dtype="float32",
                            beta_dtype="float32", channel_passes=CHANNEL_PASSES):
    """The prepare for a packed batch of any length. The outputs are the caller's (no out_idx):
    TileLang allocates an output only when each of its sizes is a symbol of its own."""
    import tilelang

    rows, packed = packed_sizes()
    program = build_in_turn(build_prepare_program, 1, rows, H, d_k, d_v, chunk_size, dtype,
                            channel_passes=channel_passes, value_flags=value_flags, packed=packed, form=form,
                            group=group, gate_dtype=gate_dtype, beta_dtype=beta_dtype)
    return tilelang.compile(program, target=gpu_target())


@functools.cache
def compiled_packed_recurrence(H, d_k, d_v, chunk_size, block_dv, dtype, num_stages, programs_per_sm=1):
    """The recurrence for a packed batch of any length; the outputs are the caller's."""
    import tilelang

    rows, packed = packed_sizes()
    program = build_in_turn(build_recurrence_program, 1, rows, H, d_k, d_v, chunk_size, block_dv, dtype, num_stages,
                            packed=packed, programs_per_sm=programs_per_sm)
    return tilelang.compile(program, target=gpu_target())


@functools.cache
def compiled_prefill_kernels(H, d_k, d_v, chunk_size, block_dv, dtype, num_stages, value_flags=False, programs_per_sm=1,
                             **form_options):
    """(packed prepare, packed recurrence) compiled once per head shape, block and dtype (and the
    prepare's form_options: compiled_packed_prepare's form, group, gate_dtype, beta_dtype, channel_passes), both at
    once (each in its own thread). Cached as a pair: starting the two threads again on every call cost
    260 us of host time per prefill."""
    kernels = compile_all({"prepare": lambda: compiled_packed_prepare(H, d_k, d_v, chunk_size, dtype, value_flags,
                                                                      **form_options),
                           "recurrence": lambda: compiled_packed_recurrence(H, d_k, d_v, chunk_size, block_dv, dtype,
                                                                            num_stages, programs_per_sm)})
    return kernels["prepare"], kernels["recurrence"]


@functools.cache
def compiled_decode(B, P, H, d_k, d_v, block_dv, dtype, threads, value_flags, form=PLAIN, group=1, gate_dtype=None,
                    beta_dtype=None):
    """The decode kernel compiled for the GPU with an fp32 pool, o allocated by the call; form, group,
    gate_dtype, beta_dtype: the inputs as a model passes them (build_decode_program); dtype: q's, one of
    stages.kda.checks.DECODE_DTYPES."""
    import tilelang

    program = build_decode_program(B, P, H, d_k, d_v, block_dv, dtype, "float32", threads, value_flags, form, group,
                                   gate_dtype, beta_dtype)
    output = 7 + value_flags + 2 * form.raw_gate  # O, after the inputs, A_log and Dt_bias, and Flags
    return tilelang.compile(program, out_idx=[output], target=gpu_target())


def compile_all(compiles):
    """{name: compiled} from {name: a function that compiles}, the compiles in threads; the first
    failure raised."""
    compiled = compile_in_threads(compiles)
    for kernel in compiled.values():
        if isinstance(kernel, Exception):
            raise kernel
    return compiled


@functools.cache  # the pages' reports and the compile tests share one nvcc run
def compile_report(kernel="recurrence", B=1, N=4096, H=8, d_k=128, d_v=128, chunk_size=DEFAULT_CHUNK_SIZE,
                   block_dv=DEFAULT_BLOCK_DV, dtype="float16", value_flags=False, packed=False,
                   P=256, threads=DEFAULT_THREADS):
    """Lower and compile one program of the fast path for sm_90a without a GPU: kernel is "prepare",
    "recurrence" (dense, or packed with packed=True: run-time sizes, as prefill compiles them), one of
    the backward's ("states", "state_gradient", "state_products", "intra"), or "decode" (B sequences
    over a pool of P states); value_flags: the prepare or decode that flags bad values."""
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"dtype must be one of {KERNEL_DTYPES}, got {dtype!r}")
    if kernel == "decode":
        check_block(d_v, block_dv)
        return lower_and_report(build_decode_program(B, P, H, d_k, d_v, block_dv, dtype, "float32", threads,
                                                     value_flags))
    check_kernel_sizes(d_k, d_v, chunk_size, block_dv)
    if packed:
        B, (N, batch) = 1, packed_sizes()
    else:
        batch = None
    if kernel == "prepare":
        return lower_and_report(build_prepare_program(B, N, H, d_k, d_v, chunk_size, dtype, value_flags=value_flags,
                                                      packed=batch))
    if kernel == "recurrence":
        return lower_and_report(build_recurrence_program(B, N, H, d_k, d_v, chunk_size, block_dv, dtype,
                                                         packed=batch))
    if kernel in BUILDERS and not packed:
        return lower_and_report(BUILDERS[kernel][0](*kernel_arguments(B, N, H, d_k, d_v, chunk_size, block_dv,
                                                                      dtype)[kernel]))
    raise ValueError(f"kernel must be 'prepare', 'recurrence' (dense or packed), 'decode' or one of the backward's "
                     f"{tuple(name for name in BUILDERS if name != 'prepare')}, got {kernel!r}")
