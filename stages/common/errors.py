"""The one error measure of the course: max absolute error and relative L2 error, always together."""

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ErrorReport:
    """max_abs = max |actual - expected|;  rel_l2 = ||actual - expected||_2 / ||expected||_2."""

    max_abs: float
    rel_l2: float

    def __str__(self):
        return f"max abs {self.max_abs:.3e}, rel L2 {self.rel_l2:.3e}"


def error_report(actual, expected):
    """Compare two arrays (NumPy or torch, any device) of the same shape in float64."""
    actual, expected = _as_float64(actual), _as_float64(expected)
    if actual.shape != expected.shape:
        raise ValueError(f"shapes differ: actual {actual.shape}, expected {expected.shape}")
    difference = actual - expected
    max_abs = float(np.max(np.abs(difference))) if difference.size else 0.0
    norm_expected = float(np.linalg.norm(expected))
    norm_difference = float(np.linalg.norm(difference))
    if norm_expected == 0.0:
        rel_l2 = 0.0 if norm_difference == 0.0 else float("inf")
    else:
        rel_l2 = norm_difference / norm_expected
    if not np.all(np.isfinite(actual)):
        max_abs, rel_l2 = float("nan"), float("nan")
    return ErrorReport(max_abs, rel_l2)


def _as_float64(x):
    if hasattr(x, "detach"):  # a torch tensor: bring it to the host without importing torch here
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)
