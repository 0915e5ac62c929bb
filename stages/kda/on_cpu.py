"""The fast path's calls on a machine without a GPU: CPU tensors that say they are on CUDA, and each
TileLang program the calls build handed to a stand-in for `tilelang.compile`:

    interpreted      the tile interpreter runs it (stages.common.interpreter): the calls compute on the
                     CPU, every program's arithmetic and rounding as written, in seconds at small sizes
    compiled_only    it is compiled for the GPU (gpu_target(): sm_90a here) into TileLang's cache and
                     not run (its outputs are zeros): the programs a GPU run will build, compiled ahead

    with calls_on_cpu(interpreted):
        o, final_state = stages.kda.calls.forward(q, k, v, g, beta, ...)   # CPU tensors

What this leaves out is what only a GPU does: the compiled code's speed and races, TF32's last bits.
The packed prefill's programs take their sizes at run time, which the interpreter does not run: with
`interpreted` they are built again for each batch's sizes, read from the tensors the call passes
(compiled_only compiles them as the GPU does). The compile caches are emptied on entry and exit, so
that no stand-in program serves a call made outside.
"""

import contextlib
import time

import numpy as np

from stages.common.interpreter import NUMPY_DTYPES, interpret
from stages.kda.config import CHANNEL_PASSES
from stages.kda.inputs import InputForm
from stages.kda.prepare import PackedBatch, build_prepare_program
from stages.kda.recurrence import build_recurrence_program

PLAIN = InputForm()


def _torch_dtype(name):
    import torch

    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
            "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}[name]


def _outputs(program, out_idx):
    """The program's parameters and the indices of its outputs (tilelang.compile's out_idx)."""
    params = [program.buffer_map[p] for p in program.params]
    if out_idx is None:
        return params, []
    return params, [i % len(params) for i in ([out_idx] if isinstance(out_idx, int) else out_idx)]


def _shape(buffer):
    return [int(n) for n in buffer.shape]


def interpreted(program, out_idx=None, target=None, **_):
    """tilelang.compile's stand-in that runs the program on the interpreter, in place, so that a tensor
    the kernel writes into (a state pool, the flags) is written as on the GPU; the outputs are made here,
    filled with NaN (a GPU allocates them without clearing: an element the program leaves unwritten must
    not look like a computed zero), and returned as tensors of their parameters' dtypes (bf16 goes
    through float32: NumPy has no bf16; the interpreter rounds every input to its parameter's dtype)."""
    import torch

    run = interpret(program)
    params, outputs = _outputs(program, out_idx)

    def call(*tensors):
        given = iter(tensors)
        arrays, inputs = [], []
        for index, buffer in enumerate(params):
            if index in outputs:  # as a GPU's fresh memory, it may hold anything: NaN where it can
                arrays.append(np.full(_shape(buffer), np.nan if str(buffer.dtype).startswith(("float", "bfloat"))
                                      else 0, NUMPY_DTYPES[str(buffer.dtype)]))
            else:
                tensor = next(given)
                inputs.append((tensor, index))
                wide = tensor.detach().float() if tensor.dtype == torch.bfloat16 else tensor.detach()
                arrays.append(wide.numpy().copy())
        run(*arrays)
        for tensor, index in inputs:  # what the program wrote into its inputs, back into the caller's tensors
            tensor.copy_(torch.from_numpy(arrays[index]))
        made = [torch.from_numpy(arrays[i]).to(_torch_dtype(str(params[i].dtype))) for i in outputs]
        return None if not made else made[0] if len(made) == 1 else made

    return call


def compiled_only(program, out_idx=None, target=None, **options):
    """tilelang.compile's stand-in that compiles the program for real (into TILELANG_CACHE_DIR) and
    returns a kernel that runs nothing: its outputs are zeros, its in-place tensors untouched."""
    import sys

    import torch

    started = time.monotonic()
    # tilelang.compile itself, from its module: calls_on_cpu puts the stand-in in the package's name
    sys.modules["tilelang.jit"].compile(program, out_idx=out_idx, target=target, **options)
    print(f"compiled {program.attrs['global_symbol']} ({time.monotonic() - started:.0f} s)", flush=True)
    params, outputs = _outputs(program, out_idx)

    def call(*tensors):
        made = [torch.zeros(_shape(params[i]), dtype=_torch_dtype(str(params[i].dtype))) for i in outputs]
        return None if not made else made[0] if len(made) == 1 else made

    return call


