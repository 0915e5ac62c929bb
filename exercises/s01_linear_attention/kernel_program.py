"""Exercise s01.kernel_program (fill): the chunk loop of stage 1's TileLang kernel.

One program per (block of d_v columns, batch x head) keeps its slice of the state S^T (d_k x
block_dv) in an fp32 register fragment and walks the chunks. The loads of each chunk are written;
fill in the rest of the loop body: the chunk's output, inter-chunk and intra-chunk terms, written to
O, and the state's move past the chunk. Every buffer you need is allocated above the loop.

Without a GPU the tests run your program through the course's tile interpreter
(stages.common.interpreter) and compare it with reference C; with nvcc they also compile it for
sm_90a, and on a GPU they run it.
Read: stage 1 page, "The kernel".  Check: course check s01
"""

from stages.s01_linear_attention.kernel import DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE


def build_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=DEFAULT_BLOCK_DV,
                  dtype="float16", num_stages=2, threads=128):
    """The TileLang program for q, k: (B, N, H, d_k), v: (B, N, H, d_v) -> o: (B, N, H, d_v).

    N must be a multiple of chunk_size (the wrapper pads), block_dv must divide d_v.
    """
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

                # EXERCISE BEGIN
                raise NotImplementedError("s01.kernel_program: fill this region; see the docstring and the page")
                # EXERCISE END

    return linear_attention_fwd
