"""Input checks shared by the NumPy references of every stage.

The rule: the references compute in float64 and take NumPy float64 arrays only. A list, a torch
tensor, or an integer, float32 or float16 array is refused with a TypeError that says how to
convert it (np.asarray(x, dtype=np.float64)), rather than converted in silence: a float32 product
hidden in a float64 reference would pass for the truth the kernels are measured against. Every
entry must be finite; g holds log gates, g = log(a) with 0 < a <= 1, so g <= 0; beta lies in
[0, 1]; chunk and block sizes are positive integers.

Each check raises naming the argument, what was expected and what was given, in the words of the
kernels' wrapper checks (stages.common.torch_checks) where both check the same thing, so that a
wrong call fails at the door instead of deep inside a loop. The value checks read each array
twice (its minimum, then its maximum) and allocate nothing while the values are good.
"""

import numpy as np
from numpy.typing import NDArray

from stages.common.inputs import GATE_SHAPES

Float64Array = NDArray[np.float64]  # the one array type the references take


def check_array(name, x, rank, layout=""):
    """x is a NumPy float64 array of the given rank (layout, e.g. "(B, N, H, D)", names its axes)
    with finite entries."""
    check_layout(name, x, rank, layout)
    check_values(name, x)


def check_layout(name, x, rank, layout=""):
    """x is a NumPy float64 array of the given rank; its values are not read."""
    _check_is_ndarray(name, x)
    if x.ndim != rank:
        raise ValueError(f"{name} must have rank {rank}{f' {layout}' if layout else ''}, got shape {tuple(x.shape)}")
    if x.dtype != np.float64:
        raise TypeError(f"{name} must have dtype float64, got {x.dtype}; convert it with {name}.astype(np.float64)")


def check_shaped(name, x, shape, description):
    """x is a NumPy float64 array of the given shape (description words it) with finite entries."""
    _check_is_ndarray(name, x)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {description}, got {tuple(x.shape)}")
    check_array(name, x, len(shape))


def check_values(name, x, lower=-np.inf, upper=np.inf, rule=None):
    """Every entry of x is finite and within [lower, upper]; `rule` words the bound for the error."""
    if x.size == 0:
        return
    lowest, highest = x.min(), x.max()  # a NaN anywhere makes both NaN
    if not (np.isfinite(lowest) and np.isfinite(highest)):
        where = tuple(int(i) for i in np.argwhere(~np.isfinite(x))[0])
        raise ValueError(f"{name} must be finite, got {x[where]} at index {where}")
    if lowest < lower or highest > upper:
        raise ValueError(f"{rule or f'{name} must lie in [{lower}, {upper}]'}; "
                         f"its entries span [{lowest:.6g}, {highest:.6g}]")


def check_qkv(q, k, v):
    """q, k: (B, N, H, d_k); v: (B, N, H, d_v), float64 and finite. Returns (B, N, H, d_k, d_v)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x, 4, "(B, N, H, D)")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != tuple(q.shape[:3]):
        raise ValueError(f"v must be (B, N, H, d_v) = ({', '.join(map(str, q.shape[:3]))}, d_v), got {tuple(v.shape)}")
    B, N, H, d_k = q.shape
    return B, N, H, d_k, v.shape[3]


def check_output_gradient(do, B, N, H, d_v):
    """do, the gradient of the loss with respect to o: o's shape (B, N, H, d_v), float64 and finite."""
    check_shaped("do", do, (B, N, H, d_v), f"(B, N, H, d_v) = {(B, N, H, d_v)}, o's shape")


def check_state(name, state, B, H, d_k, d_v):
    """state (an initial state, or the gradient of a final state) is None or S^T in the kernel
    layout: (B, H, d_k, d_v), float64 and finite."""
    if state is not None:
        check_shaped(name, state, (B, H, d_k, d_v), f"(B, H, d_k, d_v) = {(B, H, d_k, d_v)}, S^T in the kernel layout")


