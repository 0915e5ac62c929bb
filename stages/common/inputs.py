"""Seeded inputs for every stage, in the course's layout (B, N, H, D).

q and k are L2-normalized along their last axis (the seeds do this for every stage, and stage 3
depends on it: see the condition-number numerics). Gates are returned in log space, g = log(a),
with a drawn uniformly from [gate_lower, gate_upper], so that 0 < a <= 1 and g <= 0.
"""

from dataclasses import dataclass

import numpy as np

# The shape of the gate g of each stage, as a function of (B, N, H, d_k).
GATE_SHAPES = {
    "none": None,  # s01: no gate
    "head": lambda B, N, H, d_k: (H,),  # s02: one constant per head
    "token": lambda B, N, H, d_k: (B, N, H),  # s03: a scalar per token and head
    "channel": lambda B, N, H, d_k: (B, N, H, d_k),  # s04, s05: a vector per token and head
}
GATES_WITH_BETA = ("token", "channel")  # the delta-rule stages, s03 to s05, also take beta
DEFAULT_BETA_RANGE = (0.1, 0.9)


@dataclass
class Inputs:
    """q, k: (B, N, H, d_k); v: (B, N, H, d_v); g: see GATE_SHAPES, or None; beta: (B, N, H) or None."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray | None = None
    beta: np.ndarray | None = None


def l2_normalize(x, axis=-1):
    """x / ||x||_2 along `axis`."""
    return x / np.linalg.norm(x, axis=axis, keepdims=True)


def make_inputs(
    B,
    N,
    H,
    d_k,
    d_v,
    *,
    gate="none",
    gate_range=(0.9, 0.999),
    beta_range=None,
    seed=0,
):
    """Draw float64 inputs from a seeded generator.

    gate: one of GATE_SHAPES' keys; gate_range: (lower, upper) bounds on a = exp(g);
    beta_range: (lower, upper) for beta ~ U(lower, upper); None draws beta from DEFAULT_BETA_RANGE
    for the gates whose stages take beta (GATES_WITH_BETA) and leaves it None for the others.
    """
    if gate not in GATE_SHAPES:
        raise ValueError(f"gate must be one of {sorted(GATE_SHAPES)}, got {gate!r}")
    lower, upper = gate_range
    if not 0.0 < lower <= upper <= 1.0:
        raise ValueError(f"gate_range must satisfy 0 < lower <= upper <= 1, got {gate_range}")
    rng = np.random.default_rng(seed)
    q = l2_normalize(rng.standard_normal((B, N, H, d_k)))
    k = l2_normalize(rng.standard_normal((B, N, H, d_k)))
    v = rng.standard_normal((B, N, H, d_v))
    g = None
    if gate != "none":
        g = np.log(rng.uniform(lower, upper, GATE_SHAPES[gate](B, N, H, d_k)))
    if beta_range is None and gate in GATES_WITH_BETA:
        beta_range = DEFAULT_BETA_RANGE
    beta = None
    if beta_range is not None:
        beta_lower, beta_upper = beta_range
        if not 0.0 <= beta_lower <= beta_upper <= 1.0:
            raise ValueError(f"beta_range must lie in [0, 1], got {beta_range}")
        beta = rng.uniform(beta_lower, beta_upper, (B, N, H))
    return Inputs(q, k, v, g, beta)


def make_backward_inputs(B, N, H, d_k, d_v, seed, gate_range=(0.5, 0.999)):
    """KDA's inputs for a backward pass: strong gates, beta in [0, 1] with a quarter of its entries
    exactly 0 or exactly 1, and standard normal do = dLoss/do (B, N, H, d_v), S_0^T and dLoss/dS_N^T
    (B, H, d_k, d_v). Returns (Inputs, do, initial_state, d_final_state)."""
    x = make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=gate_range, beta_range=(0.0, 1.0), seed=seed)
    rng = np.random.default_rng(seed + 1000)
    flat = x.beta.reshape(-1)
    picked = rng.choice(flat.size, size=max(2, flat.size // 4), replace=False)
    flat[picked[::2]], flat[picked[1::2]] = 0.0, 1.0
    do = rng.standard_normal((B, N, H, d_v))
    initial_state = rng.standard_normal((B, H, d_k, d_v))
    d_final_state = rng.standard_normal((B, H, d_k, d_v))
    return x, do, initial_state, d_final_state
