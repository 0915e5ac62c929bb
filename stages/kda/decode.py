"""The decode kernel: one KDA step (T = 1) for a batch of sequences whose states live in a pool.

One program per (block of d_v columns, batch x head), as in the chunked kernels. Program (i_v, b, h)
reads its slice of sequence b's state, S^T[:, block] (d_k x block_dv, fp32), from the pool at
slots[b], advances it by one token and writes it back in place:

    S^T <- Diag(e^g) S^T                 decay, row by row (row d is key channel d)
    u    = beta (v - (S^T)^T k)          one column sum over d_k
    S^T <- S^T + k u^T                   the rank-one delta-rule write
    o    = (S^T)^T q                     a second column sum, with the updated state

(see stages.s07_serving.reference for why this is stage 4's recurrence). No chunk, no GEMM: the state
is read once and written once, 2 * d_k * block_dv * 4 bytes per program against a few KiB of q, k,
v, g; everything else happens in registers. The kernel is bound by memory, and its measure is the
fraction of the copy bandwidth it reaches (benchmarks/decode.py).
"""

from stages.common.device_checks import BAD_BETA, BAD_GATE, BAD_SLOT, FLAG_COUNT, bad_beta, bad_gate
from stages.common.tilelang_tools import LOG2_E
from stages.kda.config import DEFAULT_BLOCK_DV, DEFAULT_THREADS
from stages.kda.inputs import L2_NORM_EPS, InputForm
from stages.kda.tiles import scaled_sigmoid, softplus

PLAIN = InputForm()


