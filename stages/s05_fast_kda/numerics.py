"""Stage 5 numerics: the types of the prepare kernel's anchored score operands, the span of gates they
hold before a sub-block is taken term by term, and what a state stored in bf16 between chunks costs.

The prepare kernel (stages.kda.prepare) multiplies q and k by e^{+-(gamma_r - gamma_m)},
anchored at a row m of each sub-block, before its score GEMMs. The off-diagonal slabs' factors are
all <= 1; the diagonal sub-blocks' reach a_min^-(SUB_BLOCK / 2) for the smallest gate a_min, which
decides the operands' types and the gates their GEMMs take (FAST_SPAN_LOG; past it, the kernels take
the sub-block by its definition, so every gate <= 0 runs). Stage 6's intra kernel anchors its
diagonal sub-blocks the same way, with operands in the input dtype.
"""

import math

import numpy as np

from stages.common.checks import Float64Array, check_chunking, check_gate_and_beta, check_qkv
from stages.common.interpreter import round_to_dtype
from stages.s05_fast_kda.reference import SUB_BLOCK, intra_chunk_scores


def score_operand_dtypes(dtype):
    """(diagonal blocks', slabs') dtypes of the prepare kernel's anchored score operands, for inputs
    in `dtype`: fp32 and fp16 for bf16 inputs, fp16 and fp16 for fp16 ones, else the inputs' own (the
    interpreter's float64).

    A slab's factors are all <= 1, so fp16 holds them at any gate, with 10 mantissa bits where bf16
    keeps 7. A diagonal block's factor e^{gamma_r - gamma_m} above its middle row m is at worst
    a_min^-8 for the smallest gate a_min (65504, fp16's largest value, at a_min = 0.25). bf16 inputs
    keep the GEMMs to gates far smaller (FAST_SPAN_LOG), so their diagonal operands are fp32, which
    the GEMM reads as TF32 (fp16's 10 bits). fp16 inputs keep fp16 there, where TF32 was less accurate
    (the stage 5 page's accuracy section measures both); past fp16's range their sub-blocks are taken
    term by term (exact_diagonal_block_macro in the kernel).
    """
    if dtype == "bfloat16":
        return "float32", "float16"
    if dtype == "float16":
        return "float16", "float16"
    return dtype, dtype


FP16_LARGEST_LOG = math.log(65504)  # ln of fp16's largest finite value
FP32_LARGEST_LOG = math.log(3.4028234663852886e38)  # ln of fp32's (TF32's: the same exponent)
BF16_LARGEST_LOG = math.log(3.3895313892515355e38)  # fp32's exponent, 8 mantissa bits: a hair below fp32's
FP64_LARGEST_LOG = math.log(1.7976931348623157e308)  # the interpreter's float64 programs

# --8<-- [start:fast_span]
# The largest span (in e-folds) of a diagonal sub-block's anchored factors that the anchored GEMMs
# take, by the diagonal operands' dtype: half the log of the type's largest value. A factor e^span
# times an entry of q or k (<= 1) cannot overflow, and its partner e^-span keeps span e-folds above
# the type's smallest normal numbers (fp16: e^-9.7, fp32: e^-87.3), so the product loses nothing to
# subnormals. Past it, the sub-block is taken term by term (exact_diagonal_block_macro). The span
# sums up to 8 log gates (rows first + 1 .. middle): fp16 operands keep gates a >= 0.51 on the GEMMs,
# fp32 and bf16 ones (stage 6's bf16 backward) a >= 0.004; the benchmarks' (a >= 0.9, 0.84 e-folds)
# are far from either.
FAST_SPAN_LOG = {"float16": FP16_LARGEST_LOG / 2, "bfloat16": BF16_LARGEST_LOG / 2, "float32": FP32_LARGEST_LOG / 2,
                 "float64": FP64_LARGEST_LOG / 2}
# --8<-- [end:fast_span]



