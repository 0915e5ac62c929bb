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
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    num_chunks = N // C

    @T.prim_func
    def linear_attention_fwd(
        Q: T.Tensor((B, N, H, d_k), dtype),
        K: T.Tensor((B, N, H, d_k), dtype),
        V: T.Tensor((B, N, H, d_v), dtype),
        O: T.Tensor((B, N, H, d_v), dtype),
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv

            Q_s = T.alloc_shared((C, d_k), dtype)
            K_s = T.alloc_shared((C, d_k), dtype)
            V_s = T.alloc_shared((C, block_dv), dtype)
            S_s = T.alloc_shared((d_k, block_dv), dtype)  # the state as a GEMM operand
            scores_s = T.alloc_shared((C, C), dtype)

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state: lives across chunks
            scores = T.alloc_fragment((C, C), accum_dtype)
            acc_o = T.alloc_fragment((C, block_dv), accum_dtype)

            T.clear(S_f)  # once, outside the chunk loop: the state carries over
            for i_c in T.Pipelined(num_chunks, num_stages=num_stages):
                t0 = i_c * C
                T.copy(Q[b, t0:t0 + C, h, :], Q_s)
                T.copy(K[b, t0:t0 + C, h, :], K_s)
                T.copy(V[b, t0:t0 + C, h, v0:v0 + block_dv], V_s)

                # intra-chunk scores Q K^T, causally masked with the diagonal included
                T.gemm(Q_s, K_s, scores, transpose_B=True, clear_accum=True)
                for r, j in T.Parallel(C, C):
                    scores_s[r, j] = T.if_then_else(j <= r, scores[r, j], 0)

                # inter-chunk term Q S^T, then the intra-chunk term added into the same accumulator
                T.copy(S_f, S_s)
                T.gemm(Q_s, S_s, acc_o, clear_accum=True)
                T.gemm(scores_s, V_s, acc_o)
                T.copy(acc_o, O[b, t0:t0 + C, h, v0:v0 + block_dv])

                # only now does the state move past this chunk: S^T += K^T V
                T.gemm(K_s, V_s, S_f, transpose_A=True)

    return linear_attention_fwd
    # EXERCISE END
