"""Puzzle s00.chunk_cumsum (fill): a cumulative sum that restarts at every chunk.

G[t] = g[c * C] + g[c * C + 1] + ... + g[t] for g of shape (N,), where c = t // C is t's chunk and
N is a multiple of C: the running sum of log gates inside each chunk, which stage 2 turns into its
decay table. One block per chunk: load the chunk into the shared tile g_s, sum it in place with
T.cumsum, store it into G's slice. Write the three steps.

Read: stage 0 page, "s00.chunk_cumsum".  Check: course check s00.chunk_cumsum
"""


def chunk_cumsum(N, chunk_size=16, dtype="float32"):
    """The TileLang program for g: (N,) -> G: (N,), the cumulative sum of g within each chunk."""
    import tilelang.language as T

    C = chunk_size

    @T.prim_func
    def chunk_cumsum_program(g: T.Tensor((N,), dtype), G: T.Tensor((N,), dtype)):
        with T.Kernel(N // C, threads=32) as c:
            g_s = T.alloc_shared((C,), dtype)
            # EXERCISE BEGIN
            # --8<-- [start:answer]
            T.copy(g[c * C:(c + 1) * C], g_s)
            T.cumsum(g_s, dim=0)
            T.copy(g_s, G[c * C:(c + 1) * C])
            # --8<-- [end:answer]
            # EXERCISE END

    return chunk_cumsum_program
