"""Exercise s04.build_kernel (build): the KDA kernel, written whole from an empty body.

Write build_program so that it returns a `@T.prim_func` computing the chunked KDA forward, as
reference C does (exercise s04.kernel_mirror: your kernel_mirror.py beside this file): stage 3's
kernel with a gate per key channel, so the decay between two rows is e^{gamma_c - gamma_i} channel by
channel, and enters the products through the split e^{gamma_c} e^{-gamma_i}. Any correct program
passes: choose your own grid, tiles, pairing of beta and order, within what the tests below ask.

What is given, and what the tests need:
- the signature below, and the parameters of the prim_func in this order: Q, K, V, G, Beta (inputs;
  G the log gate per token and key channel, float32 of shape (B, N, H, d_k); Beta the write strength
  per token, float32 of shape (B, N, H)), O (the output, written once per element); `layout` is the
  course's tuning knob (where e^{+gamma}, e^{-gamma} and W live): you may ignore it;
- the layout: the state is kept as S^T (d_k x d_v), as in reference C; a program may own a block of
  block_dv of its columns;
- the buffer names that the ordering check reads in your TIR (stages.common.ordering): the state is
  an fp32 fragment `S_f` that lives across the chunk loop, its copy that the products read is the
  shared buffer `S_s`, and each chunk's output is summed in the fp32 fragment `acc_o`; the state's
  decay is a store into `S_f` (an element-wise loop), its update a `T.gemm` into `S_f`;
- the chunk loop is the program's one `T.Pipelined` loop; every exp is exp2(x * log2(e)); the gates
  stay within the wrapper's bound (stages/s04_kda/numerics.py: no chunk decays a channel by more
  than e^{-14 ln 2} in fp16).

The tests (tests/exercises/s04_kda/test_build_kernel.py), all on a CPU:
- float64 through the tile interpreter equals reference C, with one chunk and with several chunks
  and two blocks of value columns, channel gates a in [0.5, 0.999], beta over [0, 1] with exact 0s
  and 1s; fp16 is within fp16's rounding of reference A;
- strong gates: channels with g = -5 per token in float64 (e^{-80} across a chunk of 16), and
  channels at the fp16 bound in fp16;
- a length that is not a multiple of the chunk, zero-padded as the wrapper pads it (g = 0, beta = 0);
- the program writes O and nothing else (the inputs are unchanged);
- ordering constraints 1, 2 and 7: the output reads the state before the chunk changes it; the state
  decays before the product adds the chunk to it; the state is cleared once, before the chunk loop,
  the output accumulator in every chunk;
- the cost at B = 1, N = 1024, H = 4, d_k = d_v = 128, your tile defaults: at most 1.25 times the
  course kernel's global bytes and GEMM FLOPs, and at least half its GEMM FLOPs, as
  stages.common.program_cost counts them from your TIR (a tile loaded from global memory twice goes
  over; products summed element by element, off the tensor cores, fall short; the tune exercise asks
  for more);
- the H200's budget at d_k = d_v = 128, chunk_size = 64: at most 227 KiB of shared memory per block
  (counted from your TIR); with `course check s04 --compile` (nvcc), no register spills.
Read: stage 4 page, "s04.build_kernel".  Check: course check s04
"""

from stages.common.tilelang_tools import LOG2_E
from stages.s04_kda.kernel import DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE, DEFAULT_LAYOUT


def build_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=DEFAULT_BLOCK_DV,
                  dtype="float16", num_stages=1, threads=128, layout=DEFAULT_LAYOUT):
    """The TileLang program for q, k: (B, N, H, d_k), v: (B, N, H, d_v), g: (B, N, H, d_k) fp32,
    beta: (B, N, H) fp32 -> o: (B, N, H, d_v). State S^T: (d_k, block_dv) per program.

    N must be a multiple of chunk_size (the wrapper pads), block_dv must divide d_v. layout maps
    "e_plus_gamma", "e_minus_gamma" and "w" to "registers" or "shared".
    """
    # EXERCISE BEGIN
    raise NotImplementedError("s04.build_kernel: fill this region; see the docstring and the page")
    # EXERCISE END
