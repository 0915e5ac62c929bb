"""Exercise s05.fused_loads (fill): the gate, the norms and beta's sigmoid, computed as a chunk is loaded.

A model does not hand KDA the recurrence's own q, k, g and beta. Kimi Linear's layer passes q and k
unnormalized, the raw gate projection x with the parameters A_log (H,) and dt_bias (H * d_k,), and
beta's logits (FLA's use_qk_l2norm_in_kernel, use_gate_in_kernel, use_beta_sigmoid_in_kernel). The
prepare kernel makes them the recurrence's own on chip, in the shared memory it loads a chunk into,
instead of five passes over HBM in front of it. This program is that step alone: one program per
(chunk, batch x head) loads a chunk of the raw tensors (given, above the region) and writes what the
prepare would go on with (given, below it). Fill the region: in Q_s, K_s, gate_s and beta_s, in
place, for `form` (stages.kda.inputs.InputForm, with a raw gate: form.gate "softplus" or "sigmoid"),

    q, k  <- x / sqrt(||x||^2 + L2_NORM_EPS), the sum over the d_k channels of its row, summed in
             fp32 (if form.l2_normalize); then q <- form.scale * q
    g     <- -exp(A_log[h]) * softplus(x + dt_bias[h, d])                 (form.gate "softplus")
             form.lower_bound * sigmoid(exp(A_log[h]) * (x + dt_bias[h, d]))  (form.gate "sigmoid")
             softplus(y) = log(1 + e^y), and y itself above SOFTPLUS_THRESHOLD (where e^y would
             overflow fp32 first); every finite x gives a finite g
    beta  <- form.beta_bound * sigmoid(beta)                   (form.beta "sigmoid" or "sigmoid2")

as stages.kda.inputs.activate defines them (the tests compare with it), where dt_bias[h, d], the
bias of channel d of head h, is element h * d_k + d of Dt_bias (FLA's layout). A chunk's rows past
the last token (the last chunk holds tokens - t0 of them, `rows`) were loaded as zeros; in the
outputs each must be a zero token, q = k = 0, g = 0, beta = 0 (a token that leaves the state as it
was). Compute exp(y) as T.exp2(y * LOG2_E) and log(y) as T.log2(y) / LOG2_E. The buffers:
    Q_s, K_s   (C, d_k) shared, in `dtype`: q's and k's rows as loaded;
    gate_s     (C, d_k) fp32 shared: x as loaded, then g;
    beta_s     (C,) fp32 shared: beta's logits as loaded, then beta.
A_log and Dt_bias are fp32 in global memory: read each of the head's values once per program, not
once per element that uses it (a tensor of H values, read by every lane of a C x d_k loop, costs
global reads as large as the gate's own: stages.common.program_cost counts them so).

Without a GPU the tests run your program through the course's tile interpreter
(stages.common.interpreter) in float64 and in bf16 and compare its outputs with
stages.kda.inputs.activate: both gate forms, lengths that are not a multiple of the chunk, gates
down to thousands a token, beta logits at which the sigmoid rounds to 0 and 1; with nvcc they also
compile it for sm_90a.
Read: stage 5 page, "The tensors as a model passes them".  Check: course check s05
"""

from stages.common.tilelang_tools import LOG2_E
from stages.kda.inputs import L2_NORM_EPS, SOFTPLUS_THRESHOLD, InputForm
from stages.s05_fast_kda.kernel import DEFAULT_CHUNK_SIZE

# Kimi Linear's call (FLA's KimiDeltaAttention): the default gate, both norms, beta's sigmoid, q
# scaled by 1 / sqrt(d_k) for d_k = 128
KIMI_FORM = InputForm(gate="softplus", l2_normalize=True, beta="sigmoid", scale=128 ** -0.5)


