"""The fast path's sizes: the constants its kernels are built around, and the configuration a call
resolves from the shape and the GPU (`resolve`), one frozen object that the calls, the benchmarks and
the tests read instead of working the defaults out again.

    SUB_BLOCK       16: rows of a sub-block, the tensor cores' M and K granularity; the anchors and the
                    block inverse work on these (reference C mirrors it)
    CHANNEL_PASSES  2: the prepare's and the intra kernel's score GEMMs sum over d_k in this many
                    passes (their operands hold d_k / 2 channels); the forward's prepare at C = 32
                    takes CHUNK_32_PASSES where d_k allows (default_channel_passes)
"""

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

SUB_BLOCK = 16
CHANNEL_PASSES = 2
CHUNK_32_PASSES = 4  # the forward's prepare at C = 32: four programs an SM where two passes fit three
DEFAULT_CHUNK_SIZE = 64
DEFAULT_BLOCK_DV = 32
DEFAULT_THREADS = 128  # the recurrence's and decode's programs: one warp group
DEFAULT_NUM_STAGES = 2  # the recurrence's chunk loop: loads of chunk i + 1 in flight during chunk i
# decode's value columns per program where d_v allows: at B >= 8 on the H200, 64 moved the states 3-7%
# faster than 32, and 128 was slower still (benchmarks/results/decode_b64_blocks.csv; decode*.csv)
DECODE_BLOCK_DV = 64
MANY_SEQUENCE_HEADS = 64  # sequences x heads from which the forward runs at C = 32 (default_chunk_size)
SHARED_MEMORY_PER_BLOCK = 232_448  # bytes of shared memory a program may opt in to on an H100 or H200 (227 KiB)
REGISTERS_PER_SM = 65_536
LOADER_REGISTERS = 24  # a thread of the warp group that only issues the TMA loads (TileLang's own figure)
# the backward at head dims above WIDE_HEAD_DIM (up to BACKWARD_MOST_HEAD_DIM): chunk WIDE_HEAD_CHUNK_SIZE
# (backward_chunk_size) and the state products by blocks of columns (state_products_value_block)
WIDE_HEAD_DIM = 128
BACKWARD_MOST_HEAD_DIM = 256
WIDE_HEAD_CHUNK_SIZE = 32


@dataclass(frozen=True)
class KernelConfig:
    """What a call of the fast path runs with: the chunk size C, the recurrence's value columns a
    program (block_dv), its threads and pipeline stages, the prepare's and the intra kernel's threads,
    and the forward's prepare's channel passes (its score GEMMs' operands hold d_k / channel_passes
    channels: more passes, less shared memory, more programs an SM), and the recurrence's launch bound
    (programs_per_sm: how many of its programs share an SM)."""

    chunk_size: int = DEFAULT_CHUNK_SIZE
    block_dv: int = DEFAULT_BLOCK_DV
    threads: int = DEFAULT_THREADS
    num_stages: int = DEFAULT_NUM_STAGES
    prepare_threads: int = 256
    intra_threads: int = 256
    channel_passes: int = CHANNEL_PASSES
    programs_per_sm: int = 1


def resolve(B: int, H: int, d_k: int, d_v: int, num_sms: int, chunk_size: int | None = None,
            block_dv: int | None = None, threads: int = DEFAULT_THREADS, num_stages: int | None = None,
            prepare_threads: int | None = None, channel_passes: int | None = None,
            programs_per_sm: int = 1) -> KernelConfig:
    """The configuration for B sequences (rows of a batch, or packed sequences) of H heads on a GPU of
    num_sms SMs: every size not given takes its default (default_chunk_size, default_block_dv,
    default_num_stages, default_prepare_threads, default_intra_threads, default_channel_passes; the
    recurrence's launch bound, programs_per_sm, 1: stage 5's page tells why no other is taken yet). Sizes
    are not checked here (stages.kda.checks does). The backward's kernels run at backward_chunk_size: its
    callers pass it."""
    chunk_size = chunk_size or default_chunk_size(B, H)
    block_dv = default_block_dv(B, H, d_v, num_sms) if block_dv is None else block_dv
    return KernelConfig(chunk_size=chunk_size, block_dv=block_dv, threads=threads,
                        num_stages=num_stages or default_num_stages(chunk_size, d_k, block_dv),
                        prepare_threads=prepare_threads or default_prepare_threads(chunk_size),
                        intra_threads=default_intra_threads(chunk_size, d_k),
                        channel_passes=channel_passes or default_channel_passes(chunk_size, d_k),
                        programs_per_sm=programs_per_sm)


def resolve_for(device: "torch.device", B: int, H: int, d_k: int, d_v: int, **sizes) -> KernelConfig:
    """`resolve` on the GPU `device` (its SM count read once)."""
    return resolve(B, H, d_k, d_v, streaming_multiprocessors(device), **sizes)


