"""Stage 3 numerics: how well conditioned is the triangular system of the UT transform?

Every chunk solves (I + L) X = [K ⊙ e^{gamma} | V] with L[c, i] = beta_i e^{gamma_c - gamma_i} k_c · k_i
(i < c). Its condition number says how much of the fp32 solve's rounding reaches the output. With
L2-normalized keys and beta in [0, 1], every factor I - beta k k^T of the recurrence has eigenvalues 1
and 1 - beta in [0, 1]: nothing grows, and I + L stays close to I. With keys of norm rho, the factor
has the eigenvalue 1 - beta rho^2 along k, below -1 as soon as beta rho^2 > 2, and the system grows
as fast as the recurrence would blow up: geometrically in the chunk size.

Run `python -m stages.s03_gated_deltanet.numerics` to print the study.
"""

from dataclasses import dataclass

import numpy as np

from stages.common.inputs import l2_normalize, make_inputs

CHUNK_SIZES = (8, 16, 32, 64, 128)
D_K = 128
KEY_NORMS = (1.0, 2.0, 4.0, float(np.sqrt(D_K)))  # sqrt(d_k): the norm of a key drawn from N(0, I)


# --8<-- [start:chunk_system]
def chunk_system(k, g, beta, key_norm=1.0):
    """I + L of one chunk, (C, C): L[c, i] = beta_i e^{gamma_c - gamma_i} k_c · k_i for i < c.

    k: (C, d_k) keys of any norm; g = log(alpha), beta: (C,). Every key is L2-normalized first, as
    the model does before the kernel, then scaled to key_norm (1: the kernel's normal case).
    """
    keys = key_norm * l2_normalize(k)
    gamma = np.cumsum(g)
    # above the diagonal the exponent is positive, and tril drops it
    M = np.tril((keys @ keys.T) * np.exp(gamma[:, None] - gamma[None, :]), -1)
    return np.eye(len(g)) + M * beta[None, :]
# --8<-- [end:chunk_system]


def forward_substitution(system, rhs, dtype):
    """X with system X = rhs, system unit lower triangular, row by row in `dtype` (the kernel's order)."""
    system, x = system.astype(dtype), rhs.astype(dtype)
    for r in range(1, len(x)):
        x[r] -= system[r, :r] @ x[:r]
    return x


def inverse(system):
    """(I + L)^{-1} by float64 forward substitution: no pivoting, so a huge inverse comes out huge
    (or inf past 1e308) instead of failing as 'singular' the way a pivoted solver does."""
    with np.errstate(over="ignore", invalid="ignore"):
        return forward_substitution(system, np.eye(len(system)), np.float64)


def condition_number(system, T):
    """cond_inf(A) = ||A||_inf ||A^{-1}||_inf (largest row sum of absolute values), the norm in which
    LAPACK estimates the condition of triangular systems; elementwise, so it costs no SVD."""
    return float(np.abs(system).sum(axis=1).max() * np.abs(T).sum(axis=1).max())


@dataclass(frozen=True)
class SystemNumerics:
    """Medians over the sampled chunks: cond_inf(I + L), max |T[c, i]| of T = (I + L)^{-1}, and the
    relative L2 error of the kernel's fp32 forward substitution against float64."""

    condition: float
    largest_entry_of_T: float
    fp32_solve_error: float


def study(chunk_size, key_norm, samples=8, seed=0):
    """SystemNumerics of `samples` chunks of seeded inputs: gates a in [0.9, 0.999], beta in
    [0.1, 0.9], d_k = 128, the right-hand side [K ⊙ e^{gamma} | V] with d_v = 32."""
    x = make_inputs(1, chunk_size, samples, D_K, 32, gate="token", beta_range=(0.1, 0.9), seed=seed)
    conditions, largest, errors = [], [], []
    for h in range(samples):
        k, g, beta = x.k[0, :, h], x.g[0, :, h], x.beta[0, :, h]
        system = chunk_system(k, g, beta, key_norm)
        T = inverse(system)
        finite = bool(np.all(np.isfinite(T)))
        conditions.append(condition_number(system, T) if finite else np.inf)
        largest.append(np.max(np.abs(T)) if finite else np.inf)
        rhs = np.concatenate([key_norm * k * np.exp(np.cumsum(g))[:, None], x.v[0, :, h]], axis=1)
        with np.errstate(over="ignore", invalid="ignore"):
            exact = forward_substitution(system, rhs, np.float64)
            fp32 = forward_substitution(system, rhs, np.float32)
            errors.append(np.linalg.norm(fp32 - exact) / np.linalg.norm(exact))
    return SystemNumerics(*(float(np.median(values)) for values in (conditions, largest, errors)))


def main():
    for key_norm in KEY_NORMS:
        for chunk_size in CHUNK_SIZES:
            row = study(chunk_size, key_norm)
            print(f"key norm {key_norm:5.2f}  C = {chunk_size:3d}:  cond {row.condition:.2e},  "
                  f"max |T| {row.largest_entry_of_T:.2e},  fp32 solve error {row.fp32_solve_error:.1e}")


if __name__ == "__main__":
    main()