def fused_loads(B, N, H, d_k, chunk_size=DEFAULT_CHUNK_SIZE, form=KIMI_FORM, dtype="bfloat16", tokens=None,
                threads=128):
    """The program: q, k, x (B, tokens, H, d_k) and beta's logits (B, tokens, H) in `dtype`, A_log (H,)
    and dt_bias (H * d_k,) fp32 -> q, k (B, N, H, d_k) in `dtype`, g (B, N, H, d_k) and beta (B, N, H)
    fp32, activated as `form` says; rows tokens .. N - 1 of the outputs a zero token. N is a multiple
    of chunk_size and tokens (N when None) lies in its last chunk: N - chunk_size < tokens <= N."""
    import tilelang.language as T

    if not form.raw_gate:
        raise ValueError(f"fused_loads computes the gate from a raw projection: form.gate 'softplus' or 'sigmoid', "
                         f"got {form.gate!r}")
    C = chunk_size
    tokens = N if tokens is None else tokens
    if N % C != 0 or not N - C < tokens <= N:
        raise ValueError(f"N = {N} must be a multiple of chunk_size = {C}, and tokens = {tokens} in its last chunk")
    accum_dtype = "float32"

    @T.prim_func
    def fused_loads_program(
        Q: T.Tensor((B, tokens, H, d_k), dtype),
        K: T.Tensor((B, tokens, H, d_k), dtype),
        G: T.Tensor((B, tokens, H, d_k), dtype),
        Beta: T.Tensor((B, tokens, H), dtype),
        A_log: T.Tensor((H,), accum_dtype),
        Dt_bias: T.Tensor((H * d_k,), accum_dtype),
        Q_out: T.Tensor((B, N, H, d_k), dtype),
        K_out: T.Tensor((B, N, H, d_k), dtype),
        G_out: T.Tensor((B, N, H, d_k), accum_dtype),
        Beta_out: T.Tensor((B, N, H), accum_dtype),
    ):
        with T.Kernel(N // C, B * H, threads=threads) as (i_c, i_bh):
            b, h = i_bh // H, i_bh % H
            t0 = i_c * C
            rows = T.min(C, tokens - t0)  # the chunk's tokens: the last chunk may be short
            Q_s = T.alloc_shared((C, d_k), dtype)
            K_s = T.alloc_shared((C, d_k), dtype)
            gate_s = T.alloc_shared((C, d_k), accum_dtype)
            beta_s = T.alloc_shared((C,), accum_dtype)
            # masked loads: a row past the last token reads as zeros
            for r, d in T.Parallel(C, d_k):
                Q_s[r, d] = T.if_then_else(r < rows, Q[b, t0 + r, h, d], 0)
                K_s[r, d] = T.if_then_else(r < rows, K[b, t0 + r, h, d], 0)
            for r, d in T.Parallel(C, d_k):
                gate_s[r, d] = T.if_then_else(r < rows, G[b, t0 + r, h, d], 0)
            for r in T.Parallel(C):
                beta_s[r] = T.if_then_else(r < rows, Beta[b, t0 + r, h], 0)

            # EXERCISE BEGIN
            # --8<-- [start:answer]
            # the head's gate parameters on chip, once: its d_k biases and the rate exp(A_log)
            bias_s = T.alloc_shared((d_k,), accum_dtype)
            for d in T.Parallel(d_k):
                bias_s[d] = Dt_bias[h * d_k + d]
            rate = T.alloc_var(accum_dtype)
            rate = T.exp2(A_log[h] * LOG2_E)

            if form.l2_normalize:
                # each row divided by its norm: the squares summed in fp32 registers, one row a lane
                for X_s, factor in ((Q_s, form.scale), (K_s, 1.0)):
                    squares_f = T.alloc_fragment((C, d_k), accum_dtype)
                    norms_f = T.alloc_fragment((C,), accum_dtype)
                    for r, d in T.Parallel(C, d_k):
                        squares_f[r, d] = X_s[r, d] * X_s[r, d]
                    T.reduce_sum(squares_f, norms_f, dim=1)
                    for r, d in T.Parallel(C, d_k):
                        X_s[r, d] = X_s[r, d] * (factor * T.rsqrt(norms_f[r] + L2_NORM_EPS))
            elif form.scale != 1.0:
                for r, d in T.Parallel(C, d_k):
                    Q_s[r, d] = Q_s[r, d] * form.scale

            for r, d in T.Parallel(C, d_k):
                biased = gate_s[r, d] + bias_s[d]
                if form.gate == "softplus":  # log(1 + e^y) by exp2 and log2, y itself above the threshold
                    softplus = T.if_then_else(biased > SOFTPLUS_THRESHOLD, biased,
                                              T.log2(1 + T.exp2(biased * LOG2_E)) / LOG2_E)
                    gate = -rate * softplus
                else:
                    gate = form.lower_bound / (1 + T.exp2(-rate * biased * LOG2_E))
                gate_s[r, d] = T.if_then_else(r < rows, gate, 0)  # a zero token past the end: no decay
            if form.beta != "value":
                for r in T.Parallel(C):
                    beta = form.beta_bound / (1 + T.exp2(-beta_s[r] * LOG2_E))
                    beta_s[r] = T.if_then_else(r < rows, beta, 0)
            # --8<-- [end:answer]
            # EXERCISE END

            T.fence_proxy_async()  # every staged tile seen by the TMA store (stages/kda/tiles.py: "TMA stores")
            T.copy(Q_s, Q_out[b, t0:t0 + C, h, :])
            T.copy(K_s, K_out[b, t0:t0 + C, h, :])
            T.copy(gate_s, G_out[b, t0:t0 + C, h, :])
            T.copy(beta_s, Beta_out[b, t0:t0 + C, h])

    return fused_loads_program
