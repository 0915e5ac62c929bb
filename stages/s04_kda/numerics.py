"""Stage 4 numerics: how far e^{+gamma} and e^{-gamma} travel inside one chunk, and what fp16 does
with them.

The sampling is the seed's, found by matching its tables: one chunk of C tokens and D_K = 128 key
channels, every gate a drawn independently per token and channel from a uniform law (the law
`stages.common.inputs.make_inputs` uses for gates, g = log a). A seed table is one such chunk: the
course draws DRAWS chunks from a generator seeded with SEED and reports, per statistic, the median
draw (typical), the 5% and 95% draws (the band a single chunk falls in nine times out of ten) and
where the seed's number falls among the draws.

The laws that reproduce the seed:
- max e^{-gamma} by gate lower bound L: a ~ U(L, 1) (U(L, 0.999) cannot give the 0.999 row);
- min e^{gamma_C}, zeroed channels, channel spread: a ~ U(lower, 0.999) as the seed's ranges say;
- "with a lower bound": a = max(a', L) with a' ~ U(0.01, 0.999), C = 128;
- sub-chunks: a ~ U(0.9, 1), C = 128.

The kernel's wrapper refuses gates that decay a channel too far within one chunk for its dtype
(check_gate_range, MAX_LOG_DECAY): the bound these tables lead to.
"""

import math
from dataclasses import dataclass

import numpy as np

from stages.common.checks import padded_length
from stages.common.errors import error_report
from stages.common.inputs import make_inputs

D_K = 128
DRAWS = 500
SEED = 0
FP16_MAX = float(np.finfo(np.float16).max)
FP32_MAX = float(np.finfo(np.float32).max)
# The largest chunk-local log decay -gamma the fp16 and bf16 kernels accept (see check_gate_range).
MAX_LOG_DECAY = {"float16": 14 * math.log(2), "bfloat16": 126 * math.log(2)}

# The seed's published numbers, keyed like the rows below; the tables print them beside ours.
SEED_MAX_EXP_NEG_GAMMA = {0.999: 1.04, 0.99: 1.48, 0.95: 7.14, 0.9: 54.95, 0.8: 4.20e3, 0.5: 3.04e10}
SEED_UNDERFLOW = {  # (gate range, C): (min e^{gamma_C}, channels that fp16 rounds to zero)
    ((0.9, 0.999), 64): (1.70e-2, 0), ((0.9, 0.999), 128): (4.84e-4, 0),
    ((0.5, 0.999), 64): (2.20e-11, 118), ((0.5, 0.999), 128): (1.59e-20, 128),
    ((0.1, 0.999), 64): (7.39e-28, 128), ((0.01, 0.999), 128): (6.44e-65, 128),
}
SEED_WITH_LOWER_BOUND = {None: 1.84e-66, 0.5: 9.07e-32, 0.9: 1.72e-6, 0.95: 1.43e-3}  # min e^{gamma_C}, C = 128
SEED_SPREAD = {((0.9, 0.999), 64): 1.28, ((0.9, 0.999), 128): 1.74, ((0.5, 0.999), 64): 8.17,
               ((0.5, 0.999), 128): 11.25, ((0.01, 0.999), 128): 47.46}
SEED_SUB_CHUNK = {128: 1.79e3, 64: 5.34e1, 32: 9.02, 16: 3.41}  # C = 128, a ~ U(0.9, 1)


def sample_gates(gate_range, chunk_size, lower_bound=None, draws=DRAWS, seed=SEED):
    """g = log a: (draws, chunk_size, D_K), a ~ U(gate_range), then a = max(a, lower_bound)."""
    lower, upper = gate_range
    g = np.log(np.random.default_rng(seed).uniform(lower, upper, (draws, chunk_size, D_K)))
    return g if lower_bound is None else np.maximum(g, np.log(lower_bound))


