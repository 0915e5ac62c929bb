"""What stage 4's kernel chooses beside its math: where three of its buffers live, and how TileLang
compiles it. kernel.py reads these; the page's register table compiles the kernel in every layout.
"""

# A layout places each of e^{+gamma}, e^{-gamma} and W in "registers" (a fragment) or "shared" memory. All
# three in registers needs the fewest registers and the least shared memory (the page's register table).
DEFAULT_LAYOUT = (("e_plus_gamma", "registers"), ("e_minus_gamma", "registers"), ("w", "registers"))
# Warp specialization off: 128 threads do everything, as the seed's register budget assumes, and
# ptxas's register count is the program's demand rather than the cap TileLang sets per warp group.
PASS_CONFIGS = {"tl.disable_warp_specialized": True}


def alloc_placed(layout, name, shape, dtype):
    """The buffer `name` (a name of DEFAULT_LAYOUT) of `shape` and `dtype`, a fragment or a shared buffer
    as `layout` places it. Called inside a TileLang program, like T.alloc_fragment."""
    import tilelang.language as T

    allocate = {"registers": T.alloc_fragment, "shared": T.alloc_shared}[dict(layout)[name]]
    return allocate(shape, dtype)