# --8<-- [start:program]
def build_decode_program(B, P, H, d_k, d_v, block_dv=DEFAULT_BLOCK_DV, dtype="float16", state_dtype="float32",
                         threads=DEFAULT_THREADS, value_flags=True, form: InputForm = PLAIN, group=1,
                         gate_dtype=None, beta_dtype=None):
    """The decode program: q, k (B, H, d_k), v (B, H, d_v) in `dtype`; g (B, H, d_k), beta (B, H) and
    the pool (P, H, d_k, d_v) in `state_dtype` (fp32 on the GPU; the interpreter also runs float64);
    slots (B,) int32 -> o (B, H, d_v) in `dtype`, the pool updated in place at slots.

    The values only the data can tell are checked here, on the device, as they are read: a log gate
    that is not finite and <= 0 sets Flags[BAD_GATE], a beta outside [0, 1] (or NaN) Flags[BAD_BETA],
    a slot outside [0, P) Flags[BAD_SLOT] (stages.common.device_checks reads them, with no host sync
    per call). A program whose slot is out of range reads slot 0 and writes nothing: it never
    touches memory past the pool.

    block_dv must divide d_v. Parameters in order: Q, K, V, G, Beta, Slots, State_pool, Flags, O
    (out_idx=[8]); Flags (FLAG_COUNT,) int32 is only ever set to 1. value_flags=False leaves Flags
    out (O is then parameter 7) and flags nothing, for decode's checks="off"; a slot outside the
    pool still writes nothing.

    form (stages.kda.inputs.InputForm): q, k, g and beta as a model passes them, activated as they are
    read (q and k normalized, q scaled; g from the raw x with A_log (H,) and Dt_bias (H, d_k) fp32,
    two more parameters after Beta; beta from its logits), g in gate_dtype and beta in beta_dtype
    (None: state_dtype). H counts the value heads; with grouped value heads (`group` > 1) q and k
    have H / group heads, value head h reading head h // group.
    """
    import tilelang.language as T

    accum_dtype = state_dtype
    gate_dtype = gate_dtype or state_dtype
    beta_dtype = beta_dtype or state_dtype
    qk_heads = H // group

    @T.macro
    def unit_vector(x_s, factor):
        # x <- factor x / sqrt(||x||^2 + eps): the program's own copy of q or k, normalized
        square_f = T.alloc_fragment((d_k,), accum_dtype)
        norm_f = T.alloc_fragment((1,), accum_dtype)
        for d in T.Parallel(d_k):
            square_f[d] = x_s[d] * x_s[d]
        T.reduce_sum(square_f, norm_f, dim=0)
        for d in T.Parallel(d_k):
            x_s[d] = x_s[d] * (factor * T.rsqrt(norm_f[0] + L2_NORM_EPS))

    def qk_head(h):
        return h if group == 1 else h // group  # one q/k head serves `group` value heads

    def log_gate(G, A_log, Dt_bias, b, h, d):
        # the step's log gate in channel d, from the raw x where the form activates it
        if form.gate == "log":
            return G[b, h, d]
        x = G[b, h, d] + Dt_bias[h, d]
        rate = T.exp2(A_log[h] * LOG2_E)
        if form.gate == "softplus":
            return -rate * softplus(x)
        return scaled_sigmoid(form.lower_bound, x, rate)

    def step_beta(Beta, b, h):
        # the step's beta, from its logit where the form takes the sigmoid
        if form.beta == "value":
            return Beta[b, h]
        return scaled_sigmoid(form.beta_bound, Beta[b, h])

    @T.macro
    def decode_step(Q, K, V, G, Beta, A_log, Dt_bias, Slots, State_pool, Flags, O):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv
            slot_in_pool = T.And(Slots[b] >= 0, Slots[b] < P)
            slot = T.if_then_else(slot_in_pool, Slots[b], 0)  # where sequence b's state lives in the pool

            q_s = T.alloc_shared((d_k,), accum_dtype)
            k_s = T.alloc_shared((d_k,), accum_dtype)
            decay_s = T.alloc_shared((d_k,), accum_dtype)  # e^g, one rate per key channel
            v_s = T.alloc_shared((block_dv,), accum_dtype)

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state's slice, read once
            product_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # k ⊙ S^T, then q ⊙ S^T
            recalled_f = T.alloc_fragment((block_dv,), accum_dtype)  # (S^T)^T k: what the state holds for k
            u_f = T.alloc_fragment((block_dv,), accum_dtype)  # beta (v - recalled)
            o_f = T.alloc_fragment((block_dv,), accum_dtype)

            T.copy(State_pool[slot, h, :, v0:v0 + block_dv], S_f)
            T.copy(Q[b, qk_head(h), :], q_s)
            T.copy(K[b, qk_head(h), :], k_s)
            T.copy(V[b, h, v0:v0 + block_dv], v_s)
            if form.l2_normalize:
                unit_vector(q_s, form.scale)
                unit_vector(k_s, 1.0)
            elif form.scale != 1.0:
                for d in T.Parallel(d_k):
                    q_s[d] = q_s[d] * form.scale
            for d in T.Parallel(d_k):
                decay_s[d] = T.exp2(log_gate(G, A_log, Dt_bias, b, h, d) * LOG2_E)
                if value_flags:
                    if bad_gate(log_gate(G, A_log, Dt_bias, b, h, d), accum_dtype):
                        Flags[BAD_GATE] = 1
            if value_flags:
                if bad_beta(step_beta(Beta, b, h), form.beta_bound):
                    Flags[BAD_BETA] = 1
                if T.Not(slot_in_pool):
                    Flags[BAD_SLOT] = 1

            # the decay first, then what the decayed state recalls for k
            for d, j in T.Parallel(d_k, block_dv):
                S_f[d, j] *= decay_s[d]
                product_f[d, j] = k_s[d] * S_f[d, j]
            T.reduce_sum(product_f, recalled_f, dim=0)
            for j in T.Parallel(block_dv):
                u_f[j] = step_beta(Beta, b, h) * (v_s[j] - recalled_f[j])

            # the write, then the output read from the updated state
            for d, j in T.Parallel(d_k, block_dv):
                S_f[d, j] += k_s[d] * u_f[j]
                product_f[d, j] = q_s[d] * S_f[d, j]
            T.reduce_sum(product_f, o_f, dim=0)
            T.copy(o_f, O[b, h, v0:v0 + block_dv])
            for d, j in T.Parallel(d_k, block_dv):
                if slot_in_pool:  # back where it came from; a slot out of range writes nothing
                    State_pool[slot, h, d, v0 + j] = S_f[d, j]

    @T.prim_func
    def kda_decode(
        Q: T.Tensor((B, qk_heads, d_k), dtype),
        K: T.Tensor((B, qk_heads, d_k), dtype),
        V: T.Tensor((B, H, d_v), dtype),
        G: T.Tensor((B, H, d_k), gate_dtype),
        Beta: T.Tensor((B, H), beta_dtype),
        A_log: T.Tensor((H,), "float32") if form.raw_gate else None,
        Dt_bias: T.Tensor((H, d_k), "float32") if form.raw_gate else None,
        Slots: T.Tensor((B,), "int32"),
        State_pool: T.Tensor((P, H, d_k, d_v), accum_dtype),
        Flags: T.Tensor((FLAG_COUNT,), "int32") if value_flags else None,
        O: T.Tensor((B, H, d_v), dtype),
    ):
        decode_step(Q, K, V, G, Beta, A_log, Dt_bias, Slots, State_pool, Flags, O)

    return kda_decode
# --8<-- [end:program]
