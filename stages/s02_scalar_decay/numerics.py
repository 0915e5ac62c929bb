"""Stage 2 numerics: the decay table's two forms in low precision, and what the chunk reset buys.

1. Gamma[i, j] = alpha^(i - j) can be built as a ratio, e^{gamma_i - gamma_j} (reference.decay_table),
   or factorized, e^{gamma_i} * e^{-gamma_j}: two per-row tables and one product, which is how a
   kernel would like to hold it. The factor e^{-gamma_j} = alpha^(-j) grows to alpha^(-C), beyond
   fp16's largest finite value (65504) once alpha < 65504^(-1/C); the table then holds inf, and
   the intra-chunk GEMM sums +inf and -inf into NaN.
2. The cumulative product P_t = alpha^t counted from the sequence start (no reset) shrinks without
   bound as t grows, and its inverse grows without bound; restarted at every chunk it stays in
   [alpha^C, 1] whatever the length.

Run `python -m stages.s02_scalar_decay.numerics` to print both tables.
"""

import numpy as np

from stages.common.inputs import make_inputs
from stages.s02_scalar_decay.reference import decay_table

CHUNK_SIZE = 64
ALPHAS = [0.999, 0.99, 0.95, 0.9, 0.85, 0.84, 0.8, 0.7, 0.5, 0.3, 0.2]
LENGTHS = [64, 256, 1024, 4096, 16384, 65536]
RANGE_ALPHAS = [0.99, 0.9]
HEAD_DIM = 64


# --8<-- [start:factorized]
def factorized_decay_table(g_head, chunk_size, dtype):
    """Gamma as e^{gamma_i} * e^{-gamma_j}, each factor rounded to `dtype` before the product, as a
    kernel that keeps the two per-row tables in `dtype` computes it. Zero above the diagonal."""
    gamma = g_head * np.arange(1, chunk_size + 1)
    lower = np.tril(np.ones((chunk_size, chunk_size), dtype=bool))
    with np.errstate(invalid="ignore", over="ignore"):  # the overflow is what this function shows
        decay_from_start = np.exp(gamma).astype(dtype)  # e^{gamma_i} = alpha^i <= 1
        inverse_decay = np.exp(-gamma).astype(dtype)  # e^{-gamma_j} = alpha^(-j) >= 1: overflows first
        return np.where(lower, decay_from_start[:, None] * inverse_decay[None, :], dtype(0))
# --8<-- [end:factorized]


def intra_chunk_term(q, k, v, table):
    """(Q K^T ⊙ Gamma) V for one chunk with the kernel's dtypes: q, k, v in fp16, the scores and the
    table's product in fp32, the decayed scores rounded to fp16 for the GEMM, fp32 accumulation."""
    q16, k16, v16 = (x.astype(np.float16).astype(np.float32) for x in (q, k, v))
    with np.errstate(invalid="ignore", over="ignore"):
        decayed_scores = ((q16 @ k16.T) * table.astype(np.float32)).astype(np.float16)
        return decayed_scores.astype(np.float32) @ v16


def overflow_threshold(chunk_size, dtype, tolerance=1e-6):
    """The largest alpha at which the factorized table in `dtype` is no longer finite (bisection)."""
    def finite(alpha):
        return np.isfinite(factorized_decay_table(np.log(alpha), chunk_size, dtype)).all()

    low, high = 1e-3, 1.0  # not finite at low, finite at high
    while high - low > tolerance:
        middle = (low + high) / 2
        low, high = (low, middle) if finite(middle) else (middle, high)
    return low


def factorized_vs_ratio(alphas=ALPHAS, chunk_size=CHUNK_SIZE, d=HEAD_DIM, seed=0):
    """For each alpha: the largest factor alpha^(-C), the factorized table's non-finite entries in
    fp16, and the relative L2 error of the fp16 intra-chunk term with each table, against float64."""
    x = make_inputs(1, chunk_size, 1, d, d, seed=seed)
    q, k, v = x.q[0, :, 0], x.k[0, :, 0], x.v[0, :, 0]
    rows = []
    for alpha in alphas:
        g_head = np.log(alpha)
        exact = ((q @ k.T) * decay_table(g_head, chunk_size)) @ v
        factorized = factorized_decay_table(g_head, chunk_size, np.float16)
        rows.append(dict(
            alpha=alpha,
            largest_factor=alpha ** -chunk_size,
            factorized_nonfinite=int((~np.isfinite(factorized)).sum()),
            factorized_error=_relative_l2(intra_chunk_term(q, k, v, factorized), exact),
            ratio_error=_relative_l2(intra_chunk_term(q, k, v, decay_table(g_head, chunk_size, np.float16)), exact),
            factorized_fp32_finite=bool(np.isfinite(factorized_decay_table(g_head, chunk_size, np.float32)).all()),
        ))
    return rows


def cumulative_product_range(lengths=LENGTHS, alphas=RANGE_ALPHAS, chunk_size=CHUNK_SIZE):
    """For each (alpha, N): the global cumulative product's smallest value alpha^N and its inverse's
    largest alpha^(-N), as float64 and as stored in fp16 and fp32; the fp32 spacing at gamma_N = N g
    (the global product kept in log space: exponents gamma_t - gamma_j lose that much); and the
    per-chunk bound alpha^C."""
    rows = []
    for alpha in alphas:
        for N in lengths:
            with np.errstate(over="ignore"):
                smallest, largest = np.float64(alpha) ** N, np.float64(alpha) ** -N
            rows.append(dict(
                alpha=alpha, N=N, smallest=float(smallest), largest=float(largest),
                smallest_fp16=_stored(smallest, np.float16), largest_fp16=_stored(largest, np.float16),
                smallest_fp32=_stored(smallest, np.float32), largest_fp32=_stored(largest, np.float32),
                log_spacing_fp32=abs(float(np.spacing(np.float32(N * np.log(alpha))))),
                per_chunk_smallest=alpha ** chunk_size,
            ))
    return rows


def _stored(value, dtype):
    with np.errstate(over="ignore", under="ignore"):
        return float(np.array(value).astype(dtype))


def _relative_l2(actual, expected):
    if not np.all(np.isfinite(actual)):
        return float("nan")
    return float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))


def main():
    for row in factorized_vs_ratio():
        print(row)
    print(f"fp16 threshold at C = {CHUNK_SIZE}: alpha < {overflow_threshold(CHUNK_SIZE, np.float16):.4f}")
    for row in cumulative_product_range():
        print(row)


if __name__ == "__main__":
    main()