# --8<-- [start:stored_state]
def forward_with_stored_state(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array,
                              beta: Float64Array, chunk_size: int, state_dtype: str) -> tuple[Float64Array, Float64Array]:
    """Reference B's chunk loop in float64, the state S^T (d_k x d_v, the kernel layout) stored in
    `state_dtype` ("float32", "bfloat16"; "float64" stores it exactly) at the end of every chunk.
    Returns (o (B, N, H, d_v), the final state S^T (B, H, d_k, d_v)).

    Every product is exact; only the store of the state rounds, once a chunk. The recurrence kernel
    keeps its state in fp32 registers; FlashKDA keeps it in bf16 on chip, updates it with fp32 FMAs
    and stores it back after every chunk of 16 tokens. The error of o against reference A is what
    that store costs, and nothing else.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="channel")
    check_chunking(N, d_v, chunk_size)
    o, final_state = np.zeros((B, N, H, d_v)), np.zeros((B, H, d_k, d_v))
    for b in range(B):
        for h in range(H):
            S_T = np.zeros((d_k, d_v))
            for start in range(0, N, chunk_size):
                rows = slice(start, min(start + chunk_size, N))
                Q, K, V, beta_c = q[b, rows, h], k[b, rows, h], v[b, rows, h], beta[b, rows, h]
                C = len(Q)
                gamma = np.cumsum(g[b, rows, h], axis=0)  # (C, d_k): log decay from the chunk start
                A_kk, A_qk = intra_chunk_scores(Q, K, gamma, math.gcd(C, SUB_BLOCK))  # exact in float64
                A_hat = beta_c[:, None] * np.linalg.inv(np.eye(C) + A_kk * beta_c[None, :])  # diag(beta) T
                V_new = A_hat @ V - A_hat @ (K * np.exp(gamma)) @ S_T  # U - W S^T
                o[b, rows, h] = (Q * np.exp(gamma)) @ S_T + A_qk @ V_new
                S_T = np.exp(gamma[-1])[:, None] * S_T + (K * np.exp(gamma[-1] - gamma)).T @ V_new
                S_T = np.asarray(round_to_dtype(S_T, state_dtype), dtype=np.float64)  # the store
            final_state[b, h] = S_T
    return o, final_state
# --8<-- [end:stored_state]


# The gates of the stored-state study, each as the range of the log gate g drawn uniformly per token
# and channel: a state that remembers long (g near 0) carries each store's rounding further
STATE_STUDY_GATES = {
    "a in [0.999, 1]: long memory": (math.log(0.999), 0.0),
    "a in [0.9, 0.999]: the benchmarks'": (math.log(0.9), math.log(0.999)),
    "g in [-5, 0]: FLA's bounded range": (-5.0, 0.0),
    "g in [-20, 0]: stronger": (-20.0, 0.0),
}
# (chunk size, state dtype): the recurrence kernel's store, then FlashKDA's dtype at both chunk sizes
STATE_STUDY_STORES = [(64, "float32"), (64, "bfloat16"), (16, "bfloat16")]


def stored_state_study(N=2048, d=64, window=256, seed=0):
    """o's error against float64 for each gate of STATE_STUDY_GATES (one head each) and each (chunk
    size, state dtype) of STATE_STUDY_STORES: {(gates, chunk, dtype): (rel L2 of o in each window of
    `window` tokens, rel L2 of the final state)}. Unit q and k, v ~ N(0, 1), beta in [0.1, 0.9], d_k =
    d_v = d; the reference is the same loop with the state stored exactly."""
    rng = np.random.default_rng(seed)
    H = len(STATE_STUDY_GATES)
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in rng.standard_normal((2, 1, N, H, d)))
    v = rng.standard_normal((1, N, H, d))
    g = np.stack([rng.uniform(low, high, (1, N, d)) for low, high in STATE_STUDY_GATES.values()], axis=2)
    beta = rng.uniform(0.1, 0.9, (1, N, H))
    exact_o, exact_state = forward_with_stored_state(q, k, v, g, beta, 64, "float64")

    def rel_l2(actual, expected):
        return np.linalg.norm(actual - expected) / np.linalg.norm(expected)

    found = {}
    for chunk_size, dtype in STATE_STUDY_STORES:
        o, state = forward_with_stored_state(q, k, v, g, beta, chunk_size, dtype)
        for h, gates in enumerate(STATE_STUDY_GATES):
            windows = [rel_l2(o[:, t:t + window, h], exact_o[:, t:t + window, h]) for t in range(0, N, window)]
            found[gates, chunk_size, dtype] = (windows, rel_l2(state[:, h], exact_state[:, h]))
    return found
