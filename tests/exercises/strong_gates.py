"""Strong gates for the tests of the chunkwise and mirror exercises.

A log gate of STRONG_LOG_GATE per token over a whole chunk of STRONG_CHUNK tokens makes the decay of
the chunk's widest pair e^{gamma_c - gamma_i} = e^{-50 * 15} underflow to 0 below the diagonal, and
its reciprocal overflow to inf above it (float64's exponent ends at 709). A program that exponentiates
a gate difference where it is not defined (j > c) and masks it afterwards by a product, or factors
the ratio into e^{gamma_c} e^{-gamma_i}, gets inf * 0 = NaN there; on the gates the other tests draw
(a decay of 0.5 or more per token) the same program is right.
"""

import numpy as np

STRONG_LOG_GATE = -50.0  # a decay of e^-50 per token: the state forgets all but the last token
STRONG_CHUNK = 16  # 50 * (16 - 1) = 750 > 709: past float64's range within one chunk


def assert_finite(actual, where):
    """actual has no inf or NaN; the message says which gates were strong (`where`)."""
    __tracebackhide__ = True
    bad = ~np.isfinite(actual)
    assert not bad.any(), (f"{bad.sum()} of {bad.size} outputs are inf or NaN with g = {STRONG_LOG_GATE:g} per token "
                           f"on {where}, over chunks of {STRONG_CHUNK} tokens: is a decay e^(gamma_c - gamma_j) "
                           "computed above the diagonal (j > c), where it overflows?")
