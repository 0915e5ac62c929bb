"""Puzzle s00.histogram (fill): threads that add into one place, with an atomic.

Counts[v] = the number of i with Values[i] = v, for Values of shape (N,) holding integers in
[0, bins). One block of `threads` threads counts into counts_s, a shared tile cleared before them:
thread tx takes the values tx, tx + threads, tx + 2 threads, ... (those below N), and adds 1 into
each value's bin. Many threads hit one bin at once, so each add must be one indivisible
read-add-write: T.atomic_add. Write the thread's loop; the tile is then stored into Counts.

Read: stage 0 page, "s00.histogram".  Check: course check s00.histogram
"""


def histogram(N, bins, threads=128):
    """The TileLang program for Values: (N,) int32 -> Counts: (bins,) int32, the count of each value."""
    import tilelang.language as T

    @T.prim_func
    def histogram_program(Values: T.Tensor((N,), "int32"), Counts: T.Tensor((bins,), "int32")):
        with T.Kernel(1, threads=threads) as _block:
            tx = T.get_thread_binding()
            counts_s = T.alloc_shared((bins,), "int32")
            T.clear(counts_s)
            # EXERCISE BEGIN
            # --8<-- [start:answer]
            for k in T.serial(T.ceildiv(N, threads)):
                i = k * threads + tx
                if i < N:
                    T.atomic_add(counts_s[Values[i]], 1)
            # --8<-- [end:answer]
            # EXERCISE END
            T.copy(counts_s, Counts)

    return histogram_program
