"""Puzzle s00.masked_relu (fill): a masked load and store, for a length that is not a multiple of
the block.

O[i] = max(A[i], 0) for A of shape (N,). The grid has ceil(N / block) blocks, so the last one may
reach past the end of A: its lanes i with b * block + i >= N must neither load nor store. Write the
T.Parallel loop over the block's `block` lanes, each lane guarded.

Read: stage 0 page, "s00.masked_relu".  Check: course check s00.masked_relu
"""


def masked_relu(N, block=32, dtype="float32"):
    """The TileLang program for A: (N,) -> O: (N,), O = max(A, 0)."""
    import tilelang.language as T

    @T.prim_func
    def masked_relu_program(A: T.Tensor((N,), dtype), O: T.Tensor((N,), dtype)):
        with T.Kernel(T.ceildiv(N, block), threads=32) as b:
            # EXERCISE BEGIN
            # --8<-- [start:answer]
            for i in T.Parallel(block):
                if b * block + i < N:
                    O[b * block + i] = T.max(A[b * block + i], 0)
            # --8<-- [end:answer]
            # EXERCISE END

    return masked_relu_program