def cumulative_log_decay(g, sub_chunk_size=None):
    """gamma: (draws, C, d_k), the running sum of g over positions, restarted every sub_chunk_size."""
    draws, C, d_k = g.shape
    sub = sub_chunk_size or C
    return np.cumsum(g.reshape(draws, C // sub, sub, d_k), axis=2).reshape(draws, C, d_k)


# --8<-- [start:statistics]
def max_exp_neg_gamma(g, sub_chunk_size=None):
    """Per draw: the largest e^{-gamma} the exponent split builds, max over positions and channels."""
    return np.exp(-cumulative_log_decay(g, sub_chunk_size).min(axis=(1, 2)))


def min_exp_gamma_end(g):
    """Per draw: the smallest e^{gamma_C}, the chunk's decay of the state, over channels."""
    return np.exp(g.sum(axis=1).min(axis=1))


def fp16_zeroed_channels(g):
    """Per draw: how many channels' e^{gamma_C} fp16 rounds to zero (below 2^-25)."""
    return (np.exp(g.sum(axis=1)).astype(np.float16) == 0).sum(axis=1)


def channel_spread(g):
    """Per draw: max - min over channels of gamma_C, in log units."""
    gamma_end = g.sum(axis=1)
    return gamma_end.max(axis=1) - gamma_end.min(axis=1)
# --8<-- [end:statistics]


@dataclass(frozen=True)
class Sampled:
    """A statistic over DRAWS chunks and where the seed's number falls among them."""

    median: float
    low: float  # 5% of draws are below
    high: float  # 95% of draws are below
    seed: float
    seed_percentile: float  # share of draws below the seed's number, in percent

    @property
    def seed_within_band(self):
        return self.low <= self.seed <= self.high


def compare(values, seed_value):
    values = np.asarray(values, dtype=np.float64)
    low, median, high = np.percentile(values, [5, 50, 95])
    return Sampled(float(median), float(low), float(high), seed_value, 100.0 * float(np.mean(values < seed_value)))


def gate_bound_rows(chunk_size=64):
    """(lower bound L, Sampled max e^{-gamma}) with a ~ U(L, 1)."""
    return [(L, compare(max_exp_neg_gamma(sample_gates((L, 1.0), chunk_size)), value))
            for L, value in SEED_MAX_EXP_NEG_GAMMA.items()]


def underflow_rows():
    """((gate range, C), Sampled min e^{gamma_C}, Sampled zeroed channels)."""
    rows = []
    for (gate_range, C), (min_value, zeroed) in SEED_UNDERFLOW.items():
        g = sample_gates(gate_range, C)
        rows.append(((gate_range, C), compare(min_exp_gamma_end(g), min_value), compare(fp16_zeroed_channels(g), zeroed)))
    return rows


def lower_bound_rows(chunk_size=128):
    """(L, Sampled min e^{gamma_C}, Sampled zeroed channels) with a = max(a', L), a' ~ U(0.01, 0.999)."""
    rows = []
    for L, value in SEED_WITH_LOWER_BOUND.items():
        g = sample_gates((0.01, 0.999), chunk_size, lower_bound=L)
        rows.append((L, compare(min_exp_gamma_end(g), value), compare(fp16_zeroed_channels(g), 0)))
    return rows


def spread_rows():
    """((gate range, C), Sampled spread of gamma_C over channels)."""
    return [(key, compare(channel_spread(sample_gates(*key)), value)) for key, value in SEED_SPREAD.items()]


def sub_chunk_rows(chunk_size=128):
    """(sub-chunk size, Sampled max e^{-gamma}) with a ~ U(0.9, 1); one sample of chunks for all rows."""
    g = sample_gates((0.9, 1.0), chunk_size)
    return [(sub, compare(max_exp_neg_gamma(g, sub), value)) for sub, value in SEED_SUB_CHUNK.items()]


# --8<-- [start:fp16_emulation]
def fp16_kernel_emulation(q, k, v, g, beta, chunk_size):
    """The kernel's arithmetic in NumPy: fp32 where the kernel keeps fp32 (gamma, e^{+-gamma}, the
    forward substitution, the state), rounded to fp16 wherever the kernel casts (inputs, GEMM
    operands, the output). Kernel layout, S^T: (d_k, d_v); N a multiple of chunk_size."""
    q, k, v, g, beta = _fp16(q), _fp16(k), _fp16(v), _fp32(g), _fp32(beta)
    B, N, H, d_k = q.shape
    o = np.zeros(v.shape)
    with np.errstate(over="ignore", invalid="ignore"):  # overflow is what this is here to show
        for b in range(B):
            for h in range(H):
                S_T = np.zeros((d_k, v.shape[3]))
                for start in range(0, N, chunk_size):
                    rows = slice(start, start + chunk_size)
                    Q, K, V, beta_c = q[b, rows, h], k[b, rows, h], v[b, rows, h], beta[b, rows, h]
                    gamma = _fp32(np.cumsum(g[b, rows, h], axis=0))
                    E_plus, E_minus = _fp32(np.exp(gamma)), _fp32(np.exp(-gamma))
                    Q_plus, K_plus, K_minus = _fp16(Q * E_plus), _fp16(K * E_plus), _fp16(K * E_minus)
                    L = _fp32(np.tril(K_plus @ K_minus.T, -1) * beta_c[None, :])
                    A_qk = _fp16(np.tril(Q_plus @ K_minus.T))
                    X = _fp32(np.concatenate([K * E_plus, V], axis=1))
                    for r in range(1, chunk_size):
                        X[r] = _fp32(X[r] - L[r, :r] @ X[:r])
                    X = _fp32(X * beta_c[:, None])
                    W, U, S_s = _fp16(X[:, :d_k]), X[:, d_k:], _fp16(S_T)
                    V_new = _fp16(U - W @ S_s)
                    o[b, rows, h] = _fp16(Q_plus @ S_s + A_qk @ V_new)
                    decay_to_end = _fp16(K * np.exp(gamma[-1] - gamma))
                    S_T = _fp32(np.exp(gamma[-1])[:, None] * S_T + decay_to_end.T @ V_new)
    return o
# --8<-- [end:fp16_emulation]


def fp16_error_rows(lower_bounds=(0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.5), chunk_size=64, shape=(1, 256, 2, 64, 64)):
    """(L, max over the inputs of -gamma in a chunk, ErrorReport of the fp16 emulation against the
    float64 reference) with a ~ U(L, 1), beta ~ U(0.1, 0.9)."""
    from stages.s04_kda.reference import kernel_mirror

    rows = []
    for L in lower_bounds:
        x = make_inputs(*shape, gate="channel", gate_range=(L, 1.0), beta_range=(0.1, 0.9), seed=SEED)
        expected = kernel_mirror(x.q, x.k, x.v, x.g, x.beta, chunk_size, shape[4])
        worst = float(-cumulative_log_decay(_as_chunks(x.g, chunk_size)).min())
        actual = fp16_kernel_emulation(x.q, x.k, x.v, x.g, x.beta, chunk_size)
        rows.append((L, worst, error_report(actual, expected)))
    return rows


def _fp16(x):
    """x rounded to float16, kept in float64."""
    return x.astype(np.float16).astype(np.float64)


def _fp32(x):
    """x rounded to float32, kept in float64."""
    return x.astype(np.float32).astype(np.float64)


def _as_chunks(g, chunk_size):
    """(B, N, H, d_k) gates -> (chunks, chunk_size, d_k), every (batch, chunk, head) a row."""
    B, N, H, d_k = g.shape
    return g.reshape(B, N // chunk_size, chunk_size, H, d_k).transpose(0, 1, 3, 2, 4).reshape(-1, chunk_size, d_k)


# --8<-- [start:gate_check]
def check_gate_range(g, chunk_size, max_log_decay):
    """No chunk decays a channel by more than e^{-max_log_decay} (the torch tensor g: (B, N, H, d_k)).

    The kernel rounds k ⊙ e^{-gamma} and q ⊙ e^{gamma} to the input dtype. In fp16, e^{gamma}
    below 2^-14 leaves the normal range (and loses its precision bit by bit) and e^{-gamma} above
    2^14 is a step from overflow: -gamma <= 14 ln 2 keeps both sides within fp16's normal range.
    """
    worst = max_chunk_log_decay(g, chunk_size)
    if worst > max_log_decay:
        raise ValueError(
            f"g decays by e^-{worst:.3g} within one chunk of {chunk_size} tokens, beyond e^-{max_log_decay:.3g}: "
            f"e^(+-gamma) would leave the input dtype's range. Bound the gates from below "
            f"(a >= {math.exp(-max_log_decay / chunk_size):.3f} always passes), use a smaller chunk_size, "
            f"or pass max_log_decay=math.inf to run anyway"
        )


def max_chunk_log_decay(g, chunk_size):
    """max over chunks, positions and channels of -gamma, gamma the chunk-local cumulative sum of
    the torch tensor g: (B, N, H, d_k), on the tensor's own device."""
    import torch

    B, N, H, d_k = g.shape
    padded = torch.nn.functional.pad(g, (0, 0, 0, 0, 0, padded_length(N, chunk_size) - N))
    gamma = padded.reshape(B, -1, chunk_size, H, d_k).double().cumsum(dim=2)
    return float(-gamma.min()) if gamma.numel() else 0.0
# --8<-- [end:gate_check]
