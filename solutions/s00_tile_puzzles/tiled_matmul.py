"""Puzzle s00.tiled_matmul (fill): a matrix product tiled through shared memory.

C = A B for A of shape (M, K) and B of shape (K, N), each a multiple of its tile (block_m,
block_k, block_n), fp16 operands and an fp32 accumulator. Block (bx, by) owns the tile of C at
rows by * block_m and columns bx * block_n. It walks K a tile at a time in a T.Pipelined loop:
loads A's (block_m x block_k) tile and B's (block_k x block_n) tile into A_s and B_s, and adds
their product into C_f, cleared once before the loop; then stores C_f into its tile of C.

Read: stage 0 page, "s00.tiled_matmul".  Check: course check s00.tiled_matmul
"""


def tiled_matmul(M, N, K, block_m=32, block_n=32, block_k=32, num_stages=2, dtype="float16",
                 accum_dtype="float32"):
    """The TileLang program for A: (M, K), B: (K, N) -> C: (M, N) in accum_dtype, C = A B."""
    import tilelang.language as T

    @T.prim_func
    def tiled_matmul_program(A: T.Tensor((M, K), dtype), B: T.Tensor((K, N), dtype),
                             C: T.Tensor((M, N), accum_dtype)):
        with T.Kernel(N // block_n, M // block_m, threads=128) as (bx, by):
            A_s = T.alloc_shared((block_m, block_k), dtype)
            B_s = T.alloc_shared((block_k, block_n), dtype)
            C_f = T.alloc_fragment((block_m, block_n), accum_dtype)
            # EXERCISE BEGIN
            # --8<-- [start:answer]
            T.clear(C_f)
            for k in T.Pipelined(K // block_k, num_stages=num_stages):
                T.copy(A[by * block_m:(by + 1) * block_m, k * block_k:(k + 1) * block_k], A_s)
                T.copy(B[k * block_k:(k + 1) * block_k, bx * block_n:(bx + 1) * block_n], B_s)
                T.gemm(A_s, B_s, C_f)
            T.copy(C_f, C[by * block_m:(by + 1) * block_m, bx * block_n:(bx + 1) * block_n])
            # --8<-- [end:answer]
            # EXERCISE END

    return tiled_matmul_program
