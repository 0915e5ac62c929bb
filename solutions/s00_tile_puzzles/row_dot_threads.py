"""Puzzle s00.row_dot_threads (fill): threads, each with a variable of its own.

O[r] = A[r, 0] B[r, 0] + ... + A[r, D - 1] B[r, D - 1] for A and B of shape (M, D): one row per
thread, written below the tile level. Each block launches `threads` threads; thread tx of block b
owns row r = b * threads + tx, and the rows past M (the last block may reach past them) do nothing.
A thread sums its row's products in `total`, a T.alloc_var (one register per thread), over a serial
loop, then stores it into O[r]. Write the thread's work.

Read: stage 0 page, "s00.row_dot_threads".  Check: course check s00.row_dot_threads
"""


def row_dot_threads(M, D, threads=32, dtype="float32"):
    """The TileLang program for A, B: (M, D) -> O: (M,), the dot product of each row of A with the
    same row of B."""
    import tilelang.language as T

    @T.prim_func
    def row_dot_threads_program(A: T.Tensor((M, D), dtype), B: T.Tensor((M, D), dtype), O: T.Tensor((M,), dtype)):
        with T.Kernel(T.ceildiv(M, threads), threads=threads) as b:
            tx = T.get_thread_binding()
            r = b * threads + tx
            total = T.alloc_var(dtype)
            # EXERCISE BEGIN
            # --8<-- [start:answer]
            if r < M:
                total = 0
                for j in T.serial(D):
                    total += A[r, j] * B[r, j]
                O[r] = total
            # --8<-- [end:answer]
            # EXERCISE END

    return row_dot_threads_program
