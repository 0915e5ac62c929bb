"""Puzzle s00.gemm_tile (fill): one GEMM on the tensor cores.

C = A W^T for A of shape (M, K) and W of shape (N, K) (a weight in the layout of torch's
nn.Linear), fp16 operands, the product summed in an fp32 fragment. One block: load A and W into
their shared tiles, multiply them with T.gemm into C_f (its flags say which operand is transposed,
and whether C_f is cleared first), store C_f into C. Write the four steps.

Read: stage 0 page, "s00.gemm_tile".  Check: course check s00.gemm_tile
"""


def gemm_tile(M, N, K, dtype="float16", accum_dtype="float32"):
    """The TileLang program for A: (M, K), W: (N, K) -> C: (M, N) in accum_dtype, C = A W^T."""
    import tilelang.language as T

    @T.prim_func
    def gemm_tile_program(A: T.Tensor((M, K), dtype), W: T.Tensor((N, K), dtype), C: T.Tensor((M, N), accum_dtype)):
        with T.Kernel(1, threads=128) as _block:
            A_s = T.alloc_shared((M, K), dtype)
            W_s = T.alloc_shared((N, K), dtype)
            C_f = T.alloc_fragment((M, N), accum_dtype)
            # EXERCISE BEGIN
            raise NotImplementedError("s00.gemm_tile: fill this region; see the docstring and the page")
            # EXERCISE END

    return gemm_tile_program
