"""Puzzle s00.column_sum (fill): a pipelined loop that accumulates.

O[j] = A[0, j] + ... + A[N - 1, j] for A of shape (N, D), N a multiple of block_n and D of
block_d. Block j owns block_d columns and walks down them, block_n rows at a time, in a
T.Pipelined loop (on the GPU the next tile's load overlaps this tile's sum): each tile is loaded
into the fragment A_f and its columns are summed into sums_f, which holds the running total from
tile to tile; at the end sums_f is stored into O's slice. Write the loop, and what comes before and
after it.

Read: stage 0 page, "s00.column_sum".  Check: course check s00.column_sum
"""


def column_sum(N, D, block_n=16, block_d=16, num_stages=2, dtype="float32"):
    """The TileLang program for A: (N, D) -> O: (D,), the sum of each column."""
    import tilelang.language as T

    @T.prim_func
    def column_sum_program(A: T.Tensor((N, D), dtype), O: T.Tensor((D,), dtype)):
        with T.Kernel(D // block_d, threads=128) as j:
            A_f = T.alloc_fragment((block_n, block_d), dtype)
            sums_f = T.alloc_fragment((block_d,), dtype)
            # EXERCISE BEGIN
            # --8<-- [start:answer]
            T.clear(sums_f)
            for k in T.Pipelined(N // block_n, num_stages=num_stages):
                T.copy(A[k * block_n:(k + 1) * block_n, j * block_d:(j + 1) * block_d], A_f)
                T.reduce_sum(A_f, sums_f, dim=0, clear=False)
            T.copy(sums_f, O[j * block_d:(j + 1) * block_d])
            # --8<-- [end:answer]
            # EXERCISE END

    return column_sum_program
