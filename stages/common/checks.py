"""Shape checks shared by the NumPy references of every stage.

Each check raises ValueError naming the argument and what was expected, so that a wrong call
fails at the door instead of deep inside a loop.
"""

from stages.common.inputs import GATE_SHAPES


def check_qkv(q, k, v):
    """q, k: (B, N, H, d_k); v: (B, N, H, d_v). Returns (B, N, H, d_k, d_v)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 (B, N, H, D), got shape {tuple(x.shape)}")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if tuple(v.shape[:3]) != tuple(q.shape[:3]):
        raise ValueError(f"v must be (B, N, H, d_v) = ({', '.join(map(str, q.shape[:3]))}, d_v), got {tuple(v.shape)}")
    B, N, H, d_k = q.shape
    return B, N, H, d_k, v.shape[3]


def check_chunking(N, d_v, chunk_size, block_dv=None):
    """chunk_size >= 1; block_dv, when given, divides d_v."""
    if int(chunk_size) != chunk_size or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size!r}")
    if block_dv is not None and (int(block_dv) != block_dv or block_dv < 1 or d_v % block_dv):
        raise ValueError(f"block_dv must be a positive divisor of d_v = {d_v}, got {block_dv!r}")


def padded_length(N, chunk_size):
    """The smallest multiple of chunk_size that is >= N."""
    return -(-N // chunk_size) * chunk_size


def check_gate_and_beta(g, beta, B, N, H, d_k, gate):
    """g has the shape inputs.GATE_SHAPES[gate] gives for (B, N, H, d_k); beta is (B, N, H)."""
    expected = GATE_SHAPES[gate](B, N, H, d_k)
    if tuple(g.shape) != tuple(expected):
        raise ValueError(f"g must have shape {expected} (the {gate} gate), got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, N, H):
        raise ValueError(f"beta must have shape (B, N, H) = {(B, N, H)}, got {tuple(beta.shape)}")


def check_gate(g, B, N, H, d_k, gate):
    """g has the shape inputs.GATE_SHAPES[gate] gives for (B, N, H, d_k); for stages without beta."""
    expected = GATE_SHAPES[gate](B, N, H, d_k)
    if tuple(g.shape) != tuple(expected):
        raise ValueError(f"g must have shape {expected} (the {gate} gate), got {tuple(g.shape)}")
