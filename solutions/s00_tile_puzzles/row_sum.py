"""Puzzle s00.row_sum (fill): a reduction.

O[r] = A[r, 0] + ... + A[r, D - 1] for A of shape (M, D), M a multiple of `rows`. Block b owns the
rows b * rows to (b + 1) * rows - 1: it loads them into the fragment A_f (registers), reduces each
row into sums_f with T.reduce_sum, and stores sums_f into O's slice. Write the three steps.

Read: stage 0 page, "s00.row_sum".  Check: course check s00.row_sum
"""


def row_sum(M, D, rows=8, dtype="float32"):
    """The TileLang program for A: (M, D) -> O: (M,), the sum of each row."""
    import tilelang.language as T

    @T.prim_func
    def row_sum_program(A: T.Tensor((M, D), dtype), O: T.Tensor((M,), dtype)):
        with T.Kernel(M // rows, threads=128) as b:
            A_f = T.alloc_fragment((rows, D), dtype)
            sums_f = T.alloc_fragment((rows,), dtype)
            # EXERCISE BEGIN
            # --8<-- [start:answer]
            T.copy(A[b * rows:(b + 1) * rows, :], A_f)
            T.reduce_sum(A_f, sums_f, dim=1)
            T.copy(sums_f, O[b * rows:(b + 1) * rows])
            # --8<-- [end:answer]
            # EXERCISE END

    return row_sum_program
