"""stages.common.program_facts.unfenced_stores on small programs built to break its rule, and on every
library program that stages a tile for a TMA store: a store of a shared tile to global memory must
follow a `T.fence_proxy_async()` that comes after every write to the tile (stages/kda/tiles.py, "TMA
stores"). The facts are read from the TIR, so these tests run on any machine."""

import pytest

pytest.importorskip("tilelang")

ROWS, COLUMNS = 64, 32


def staged_store(fence):
    """A program that writes X_s = 2 A element by element and stores it to O, with the fence `fence`:
    None, "after" the writes, "before" them, "in_one_arm" of a branch that writes X_s in both arms, or
    "loop_top" (a loop that stores X_s first, fences, then writes the next X_s: the store reads the
    previous iteration's writes unfenced); "loop_end" fences after the loop body's writes instead."""
    import tilelang.language as T

    @T.prim_func
    def staged(A: T.Tensor((ROWS, COLUMNS), "float16"), O: T.Tensor((ROWS, COLUMNS), "float16")):
        with T.Kernel(1, threads=128):
            X_s = T.alloc_shared((ROWS, COLUMNS), "float16")
            if fence in ("loop_top", "loop_end"):
                T.clear(X_s)
                T.fence_proxy_async()
                for i in T.serial(4):
                    T.copy(X_s, O)
                    if fence == "loop_top":
                        T.fence_proxy_async()
                    for r, c in T.Parallel(ROWS, COLUMNS):
                        X_s[r, c] = A[r, c] * i
                    if fence == "loop_end":
                        T.fence_proxy_async()
            else:
                if fence == "before":
                    T.fence_proxy_async()
                if fence == "in_one_arm":
                    if A[0, 0] > 0:
                        for r, c in T.Parallel(ROWS, COLUMNS):
                            X_s[r, c] = A[r, c]
                        T.fence_proxy_async()
                    else:
                        T.copy(A, X_s)
                else:
                    for r, c in T.Parallel(ROWS, COLUMNS):
                        X_s[r, c] = A[r, c] * 2
                if fence == "after":
                    T.fence_proxy_async()
                T.copy(X_s, O)

    return staged


@pytest.mark.parametrize("fence, unfenced", [
    (None, [["X_s", "O"]]),
    ("after", []),
    ("before", [["X_s", "O"]]),
    ("in_one_arm", [["X_s", "O"]]),
    ("loop_top", [["X_s", "O"]]),
    ("loop_end", []),
])
def test_a_store_is_fenced_only_after_every_write_to_its_tile(fence, unfenced):
    from stages.common.program_facts import unfenced_stores

    assert unfenced_stores(staged_store(fence)) == unfenced


def test_a_copy_between_shared_tiles_or_into_a_fragment_is_no_tma_store():
    import tilelang.language as T

    from stages.common.program_facts import unfenced_stores

    @T.prim_func
    def staged(A: T.Tensor((ROWS, COLUMNS), "float16"), O: T.Tensor((ROWS, COLUMNS), "float16")):
        with T.Kernel(1, threads=128):
            X_s = T.alloc_shared((ROWS, COLUMNS), "float16")
            Y_s = T.alloc_shared((ROWS, COLUMNS), "float16")
            x_f = T.alloc_fragment((ROWS, COLUMNS), "float16")
            T.copy(A, X_s)
            T.copy(X_s, Y_s)
            T.copy(Y_s, x_f)
            T.copy(x_f, O)

    assert unfenced_stores(staged) == []


def library_programs():
    """{name: builder} of every fast-path program (stages/kda) at the digests' small shapes, bf16."""
    import re

    from scripts.kernel_tir_digests import _cases

    return {name: build for name, build in _cases().items()
            if re.match(r"s0[5-7]\.", name) and "/bfloat16/" in name and not name.endswith("/report")}


@pytest.mark.parametrize("name", sorted(library_programs()))
def test_every_library_program_fences_its_staged_tiles(name):
    from stages.common.program_facts import unfenced_stores

    assert unfenced_stores(library_programs()[name]()) == []