def check_slots(slots, B, P):
    """slots: a NumPy integer array of shape (B,), one slot of a pool of P states per sequence: every
    entry in [0, P), no two equal (two sequences updating one state would race in a kernel and
    overwrite each other in a reference)."""
    if not isinstance(slots, np.ndarray):
        raise TypeError(f"slots must be a numpy.ndarray of integers, got {type(slots).__name__}; "
                        f"convert it with np.asarray(slots, dtype=np.int64)")
    if not np.issubdtype(slots.dtype, np.integer):
        raise TypeError(f"slots must have an integer dtype, got {slots.dtype}")
    if tuple(slots.shape) != (B,):
        raise ValueError(f"slots must have shape (B,) = ({B},), one slot per sequence, got {tuple(slots.shape)}")
    if B and (slots.min() < 0 or slots.max() >= P):
        raise ValueError(f"slots must lie in [0, P) = [0, {P}), the pool's slots; "
                         f"they span [{slots.min()}, {slots.max()}]")
    values, counts = np.unique(slots, return_counts=True)
    if np.any(counts > 1):
        raise ValueError(f"slots must be distinct (one state per sequence), got slot {values[counts > 1][0]} "
                         f"{counts[counts > 1][0]} times")


def check_cu_seqlens(cu_seqlens, B, N):
    """cu_seqlens: a NumPy integer array (N_seq + 1,) of token offsets into a packed batch, FLA's
    convention: the inputs are one row (B = 1) of N tokens, and sequence i holds tokens
    cu_seqlens[i] to cu_seqlens[i + 1] - 1. It starts at 0, never decreases (a sequence may be
    empty) and ends at N. Returns N_seq."""
    if not isinstance(cu_seqlens, np.ndarray):
        raise TypeError(f"cu_seqlens must be a numpy.ndarray of integers, got {type(cu_seqlens).__name__}; "
                        f"convert it with np.asarray(cu_seqlens, dtype=np.int64)")
    if not np.issubdtype(cu_seqlens.dtype, np.integer):
        raise TypeError(f"cu_seqlens must have an integer dtype, got {cu_seqlens.dtype}")
    if cu_seqlens.ndim != 1 or len(cu_seqlens) < 2:
        raise ValueError(f"cu_seqlens must have shape (N_seq + 1,) with N_seq >= 1, got {tuple(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed into one row: B must be 1, got B = {B}")
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != N or np.any(np.diff(cu_seqlens) < 0):
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at N = {N}, the packed tokens; "
                         f"got {cu_seqlens.tolist() if len(cu_seqlens) <= 8 else cu_seqlens[:8].tolist() + ['...']}")
    return len(cu_seqlens) - 1


def check_chunking(N, d_v, chunk_size, block_dv=None):
    """chunk_size is a positive integer; block_dv, when given, a positive integer that divides d_v."""
    check_positive_integer("chunk_size", chunk_size)
    if block_dv is not None:
        check_divisor("block_dv", block_dv, "d_v", d_v)


def check_positive_integer(name, value):
    """value is a Python or NumPy integer >= 1 (not a bool, not a float that happens to be whole)."""
    if not _is_positive_integer(value):
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_divisor(name, value, whole_name, whole):
    """value is a positive integer that divides whole (named whole_name)."""
    if not _is_positive_integer(value) or whole % value:
        raise ValueError(f"{name} must be a positive divisor of {whole_name} = {whole}, got {value!r}")


def padded_length(N, chunk_size):
    """The smallest multiple of chunk_size that is >= N."""
    return -(-N // chunk_size) * chunk_size


def check_gate_and_beta(g, beta, B, N, H, d_k, gate):
    """g as check_gate wants it; beta: (B, N, H), float64, every entry in [0, 1]."""
    check_gate(g, B, N, H, d_k, gate)
    check_shaped("beta", beta, (B, N, H), f"(B, N, H) = {(B, N, H)}")
    check_values("beta", beta, 0.0, 1.0, "beta must lie in [0, 1]")


def check_gate(g, B, N, H, d_k, gate):
    """g: the shape inputs.GATE_SHAPES[gate] gives for (B, N, H, d_k), float64, every entry a log
    gate: finite and <= 0."""
    expected = GATE_SHAPES[gate](B, N, H, d_k)
    check_shaped("g", g, expected, f"{expected} (the {gate} gate)")
    check_log_gates("g", g)


def check_log_gates(name, g):
    """Every entry of g (an array, or one real number) is finite and <= 0: g = log(a), 0 < a <= 1."""
    if not isinstance(g, (np.ndarray, int, float, np.integer, np.floating)) or isinstance(g, bool):
        raise TypeError(f"{name} must be a real number or a numpy.ndarray, got {type(g).__name__}")
    check_values(name, np.asarray(g, dtype=np.float64), upper=0.0,
                 rule=f"{name}: log gates must be <= 0 (g = log(a), 0 < a <= 1)")


def _check_is_ndarray(name, x):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy.ndarray, got {type(x).__name__}; "
                        f"convert it with np.asarray({name}, dtype=np.float64)")


def _is_positive_integer(value):
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1