def interpreted_packed_prepare(H, d_k, d_v, chunk_size, dtype, value_flags, form=PLAIN, group=1,
                               gate_dtype="float32", beta_dtype="float32", channel_passes=CHANNEL_PASSES):
    """compiled_packed_prepare's stand-in with `interpreted`: at each call the program is built for the
    batch's sizes, read from its tensors (Q's tokens, the chunk table's rows, cu_seqlens' sequences, W's
    rows), and interpreted in place."""

    def call(*tensors):
        index = 5 + 2 * form.raw_gate  # the chunk table's place: after q, k, v, g, beta (and A_log, dt_bias)
        Q, Chunks, Cu_seqlens, W = tensors[0], tensors[index], tensors[index + 1], tensors[-6]
        packed = PackedBatch(Q.shape[1], Chunks.shape[0], Cu_seqlens.numel() - 1)
        program = build_prepare_program(1, W.shape[1], H, d_k, d_v, chunk_size, dtype, channel_passes=channel_passes,
                                        value_flags=value_flags, packed=packed, form=form, group=group,
                                        gate_dtype=gate_dtype, beta_dtype=beta_dtype)
        interpreted(program)(*tensors)

    return call


def interpreted_packed_recurrence(H, d_k, d_v, chunk_size, block_dv, dtype, num_stages, programs_per_sm=1):
    """compiled_packed_recurrence's stand-in with `interpreted`, built at each call for the batch's sizes
    (W's rows, O's tokens, e^{gamma_C}'s chunks, cu_seqlens' sequences)."""

    def call(*tensors):
        W, Chunk_decay, Cu_seqlens, O = tensors[0], tensors[5], tensors[8], tensors[9]
        packed = PackedBatch(O.shape[1], Chunk_decay.shape[1], Cu_seqlens.numel() - 1)
        program = build_recurrence_program(1, W.shape[1], H, d_k, d_v, chunk_size, block_dv, dtype, num_stages,
                                           packed=packed, programs_per_sm=programs_per_sm)
        interpreted(program)(*tensors)

    return call


@contextlib.contextmanager
def calls_on_cpu(stand_in, num_sms=132):
    """Inside: torch tensors say they are on CUDA, the fast path's checks take CPU tensors, its programs
    go to `stand_in` (interpreted or compiled_only) instead of tilelang.compile, one at a time, on a
    GPU of num_sms SMs (an H100's and an H200's 132)."""
    import tilelang
    import torch

    import stages.kda.checks
    import stages.kda.compiled as compiled
    import stages.kda.config

    replaced = [(torch.Tensor, "is_cuda", property(lambda self: True)), (tilelang, "compile", stand_in),
                (stages.kda.config, "streaming_multiprocessors", lambda device: num_sms),
                (stages.kda.checks, "check_on_cuda", lambda tensors: None),
                (compiled, "compile_all", lambda compiles: {name: make() for name, make in compiles.items()})]
    if stand_in is interpreted:  # the packed programs' run-time sizes: built again for each batch
        replaced += [(compiled, "compiled_packed_prepare", interpreted_packed_prepare),
                     (compiled, "compiled_packed_recurrence", interpreted_packed_recurrence)]
    saved = [(owner, name, owner.__dict__[name] if name in owner.__dict__ else None) for owner, name, _ in replaced]
    _empty_caches(compiled)
    try:
        for owner, name, value in replaced:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in saved:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        _empty_caches(compiled)


def _empty_caches(compiled):
    for function in (compiled.compiled_prepare, compiled.compiled_recurrence, compiled.compiled_activation,
                     compiled.compiled_backward_kernel, compiled.compiled_backward_kernels,
                     compiled.compiled_packed_prepare, compiled.compiled_packed_recurrence,
                     compiled.compiled_prefill_kernels, compiled.compiled_decode):
        function.cache_clear()


def each_in_a_process(script, cases, jobs, arguments=()):
    """Run `python script --cases NAME *arguments` for each of `cases` in a process of its own, `jobs` at
    a time (TileLang compiles a program on one core: a precompile's cases go side by side on a machine's
    cores, sharing TileLang's cache); returns the cases whose process failed."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    def run(name):
        return subprocess.run([sys.executable, str(script), "--cases", name, *arguments]).returncode

    with ThreadPoolExecutor(jobs) as pool:
        codes = list(pool.map(run, cases))
    return [name for name, code in zip(cases, codes) if code != 0]
