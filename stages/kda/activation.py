"""The backward's two elementwise kernels for the tensors as a model passes them (an InputForm other than
the plain one, or grouped value heads): one program per (block of ROWS tokens, batch x value head).

    activate               raw q, k, g, beta -> the recurrence's own (stages.kda.inputs.activate), on
                           chip with the forward prepare's own macro (tiles.activate_loads), q and k
                           written once per value head: the backward kernels' inputs
    activation_gradients   the backward kernels' dq, dk, dg, dbeta (of the activated tensors) -> the
                           gradients of the raw ones, by the chain rule of each transform:

        q_a = s r q,  r = (||q||^2 + eps)^{-1/2}      dq = s r dq_a - s r^3 (q . dq_a) q
        g = -e^A softplus(z),  z = x + b              dz = -e^A sigmoid(z) dg,  dx = dz,  dA = dg g
        g = lb sigma,  sigma = sigmoid(z),            dz = lb sigma (1 - sigma) dg,  dx = e^A dz,  dA = dz z
        z = e^A (x + b)
        beta = m sigmoid(y)                           dy = beta (1 - beta / m) dbeta

      (s q's scale, 1 for k; A = A_log, b = dt_bias, lb the lower bound, m = 1 or 2), each written in
      its input's dtype (rounded once, from fp32), with the sums over tokens left to the caller:
      ddt_bias = the sum of the per-block sums of dx written here (fp32, before dx is rounded),
      dA_log = the sum of the per-row dA, and with grouped value heads dq and dk (then fp32) summed
      over each q/k head's group.

They replace autograd over the same transforms in torch, which took about 8 ms a training step at
T 16384, H 32 (benchmarks/results/kimi_train_h100): some thirty elementwise passes over (T, H, d_k)
tensors against one read and one write here.
"""

from typing import NamedTuple

from stages.common.tilelang_tools import LOG2_E
from stages.kda.inputs import L2_NORM_EPS, InputForm
from stages.kda.tiles import activate_loads_macro, scaled, scaled_sigmoid, softplus

ROWS = 32  # tokens a program: one tile of (ROWS, d_k) per tensor
THREADS = 128


