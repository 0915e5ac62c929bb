"""Puzzle s00.copy_tile (fill): a copy, block by block, through shared memory.

O = A for A of shape (N,), N a multiple of `block`. The grid has N // block blocks; block b owns the
elements b * block to (b + 1) * block - 1 and moves them through A_s, a tile in shared memory:
first A's slice into A_s, then A_s into O's slice. Write the two copies.

Read: stage 0 page, "s00.copy_tile".  Check: course check s00.copy_tile
"""


def copy_tile(N, block=32, dtype="float32"):
    """The TileLang program for A: (N,) -> O: (N,), O = A."""
    import tilelang.language as T

    @T.prim_func
    def copy_tile_program(A: T.Tensor((N,), dtype), O: T.Tensor((N,), dtype)):
        with T.Kernel(N // block, threads=32) as b:
            A_s = T.alloc_shared((block,), dtype)
            # EXERCISE BEGIN
            # --8<-- [start:answer]
            T.copy(A[b * block:(b + 1) * block], A_s)
            T.copy(A_s, O[b * block:(b + 1) * block])
            # --8<-- [end:answer]
            # EXERCISE END

    return copy_tile_program