# --8<-- [start:default_block_dv]
def default_chunk_size(B: int, H: int) -> int:
    """The forward's chunk: 32 where B * H sequence-heads are many (at least MANY_SEQUENCE_HEADS), else
    DEFAULT_CHUNK_SIZE (64).

    The prepare's work per token grows with C (the score sub-blocks, the inverse's merges) and it is
    most of the forward's time; the recurrence walks N / C chunks in a row, one program per value
    block and sequence-head. Where there are many sequence-heads the prepare's share is the larger and
    C = 32 wins; with few, the recurrence's longer walk loses it (measured on an H100 with 8192
    tokens, kernels alone: H = 64, 1.03 ms at C = 32 against 1.14 at 64; H = 96, 1.68 against 1.78;
    benchmarks/results/kda_chunk_sizes_h100/).
    """
    return 32 if B * H >= MANY_SEQUENCE_HEADS else DEFAULT_CHUNK_SIZE


def default_block_dv(B: int, H: int, d_v: int, num_sms: int) -> int:
    """The recurrence's columns a program: 64 where B * H * d_v / 64 programs still give nine SMs in
    ten one (a few idle SMs cost less than reading everything twice), else DEFAULT_BLOCK_DV (32).

    Every program of one (batch, head) reads the same W, Q e^gamma, K e^{gamma_C - gamma} and A_qk, so
    64 columns halve what the recurrence reads; but each program walks all N / C chunks in a row, so
    fewer programs than SMs leave SMs idle for the whole kernel (the stage 5 page times both sides; on
    an H100's 132 SMs, 128 programs of 64 columns took 0.265 ms where 256 of 32 took 0.309:
    benchmarks/results/kda_chunk_sizes_h100/).
    """
    wide = 2 * DEFAULT_BLOCK_DV
    return wide if d_v % wide == 0 and 10 * B * H * (d_v // wide) >= 9 * num_sms else DEFAULT_BLOCK_DV
# --8<-- [end:default_block_dv]


def recurrence_shared_bytes(chunk_size: int, d_k: int, block_dv: int, num_stages: int) -> int:
    """The recurrence program's shared memory in bytes (fp16 or bf16 operands): each pipeline stage
    holds one chunk's W, Q e^gamma, K e^{gamma_C - gamma} (C x d_k), A_qk (C x C), U (C x block_dv) and
    e^{gamma_C} (d_k, fp32); beside the stages, the state as a GEMM operand (d_k x block_dv), V_new and
    o (C x block_dv each). TileLang lays them out one after another, so this is the size the launch
    asks for (tests/kernels/test_kda_package.py compares it with the lowered program's)."""
    C = chunk_size
    stage = 2 * (3 * C * d_k + C * C + C * block_dv) + 4 * d_k
    return num_stages * stage + 2 * (d_k * block_dv + 2 * C * block_dv)


def computing_registers(threads: int, programs_per_sm: int) -> int:
    """The registers a thread of the recurrence's computing warp group asks for (`setmaxnreg.inc`) when
    programs_per_sm programs of `threads` threads, half loading and half computing, share an SM.

    Each thread starts with the launch bound's share, R = 65,536 / (threads * programs_per_sm) rounded
    down to a multiple of 8 (ptxas allocates registers in eights); the loading warp group gives back
    R - LOADER_REGISTERS a thread (`setmaxnreg.dec`) and the computing one, of the same size, takes
    them: 2R - LOADER_REGISTERS (232 at two programs of 256 threads, 136 at three), at most 240, the
    most TileLang's hint takes. Asking for more than the loading group gave back would wait forever:
    the registers come from the program's own."""
    share = REGISTERS_PER_SM // (threads * programs_per_sm) // 8 * 8
    return min(2 * share - LOADER_REGISTERS, 240)


def default_num_stages(chunk_size: int, d_k: int, block_dv: int) -> int:
    """The recurrence's pipeline stages: DEFAULT_NUM_STAGES where they fit SHARED_MEMORY_PER_BLOCK, else 1.
    Two stages load chunk i + 1 while chunk i computes; at d_k = 256 and C = 64 they would ask for
    247,808 B, past what a program may have, and the launch fails: one stage (136,192 B) runs."""
    fits = recurrence_shared_bytes(chunk_size, d_k, block_dv, DEFAULT_NUM_STAGES) <= SHARED_MEMORY_PER_BLOCK
    return DEFAULT_NUM_STAGES if fits else 1


def backward_chunk_size(d_k: int, d_v: int, chunk_size: int = DEFAULT_CHUNK_SIZE) -> int:
    """The chunk a call that trains runs at: chunk_size up to head dims of WIDE_HEAD_DIM (128), else
    WIDE_HEAD_CHUNK_SIZE (32). The intra kernel holds the chunk's q, k, gamma, v, V_new, dV_new and dO
    whole in shared memory: at d_k = d_v = 256 it asks for 220,304 B at C = 32 and about 396 KB at 64,
    past SHARED_MEMORY_PER_BLOCK (lowered for sm_90a: tests/kernels/test_kda_package.py). The chunk
    changes no result beyond rounding: the forward and the backward of one call share it."""
    return WIDE_HEAD_CHUNK_SIZE if max(d_k, d_v) > WIDE_HEAD_DIM else chunk_size


def state_products_value_block(d_k: int, d_v: int) -> int:
    """The state products' columns a step: d_v whole up to head dims of WIDE_HEAD_DIM (S^T and dS^T
    2 x 32 KiB in fp16), else 64 (or 32 where 64 does not divide d_v): whole, at 256 x 256, they
    would take 2 x 128 KiB, past SHARED_MEMORY_PER_BLOCK."""
    if max(d_k, d_v) <= WIDE_HEAD_DIM:
        return d_v
    return 64 if d_v % 64 == 0 else 32


def default_channel_passes(chunk_size: int, d_k: int) -> int:
    """The forward's prepare's channel passes: CHUNK_32_PASSES at C = 32 where d_k is whole 16-wide GEMM
    steps in four passes (a multiple of 64), else CHANNEL_PASSES.

    At C = 32 the prepare's shared memory decides how many of its programs share an SM: 57,744 B in two
    passes (three programs, 12 warps), 47,616 B in four (four programs, 16 warps; bf16, d_k = 128,
    benchmarks/results/kda_prepare_occupancy.txt). The passes sum the same products into the same fp32
    accumulators in the same order: the outputs are bitwise those of two passes (on an H100, o and the
    final state at T 8192 H 96 and 8 x 4096 H 16). Measured on an H100 as Kimi Linear calls it, kernels
    alone as CUDA graphs: 1.873 -> 1.706 ms (T 8192, H 96) and 1.309 -> 1.179 ms (8 x 4096, H 16)
    (benchmarks/results/kimi_call_four_passes/). At C = 64 four passes leave two programs an SM, as two
    do: not taken there unmeasured.
    """
    return CHUNK_32_PASSES if chunk_size == 32 and d_k % (16 * CHUNK_32_PASSES) == 0 else CHANNEL_PASSES


def default_prepare_threads(chunk_size: int) -> int:
    """As many warps as the C x 16 slab GEMMs can share (one per 16 x 8 tile): 256 threads at C = 64.

    The prepare kernel's elementwise passes and merges are most of its work; more warps split them.
    """
    return 32 * (chunk_size // 16) * (SUB_BLOCK // 8)


def default_intra_threads(chunk_size: int, d_k: int, channel_passes: int = CHANNEL_PASSES) -> int:
    """As many warps as the intra kernel's smallest GEMMs can share, at most 8 (two warp groups).

    A warp of a tensor-core GEMM owns whole 16 x 8 tiles of the output. The smallest outputs are one
    sub-block high (16 rows, one tile) and d_k / channel_passes channels (the score slabs) or C
    columns (the block inverse's merges) wide: the warps must split both widths into whole tiles,
    so their number divides gcd(C, d_k / channel_passes) / 8: 256 threads at C = 64, d_k = 128, and
    128 at d_k = 64. More warps split the elementwise passes, which are most of the kernel's time (the
    stage 6 page times 128 against 256 threads). With two warp groups, a GEMM operand must be a
    buffer of its own rather than a row slice of a larger one (see K_slab_col_s), and the compile
    tests check every warp group's operand offset (CompileReport.misplaced_warp_group_operands).
    """
    return 32 * min(8, math.gcd(chunk_size, d_k // channel_passes) // 8)


def decode_block_dv(d_v: int) -> int:
    """decode's default block_dv: DECODE_BLOCK_DV where it divides d_v, else DEFAULT_BLOCK_DV."""
    return DECODE_BLOCK_DV if d_v % DECODE_BLOCK_DV == 0 else DEFAULT_BLOCK_DV


def most_chunks(T: int, N_seq: int, chunk_size: int) -> int:
    """The most chunks T tokens cut into N_seq sequences can take: a sequence of n tokens takes
    ceil(n / C) <= floor(n / C) + 1 chunks, and the floors sum to at most floor(T / C)."""
    return T // chunk_size + N_seq


@functools.cache
def streaming_multiprocessors(device: "torch.device") -> int:
    """The SM count of a CUDA device, read once."""
    import torch

    return torch.cuda.get_device_properties(device).multi_processor_count