def _activation_types(B, N, H, d_k, dtype, group, gate_dtype, beta_dtype):
    """The kernels' tensor types (factories, as stages.kda.tensor_types's): the raw inputs, the gate's
    parameters, rows per value head in `dtype` and fp32, the raw inputs' gradients (q's and k's per value
    head, fp32 where a group sums them), one fp32 number per token and head, and one fp32 row of d_k per
    block of ROWS tokens and head."""
    import functools
    import types

    import tilelang.language as T

    def tensor(shape, tensor_dtype):
        return functools.partial(T.Tensor, shape, tensor_dtype)

    return types.SimpleNamespace(
        qk=tensor((B, N, H // group, d_k), dtype), g=tensor((B, N, H, d_k), gate_dtype),
        beta=tensor((B, N, H), beta_dtype), A_log=tensor((H,), "float32"), Dt_bias=tensor((H, d_k), "float32"),
        rows=tensor((B, N, H, d_k), dtype), rows_fp32=tensor((B, N, H, d_k), "float32"),
        d_qk=tensor((B, N, H, d_k), dtype if group == 1 else "float32"), d_g=tensor((B, N, H, d_k), gate_dtype),
        d_beta=tensor((B, N, H), beta_dtype), heads_fp32=tensor((B, N, H), "float32"),
        blocks_fp32=tensor((B, (N + ROWS - 1) // ROWS, H, d_k), "float32"))


def _raw_tiles(C, d_k, dtype):
    """The shared tiles of one block of raw rows, as activate_loads takes them (a namespace)."""
    import types

    import tilelang.language as T

    return types.SimpleNamespace(Q_s=T.alloc_shared((C, d_k), dtype), K_s=T.alloc_shared((C, d_k), dtype),
                                 gamma_s=T.alloc_shared((C, d_k), "float32"), beta_s=T.alloc_shared((C,), "float32"))


class RowBlock(NamedTuple):
    """One program's block of rows: batch row b, value head h, its first token t0, its tokens `rows` (the
    batch's last block may be short) and its raw tiles s, loaded."""

    b: object
    h: object
    t0: object
    rows: object
    s: object


def _row_block_macro(C, d_k, dtype, H, N, group):
    """The macro row_block(Q, K, G, Beta, i_t, i_bh) -> RowBlock: program (i_t, i_bh)'s rows of the raw
    tensors in shared tiles (_raw_tiles), zeros past the batch's last token."""
    import tilelang.language as T

    @T.macro
    def row_block(Q, K, G, Beta, i_t, i_bh):
        b, h = i_bh // H, i_bh % H
        t0 = i_t * C
        rows = T.min(C, N - t0)
        s = _raw_tiles(C, d_k, dtype)
        for r, d in T.Parallel(C, d_k):
            s.Q_s[r, d] = T.if_then_else(r < rows, Q[b, t0 + r, h // group, d], 0)
            s.K_s[r, d] = T.if_then_else(r < rows, K[b, t0 + r, h // group, d], 0)
        for r, d in T.Parallel(C, d_k):
            s.gamma_s[r, d] = T.if_then_else(r < rows, G[b, t0 + r, h, d], 0)
        for r in T.Parallel(C):
            s.beta_s[r] = T.if_then_else(r < rows, Beta[b, t0 + r, h], 0)
        return RowBlock(b, h, t0, rows, s)

    return row_block


def activation_outputs(form: InputForm) -> tuple[list, list]:
    """The indices of the two kernels' outputs among their parameters (tilelang.compile's out_idx), after
    the raw q, k, g, beta (and A_log, Dt_bias with a raw gate): activate's q_a, k_a, g_a, beta_a, and,
    after the four gradients it takes, activation_gradients' dq, dk, dg, dbeta, dA (and dDt_bias_blocks
    with a raw gate)."""
    inputs = 4 + 2 * form.raw_gate
    return list(range(inputs, inputs + 4)), list(range(inputs + 4, inputs + 9 + form.raw_gate))


# --8<-- [start:activate]
def build_activate_program(B, N, H, d_k, dtype, form: InputForm, group=1, gate_dtype="float32",
                           beta_dtype="float32"):
    """q, k (B, N, H / group, d_k) in `dtype`, g (B, N, H, d_k) in gate_dtype, beta (B, N, H) in beta_dtype
    as `form` takes them (and A_log (H,), Dt_bias (H, d_k) fp32 after Beta with a raw gate) -> q_a, k_a
    (B, N, H, d_k) in `dtype` (value head h's from q/k head h // group), g_a (B, N, H, d_k) and beta_a
    (B, N, H) fp32: stages.kda.inputs.activate, computed as the forward's prepare computes it."""
    import tilelang.language as T

    C = ROWS
    tensors = _activation_types(B, N, H, d_k, dtype, group, gate_dtype, beta_dtype)
    activate = activate_loads_macro(C, d_k, form)
    row_block = _row_block_macro(C, d_k, dtype, H, N, group)

    @T.prim_func
    def kda_activate(
        Q: tensors.qk,
        K: tensors.qk,
        G: tensors.g,
        Beta: tensors.beta,
        A_log: tensors.A_log if form.raw_gate else None,
        Dt_bias: tensors.Dt_bias if form.raw_gate else None,
        Q_a: tensors.rows,
        K_a: tensors.rows,
        G_a: tensors.rows_fp32,
        Beta_a: tensors.heads_fp32,
    ):
        with T.Kernel((N + C - 1) // C, B * H, threads=THREADS) as (i_t, i_bh):
            b, h, t0, rows, s = row_block(Q, K, G, Beta, i_t, i_bh)
            q_factor, k_factor = (None, None) if form.is_plain else activate(s, A_log, Dt_bias, h, rows)
            for r, d in T.Parallel(C, d_k):
                if r < rows:
                    Q_a[b, t0 + r, h, d] = scaled(s.Q_s, q_factor, r, d)
                    K_a[b, t0 + r, h, d] = scaled(s.K_s, k_factor, r, d)
                    G_a[b, t0 + r, h, d] = s.gamma_s[r, d]
            for r in T.Parallel(C):
                if r < rows:
                    Beta_a[b, t0 + r, h] = s.beta_s[r]

    return kda_activate
# --8<-- [end:activate]


# --8<-- [start:activation_gradients]
def build_activation_gradients_program(B, N, H, d_k, dtype, form: InputForm, group=1, gate_dtype="float32",
                                       beta_dtype="float32"):
    """The raw tensors of build_activate_program's inputs, then the gradients of its outputs dq_a, dk_a,
    dg_a (B, N, H, d_k) and dbeta_a (B, N, H) fp32 -> dq, dk (B, N, H, d_k) per value head, in `dtype`
    (fp32 with group > 1: the caller sums each group), dg (B, N, H, d_k) in gate_dtype and dbeta (B, N, H)
    in beta_dtype (of the raw gate and logits), per token and head the A_log gradient's term dA (B, N, H)
    fp32 (zeros unless the gate is raw), and with a raw gate dg's sums over each block of ROWS tokens,
    dDt_bias_blocks (B, ceil(N / ROWS), H, d_k) fp32: the caller's sum of them is dt_bias's gradient,
    taken before dg is rounded to gate_dtype."""
    import tilelang.language as T

    C = ROWS
    tensors = _activation_types(B, N, H, d_k, dtype, group, gate_dtype, beta_dtype)
    row_block = _row_block_macro(C, d_k, dtype, H, N, group)
    accum_dtype = "float32"

    @T.macro
    def unit_gradient(X_s, dX_a, dX, scale, b, t0, h, rows):
        # dx = s r dy - s r^3 (x . dy) x for y = s r x, r = (||x||^2 + eps)^{-1/2}; dx = s dy without the norm
        x_f = T.alloc_fragment((C, d_k), accum_dtype)
        dy_f = T.alloc_fragment((C, d_k), accum_dtype)
        for r, d in T.Parallel(C, d_k):
            x_f[r, d] = X_s[r, d]
            dy_f[r, d] = T.if_then_else(r < rows, dX_a[b, t0 + r, h, d], 0) * scale
        if form.l2_normalize:
            squares_f = T.alloc_fragment((C, d_k), accum_dtype)
            products_f = T.alloc_fragment((C, d_k), accum_dtype)
            norm_f = T.alloc_fragment((C,), accum_dtype)
            dot_f = T.alloc_fragment((C,), accum_dtype)
            for r, d in T.Parallel(C, d_k):
                squares_f[r, d] = x_f[r, d] * x_f[r, d]
                products_f[r, d] = x_f[r, d] * dy_f[r, d]
            T.reduce_sum(squares_f, norm_f, dim=1)
            T.reduce_sum(products_f, dot_f, dim=1)
            for r, d in T.Parallel(C, d_k):
                inverse = T.rsqrt(norm_f[r] + L2_NORM_EPS)
                if r < rows:
                    dX[b, t0 + r, h, d] = inverse * (dy_f[r, d] - inverse * inverse * dot_f[r] * x_f[r, d])
        else:
            for r, d in T.Parallel(C, d_k):
                if r < rows:
                    dX[b, t0 + r, h, d] = dy_f[r, d]

    @T.macro
    def gate_gradient(s, A_log, Dt_bias, dG_a, dG, dA, dDt_bias_blocks, b, i_t, t0, h, rows):
        # the raw gate's gradient element by element, written rounded; dA's per-row sum and dt_bias's
        # per-channel sum (of the fp32 dx, before rounding) in registers
        dA_terms_f = T.alloc_fragment((C, d_k), accum_dtype)
        dA_f = T.alloc_fragment((C,), accum_dtype)
        dx_f = T.alloc_fragment((C, d_k), accum_dtype)
        rate = T.exp2(A_log[h] * LOG2_E) if form.raw_gate else 1.0
        for r, d in T.Parallel(C, d_k):
            dg = T.if_then_else(r < rows, dG_a[b, t0 + r, h, d], 0)  # 0 past the last token: dx there is 0
            if form.gate == "softplus":
                z = s.gamma_s[r, d] + Dt_bias[h, d]
                dx_f[r, d] = -rate * scaled_sigmoid(1, z) * dg
                dA_terms_f[r, d] = -rate * softplus(z) * dg  # dg times g itself
            elif form.gate == "sigmoid":
                z = rate * (s.gamma_s[r, d] + Dt_bias[h, d])
                sigma = scaled_sigmoid(1, z)
                dz = form.lower_bound * sigma * (1 - sigma) * dg
                dx_f[r, d] = rate * dz
                dA_terms_f[r, d] = dz * z
            else:  # the log gate as given
                dx_f[r, d] = dg
                dA_terms_f[r, d] = 0
        for r, d in T.Parallel(C, d_k):
            if r < rows:
                dG[b, t0 + r, h, d] = dx_f[r, d]
        T.reduce_sum(dA_terms_f, dA_f, dim=1)
        for r in T.Parallel(C):
            if r < rows:
                dA[b, t0 + r, h] = dA_f[r]
        if form.raw_gate:
            dx_sum_f = T.alloc_fragment((d_k,), accum_dtype)
            T.reduce_sum(dx_f, dx_sum_f, dim=0)
            for d in T.Parallel(d_k):
                dDt_bias_blocks[b, i_t, h, d] = dx_sum_f[d]

    @T.prim_func
    def kda_activation_gradients(
        Q: tensors.qk,
        K: tensors.qk,
        G: tensors.g,
        Beta: tensors.beta,
        A_log: tensors.A_log if form.raw_gate else None,
        Dt_bias: tensors.Dt_bias if form.raw_gate else None,
        dQ_a: tensors.rows_fp32,
        dK_a: tensors.rows_fp32,
        dG_a: tensors.rows_fp32,
        dBeta_a: tensors.heads_fp32,
        dQ: tensors.d_qk,
        dK: tensors.d_qk,
        dG: tensors.d_g,
        dBeta: tensors.d_beta,
        dA: tensors.heads_fp32,
        dDt_bias_blocks: tensors.blocks_fp32 if form.raw_gate else None,
    ):
        with T.Kernel((N + C - 1) // C, B * H, threads=THREADS) as (i_t, i_bh):
            b, h, t0, rows, s = row_block(Q, K, G, Beta, i_t, i_bh)
            unit_gradient(s.Q_s, dQ_a, dQ, form.scale, b, t0, h, rows)
            unit_gradient(s.K_s, dK_a, dK, 1.0, b, t0, h, rows)
            gate_gradient(s, A_log, Dt_bias, dG_a, dG, dA, dDt_bias_blocks, b, i_t, t0, h, rows)
            for r in T.Parallel(C):
                if r < rows:
                    dbeta = dBeta_a[b, t0 + r, h]
                    if form.beta == "value":
                        dBeta[b, t0 + r, h] = dbeta
                    else:
                        beta = scaled_sigmoid(form.beta_bound, s.beta_s[r])
                        dBeta[b, t0 + r, h] = beta * (1 - beta / form.beta_bound) * dbeta

    return kda_activation_gradients
# --8<-- [end:activation_gradients]
