"""Exercise s01.build_kernel (build): stage 1's TileLang kernel, written whole from an empty body.

Write build_program so that it returns a `@T.prim_func` computing o = chunked linear attention of
q, k, v, as reference C does (exercise s01.kernel_mirror: your kernel_mirror.py beside this file). Any
correct program passes: choose your own grid, tiles and order, within what the tests below ask.

What is given, and what the tests need:
- the signature below, and the parameters of the prim_func in this order: Q, K, V (inputs), O (the
  output, written once per element);
- the layout: the state is kept as S^T (d_k x d_v), as in reference C; a program may own a block of
  block_dv of its columns (column c of the output needs only column c of V and of the state);
- the buffer names that the ordering check reads in your TIR (stages.common.ordering): the state is
  an fp32 fragment `S_f` that lives across the chunk loop, its copy that the output's product reads
  is the shared buffer `S_s`, and each chunk's output is summed in the fp32 fragment `acc_o`;
- the chunk loop is the program's one `T.Pipelined` loop.

The tests (tests/exercises/s01_linear_attention/test_build_kernel.py), all on a CPU:
- float64 through the tile interpreter equals reference C, with one chunk and with several chunks
  and two blocks of value columns; fp16 is within fp16's rounding of reference A;
- a length that is not a multiple of the chunk, zero-padded as the wrapper pads it;
- the program writes O and nothing else (the inputs are unchanged);
- ordering constraints 1 and 7: the output reads the state before the chunk changes it; the state
  is cleared once, before the chunk loop, the output accumulator in every chunk;
- the cost at B = 1, N = 1024, H = 4, d_k = d_v = 128, your tile defaults: at most 1.25 times the
  course kernel's global bytes and GEMM FLOPs, and at least half its GEMM FLOPs, as
  stages.common.program_cost counts them from your TIR (a tile loaded from global memory twice goes
  over; products summed element by element, off the tensor cores, fall short);
- the H200's budget at d_k = d_v = 128, chunk_size = 64: at most 227 KiB of shared memory per block
  (counted from your TIR); with `course check s01 --compile` (nvcc), no register spills.
Read: stage 1 page, "s01.build_kernel".  Check: course check s01
"""

from stages.s01_linear_attention.kernel import DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE


def build_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=DEFAULT_BLOCK_DV,
                  dtype="float16", num_stages=2, threads=128):
    """The TileLang program for q, k: (B, N, H, d_k), v: (B, N, H, d_v) -> o: (B, N, H, d_v).

    N must be a multiple of chunk_size (the wrapper pads), block_dv must divide d_v. Accumulate in
    fp32; the operands of the tensor-core products are in `dtype`.
    """
    # EXERCISE BEGIN
    raise NotImplementedError("s01.build_kernel: fill this region; see the docstring and the page")
    # EXERCISE END
