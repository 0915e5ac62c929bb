"""The tile pieces the fast-path kernels share, as TileLang macros (`@T.macro`), and the prepare's buffers.

Each `*_macro(sizes)` function returns a macro for those sizes; a kernel builder calls it once and uses
the macro in its program, so a fix to one piece is made once for every kernel that runs it:

    prepare_buffers           the prepare kernel's shared-memory and register buffers (dense and packed)
    activate_loads            q, k, g and beta as the model passes them, made the recurrence's own on chip
    flag_bad_values           g and beta checked as they are loaded (the checks="device" kernels)
    cumulative_gates          gamma = cumsum of the log gates in a chunk
    anchored_scores           L = A_kk diag(beta) and A_qk through anchored GEMMs, any gate
    flag_wide_spans           which diagonal sub-blocks leave the anchored operands' range
    exact_diagonal_block      such a sub-block's scores, by their definition
    block_inverse             T = (I + L)^{-1} by 16 x 16 blocks
    wy_outputs                W = diag(beta) T (K e^gamma), U = diag(beta) T V
    chunk_operands            a chunk loop's operands: their tiles declared, one chunk's rows loaded
    chunk_output              V_new = U - W S^T and one chunk's o (the recurrences)
    advance_state             S^T past one chunk (the recurrences and the backward's states)
    wait_for_tensor_cores     the intra kernel's wait for GEMMs issued together
    exact_diagonal_gradients  the intra kernel's score gradients of a wide sub-block, by their definition

TMA stores. A tile staged in shared memory and stored with `T.copy(X_s, Global[...])` goes out by TMA:
one thread hands the tile to the copy engine, which reads shared memory through the *async proxy*, while
the threads wrote it through the *generic proxy* (stores, stmatrix). A barrier orders the threads, not
the proxies: each writing thread must execute `fence.proxy.async.shared::cta` after its last write and
before the barrier that lets the elected thread issue the store (the CUDA Programming Guide's TMA
example; PTX ISA, "Proxies"). TileLang 0.1.15 emits the barrier and then one fence in the elected
thread only, so every kernel here calls `T.fence_proxy_async()` between writing such a tile and
storing it. Without it the store can read what the tile held before: the previous chunk's values, or
whatever an earlier kernel left in that shared memory, NaN included: results that change from call
to call, more often when several programs share an SM.

Barriers TileLang leaves out. TileLang places the barriers between a shared buffer's writes and another
thread's reads itself. A loop that runs on fewer threads than the program (`for r in T.Parallel(C)` at
C = 64 of 256 threads: beta's in-place sigmoid on a short chunk's rows, `r < rows` masking the rest)
gets a barrier of those threads only (`bar.sync 3, 64`), and TileLang 0.1.15 then counts it as the
whole block's: the next reads of what every thread had stored before it (the gates, read across threads
by the checks and the cumulative sum) went without a barrier. compute-sanitizer's racecheck found it in
the prepare that trains a packed batch (the gate made in front, beta's sigmoid in the kernel); on the GPU
the sum then read whatever that shared memory held before, from an earlier kernel: NaN gradients that
depended on what else ran on the GPU (docs/fla_backend.md). The prepare calls `T.sync_threads()` after
the activation; tests/stages/test_prepare_barriers.py reads that barrier from the generated source.
"""

import math
import types
from typing import NamedTuple

from stages.common.device_checks import BAD_BETA, BAD_GATE, bad_beta, bad_gate
from stages.common.tilelang_tools import LOG2_E
from stages.kda.config import SUB_BLOCK
from stages.kda.inputs import L2_NORM_EPS, SOFTPLUS_THRESHOLD, InputForm
from stages.s05_fast_kda.numerics import FAST_SPAN_LOG


def prepare_buffers_macro(C, d_k, d_v, channels_per_pass, dtype, diagonal_dtype, slab_dtype):
    """The macro prepare_buffers(): the prepare kernel's buffers for one chunk of C tokens, as a
    namespace (the dense and the packed prepare declare them once, here). Shared: the loads Q_s, K_s
    (C, d_k) in `dtype`, gamma_s (C, d_k) and beta_s (C,) fp32; the score GEMMs' operands
    (anchored_scores: decay from the anchor to the row, and from the column to the anchor) of
    channels_per_pass channels in diagonal_dtype and slab_dtype; L_s, T_s (C, C), T_diag_s (C, SUB_BLOCK)
    and merge_s (SUB_BLOCK, C) fp32 for the solve; A_hat_s (C, C), whose bytes A_qk_s shares; V_s, Kg_s,
    W_s, U_s. Registers: the GEMMs' fp32 accumulators."""
    import tilelang.language as T

    sub = SUB_BLOCK
    accum_dtype = "float32"

    @T.macro
    def prepare_buffers():
        Q_s = T.alloc_shared((C, d_k), dtype)
        K_s = T.alloc_shared((C, d_k), dtype)
        gamma_s = T.alloc_shared((C, d_k), accum_dtype)
        beta_s = T.alloc_shared((C,), accum_dtype)
        Q_row_s = T.alloc_shared((C, channels_per_pass), diagonal_dtype)
        K_row_s = T.alloc_shared((C, channels_per_pass), diagonal_dtype)
        K_col_s = T.alloc_shared((C, channels_per_pass), diagonal_dtype)
        Q_slab_s = T.alloc_shared((C, channels_per_pass), slab_dtype)
        K_slab_row_s = T.alloc_shared((C, channels_per_pass), slab_dtype)
        K_slab_col_s = T.alloc_shared((sub, channels_per_pass), slab_dtype)
        L_s = T.alloc_shared((C, C), accum_dtype)  # L = beta_i A_kk, strictly lower
        T_s = T.alloc_shared((C, C), accum_dtype)  # (I + L)^{-1}
        T_diag_s = T.alloc_shared((C, sub), accum_dtype)  # the diagonal blocks T[P, P], stacked
        merge_s = T.alloc_shared((sub, C), accum_dtype)  # L[P, :] T of one block row
        A_hat_s = T.alloc_shared((C, C), dtype)  # diag(beta) T
        # A_qk is staged in A_hat's bytes and copied out before A_hat is formed
        A_qk_s = A_hat_s
        V_s = T.alloc_shared((C, d_v), dtype)
        Kg_s = T.alloc_shared((C, d_k), dtype)  # K e^gamma (TileLang gives it the dead operands' bytes)
        W_s = T.alloc_shared((C, d_k), dtype)  # W and U staged for whole-row stores to HBM
        U_s = T.alloc_shared((C, d_v), dtype)

        kk_f = T.alloc_fragment((C, C), accum_dtype)
        qk_f = T.alloc_fragment((C, C), accum_dtype)
        kk_slab_f = T.alloc_fragment((C, sub), accum_dtype)
        qk_slab_f = T.alloc_fragment((C, sub), accum_dtype)
        w_f = T.alloc_fragment((C, d_k), accum_dtype)
        u_f = T.alloc_fragment((C, d_v), accum_dtype)
        block_row_f = T.alloc_fragment((sub, C), accum_dtype)
        return types.SimpleNamespace(
            Q_s=Q_s, K_s=K_s, gamma_s=gamma_s, beta_s=beta_s, Q_row_s=Q_row_s, K_row_s=K_row_s, K_col_s=K_col_s,
            Q_slab_s=Q_slab_s, K_slab_row_s=K_slab_row_s, K_slab_col_s=K_slab_col_s, L_s=L_s, T_s=T_s,
            T_diag_s=T_diag_s, merge_s=merge_s, A_hat_s=A_hat_s, A_qk_s=A_qk_s, V_s=V_s, Kg_s=Kg_s, W_s=W_s,
            U_s=U_s, kk_f=kk_f, qk_f=qk_f, kk_slab_f=kk_slab_f, qk_slab_f=qk_slab_f, w_f=w_f, u_f=u_f,
            block_row_f=block_row_f)

    return prepare_buffers


# --8<-- [start:activate_loads]
def scaled(X_s, factor, r, d):
    """X_s[r, d] times row r's factor, as an expression inside a kernel: factor None (no factor), a
    number (every row's), or a (C,) buffer (row r's: the q/k norms of activate_loads)."""
    if factor is None:
        return X_s[r, d]
    if isinstance(factor, (int, float)):
        return X_s[r, d] * factor
    return X_s[r, d] * factor[r]


def softplus(x):
    """log(1 + e^x) as an expression inside a kernel, in base 2, and x itself above SOFTPLUS_THRESHOLD
    (torch's and FLA's threshold: there the two agree to fp32's precision)."""
    import tilelang.language as T

    return T.if_then_else(x > SOFTPLUS_THRESHOLD, x, T.log2(1 + T.exp2(x * LOG2_E)) / LOG2_E)


def scaled_sigmoid(bound, x, rate=None):
    """bound * sigmoid(rate x) = bound / (1 + e^{-rate x}) as an expression inside a kernel, in base 2
    (rate None: 1): the bounded gate (bound = lower_bound), beta's sigmoid (bound 1 or 2)."""
    import tilelang.language as T

    return bound / (1 + T.exp2((-x if rate is None else -rate * x) * LOG2_E))


def row_factor(factor, r):
    """Row (or column) r's factor itself (`scaled`'s factor, or the scores' betas): 1 for None, the
    number, or the buffer's entry r."""
    if factor is None:
        return 1
    return factor if isinstance(factor, (int, float)) else factor[r]


def activate_loads_macro(C, d_k, form: InputForm):
    """The macro activate(s, A_log, Dt_bias, h, rows) -> (q_factor, k_factor): a chunk's q, k,
    gate and beta as the caller passed them, loaded into s.Q_s, s.K_s (C, d_k), s.gamma_s (C, d_k) fp32
    and s.beta_s (C,) fp32, made the recurrence's own, as stages.kda.inputs.activate defines them for
    `form`:

        q, k  <- x / sqrt(||x||^2 + eps) over d_k (form.l2_normalize), then q <- form.scale q
        g     <- -exp(A_log[h]) softplus(x + Dt_bias[h])            (form.gate "softplus")
                 lower_bound sigmoid(exp(A_log[h]) (x + Dt_bias[h]))  (form.gate "sigmoid")
        beta  <- sigmoid(beta), or 2 sigmoid(beta)                   (form.beta)

    g and beta in place. q and k stay as loaded: their rows' factors are returned instead, (C,) fp32
    buffers of 1 / sqrt(||x||^2 + eps) (q's times the scale), or the scale alone, or None, for the
    kernel to fold into the operands it forms from q and k (`scaled`): the normalized q and k are then
    rounded once, in those operands, not first into Q_s and K_s as well.

    A_log (H,) and Dt_bias (H, d_k) are fp32 (zeros where the caller gave none: exp(0) = 1 and x + 0 = x
    are exact). rows: the chunk's tokens, None for a whole chunk; the rows past them were loaded as
    zeros, and a zero raw gate or beta logit is not a zero gate or beta, so they are set to g = 0 and
    beta = 0 again: a zero token, which leaves the state and every earlier row as they were.
    Each pass is one T.Parallel over the chunk on chip: the inputs are read from HBM once, as loaded."""
    import tilelang.language as T

    accum_dtype = "float32"

    @T.macro
    def inverse_norms(X_s, factor):
        # factor / sqrt(||x||^2 + eps) for every row, the squares summed in fp32 registers
        x_f = T.alloc_fragment((C, d_k), accum_dtype)
        norm_f = T.alloc_fragment((C,), accum_dtype)
        factor_s = T.alloc_shared((C,), accum_dtype)
        T.copy(X_s, x_f)
        for r, d in T.Parallel(C, d_k):
            x_f[r, d] = x_f[r, d] * x_f[r, d]
        T.reduce_sum(x_f, norm_f, dim=1)
        for r in T.Parallel(C):
            factor_s[r] = factor * T.rsqrt(norm_f[r] + L2_NORM_EPS)
        return factor_s

    @T.macro
    def row_factors(s):
        # q's and k's row factors (see above), from the rows as loaded
        if form.l2_normalize:
            q_factor = inverse_norms(s.Q_s, form.scale)
            k_factor = inverse_norms(s.K_s, 1.0)
        else:
            q_factor = None if form.scale == 1.0 else form.scale
            k_factor = None
        return q_factor, k_factor

    @T.macro
    def gate_and_beta(s, A_log, Dt_bias, h, rows):
        if form.raw_gate:
            # the head's parameters read once a chunk: dt_bias's channels on chip, exp(A_log) in a register
            bias_s = T.alloc_shared((d_k,), accum_dtype)
            for d in T.Parallel(d_k):
                bias_s[d] = Dt_bias[h, d]
            rate = T.exp2(A_log[h] * LOG2_E)
            for r, d in T.Parallel(C, d_k):
                x = s.gamma_s[r, d] + bias_s[d]
                if form.gate == "softplus":
                    gate = -rate * softplus(x)
                else:
                    gate = scaled_sigmoid(form.lower_bound, x, rate)
                s.gamma_s[r, d] = gate if rows is None else T.if_then_else(r < rows, gate, 0)
        if form.beta != "value":
            for r in T.Parallel(C):
                beta = scaled_sigmoid(form.beta_bound, s.beta_s[r])
                s.beta_s[r] = beta if rows is None else T.if_then_else(r < rows, beta, 0)

    @T.macro
    def activate(s, A_log, Dt_bias, h, rows):
        gate_and_beta(s, A_log, Dt_bias, h, rows)
        return row_factors(s)

    return activate
# --8<-- [end:activate_loads]


# --8<-- [start:value_flags]
def flag_bad_values_macro(C, d_k, beta_bound=1):
    """The macro flag_bad_values(gamma_s, beta_s, Flags): a chunk's log gates (C, d_k) and betas (C,)
    fp32 in shared memory, as loaded (before cumulative_gates), checked on the device: a g that is
    not finite and <= 0 sets Flags[BAD_GATE], a beta outside [0, beta_bound] or NaN Flags[BAD_BETA]
    (stages.common.device_checks). Rows past a sequence's end are loaded as zeros, good values, so
    padding never sets a flag. Nothing is written but a 1 into Flags, and only by a bad value."""
    import tilelang.language as T

    @T.macro
    def flag_bad_values(gamma_s, beta_s, Flags):
        for r, d in T.Parallel(C, d_k):
            if bad_gate(gamma_s[r, d]):  # every lane that finds one writes the same 1
                Flags[BAD_GATE] = 1
        for r in T.Parallel(C):
            if bad_beta(beta_s[r], beta_bound):
                Flags[BAD_BETA] = 1

    return flag_bad_values
# --8<-- [end:value_flags]


# --8<-- [start:prepare_gates]
def cumulative_gates_macro(C, d_k):
    """The macro cumulative_gates(gamma_s): the log gates of a chunk (C, d_k) fp32 in shared memory
    become their cumulative sums from the chunk start, gamma[r] = g[0] + ... + g[r], in place."""
    import tilelang.language as T

    @T.macro
    def cumulative_gates(gamma_s):
        # one thread per channel walks the rows in a register (T.cumsum lowers to one warp per
        # column, whose strided reads all hit one smem bank)
        for d in T.Parallel(d_k):
            running = T.alloc_var("float32")
            running = 0
            for r in T.unroll(C):
                running += gamma_s[r, d]
                gamma_s[r, d] = running

    return cumulative_gates
# --8<-- [end:prepare_gates]


# --8<-- [start:prepare_scores]
def anchored_scores_macro(C, channel_passes, channels_per_pass, diagonal_dtype):
    """The macro anchored_scores(...): from a chunk's Q_s, K_s (C, d_k), gamma_s (cumulative) and
    beta_s (None: unit betas, L = A_kk itself), L = A_kk diag(beta) (strictly lower) into L_s and A_qk
    (lower, with its diagonal) into
    A_qk_s, q's and k's rows taken times q_factor and k_factor (`scaled`: None, a number, or a (C,)
    buffer of row factors; activate_loads's norms), through GEMMs of anchored operands (the row, column and slab buffers, of channels_per_pass
    channels, and their fp32 accumulators kk_f, qk_f (C, C), kk_slab_f, qk_slab_f (C, SUB_BLOCK)).

    Any gate: a diagonal sub-block whose gates span more than FAST_SPAN_LOG[diagonal_dtype] (its
    anchored factors would leave the operands' range) takes its block again term by term, in fp32
    (exact_diagonal_block); the others run the anchored GEMMs alone."""
    import tilelang.language as T

    sub = SUB_BLOCK
    d_k = channel_passes * channels_per_pass
    blocks = C // sub
    flag_wide_spans = flag_wide_spans_macro(C, d_k, FAST_SPAN_LOG[diagonal_dtype])
    exact_diagonal_block = exact_diagonal_block_macro(d_k)

    @T.macro
    def factors_on_block(L_s, A_qk_s, q_factor, k_factor, first):
        # a score is bilinear in its rows: the factors of q_r (or k_r) and of k_j multiply it whole
        for r, j in T.Parallel(sub, sub):
            row, col = first + r, first + j
            L_s[row, col] = L_s[row, col] * row_factor(k_factor, row) * row_factor(k_factor, col)
            A_qk_s[row, col] = A_qk_s[row, col] * row_factor(q_factor, row) * row_factor(k_factor, col)

    @T.macro
    def anchored_scores(Q_s, K_s, gamma_s, beta_s, Q_row_s, K_row_s, K_col_s, Q_slab_s, K_slab_row_s, K_slab_col_s,
                        kk_f, qk_f, kk_slab_f, qk_slab_f, L_s, A_qk_s, q_factor, k_factor):
        # a flag per sub-block in shared memory, so that every thread takes one branch below
        exact_s = T.alloc_shared((blocks,), "int32")
        flag_wide_spans(gamma_s, exact_s)

        # diagonal sub-blocks: rows and columns anchored at the middle row of their sub-block;
        # each element reads gamma and K once and takes one exp2 for each direction
        for channel_pass in range(channel_passes):
            d0 = channel_pass * channels_per_pass
            for r, d in T.Parallel(C, channels_per_pass):
                from_anchor = (gamma_s[r, d0 + d] - gamma_s[(r // sub) * sub + sub // 2, d0 + d]) * LOG2_E
                key = scaled(K_s, k_factor, r, d0 + d)
                to_row = T.exp2(from_anchor)
                Q_row_s[r, d] = scaled(Q_s, q_factor, r, d0 + d) * to_row
                K_row_s[r, d] = key * to_row
                K_col_s[r, d] = key * T.exp2(-from_anchor)
            T.gemm(K_row_s, K_col_s, kk_f, transpose_B=True, clear_accum=channel_pass == 0)
            T.gemm(Q_row_s, K_col_s, qk_f, transpose_B=True, clear_accum=channel_pass == 0)
        for r, j in T.Parallel(C, C):
            same_block = r // sub == j // sub
            L_s[r, j] = T.if_then_else(same_block and j < r, kk_f[r, j] * row_factor(beta_s, j), 0)
            if j // sub >= r // sub:  # the diagonal blocks and the zeros right of them; the slabs fill the rest
                A_qk_s[r, j] = T.if_then_else(j <= r, qk_f[r, j], 0)
        # the sub-blocks out of the operands' range (their GEMM entries above may be inf or NaN, kept
        # to their own block by the mask) again, term by term: a uniform branch, so the chunks in range
        # run one test per sub-block and nothing else
        for blk in T.serial(blocks):
            if exact_s[blk] == 1:
                exact_diagonal_block(Q_s, K_s, gamma_s, beta_s, L_s, A_qk_s, blk * sub)
                if q_factor is not None or k_factor is not None:  # on the rows as loaded: their factors now
                    factors_on_block(L_s, A_qk_s, q_factor, k_factor, blk * sub)

        # off-diagonal: one slab of sub columns at a time, anchored at the first row below it;
        # rows above the slab keep stale operands: their GEMM rows are computed and never stored.
        # The slabs are unrolled when the program is built (a tuple, not a loop), so each pass has
        # a static extent and TileLang vectorizes it: one pass per slab writes the column operand
        # (the sub rows above s0) and the row operands (rows s0 on)
        for s0 in tuple(range(sub, C, sub)):
            for channel_pass in range(channel_passes):
                d0 = channel_pass * channels_per_pass
                for r, d in T.Parallel(C - s0 + sub, channels_per_pass):
                    row = s0 - sub + r
                    from_anchor = (gamma_s[row, d0 + d] - gamma_s[s0, d0 + d]) * LOG2_E
                    key = scaled(K_s, k_factor, row, d0 + d)
                    if r >= sub:
                        to_row = T.exp2(from_anchor)  # <= 1
                        Q_slab_s[row, d] = scaled(Q_s, q_factor, row, d0 + d) * to_row
                        K_slab_row_s[row, d] = key * to_row
                    else:
                        K_slab_col_s[r, d] = key * T.exp2(-from_anchor)  # to the anchor: <= 1
                first = channel_pass == 0
                T.gemm(K_slab_row_s, K_slab_col_s, kk_slab_f, transpose_B=True, clear_accum=first)
                T.gemm(Q_slab_s, K_slab_col_s, qk_slab_f, transpose_B=True, clear_accum=first)
            for r, j in T.Parallel(C, sub):
                if r >= s0:
                    L_s[r, s0 - sub + j] = kk_slab_f[r, j] * row_factor(beta_s, s0 - sub + j)
                    A_qk_s[r, s0 - sub + j] = qk_slab_f[r, j]

    return anchored_scores
# --8<-- [end:prepare_scores]


# --8<-- [start:wide_spans]
def flag_wide_spans_macro(C, d_k, largest_span):
    """The macro flag_wide_spans(gamma_s, exact_s): from a chunk's cumulative gates gamma_s (C, d_k)
    fp32, exact_s[P] = 1 (int32, one per SUB_BLOCK-row sub-block) where the diagonal sub-block P's
    middle-row anchored factors span more than largest_span e-folds in some channel, else 0.

    A sub-block's largest anchored factor is e^span, span the larger of gamma_first - gamma_middle
    (its first row's) and gamma_middle - gamma_last (its last column's): every other row's and
    column's lies between them. Stage 5's scores and stage 6's intra kernel test the flags."""
    import tilelang.language as T

    sub = SUB_BLOCK
    blocks = C // sub

    @T.macro
    def flag_wide_spans(gamma_s, exact_s):
        for blk in T.Parallel(blocks):
            exact_s[blk] = 0
        for blk, d in T.Parallel(blocks, d_k):
            middle = gamma_s[blk * sub + sub // 2, d]
            span = T.max(gamma_s[blk * sub, d] - middle, middle - gamma_s[blk * sub + sub - 1, d])
            if span > largest_span:  # every lane that finds one writes the same 1
                exact_s[blk] = 1

    return flag_wide_spans
# --8<-- [end:wide_spans]


# --8<-- [start:prepare_exact_block]
def exact_diagonal_block_macro(d_k):
    """The macro exact_diagonal_block(Q_s, K_s, gamma_s, beta_s, L_s, A_qk_s, first): the diagonal
    sub-block of rows and columns first .. first + SUB_BLOCK - 1 of L = A_kk diag(beta) into L_s and
    of A_qk into A_qk_s, as their definition, A[r, j] = sum_d x_r[d] k_j[d] e^{gamma_r[d] - gamma_j[d]}
    (j <= r): each decay is taken whole, so it is <= 1 at any gate, and summed in fp32 on the CUDA
    cores (d_k multiply-adds per entry and score, one exp2 shared by the two scores)."""
    import tilelang.language as T

    sub = SUB_BLOCK

    @T.macro
    def exact_diagonal_block(Q_s, K_s, gamma_s, beta_s, L_s, A_qk_s, first):
        for r, j in T.Parallel(sub, sub):
            row, col = first + r, first + j
            key_score = T.alloc_var("float32")
            key_score = 0
            query_score = T.alloc_var("float32")
            query_score = 0
            for step in T.serial(d_k):
                # lane j starts at channel j: the 16 columns' rows of a warp then lie in different banks
                d = (step + j) % d_k
                # j <= r: gamma_r <= gamma_j and the decay is <= 1; above the diagonal (masked below)
                # the exponent is clamped at 0 so that nothing overflows there either
                decay = T.exp2(T.min(gamma_s[row, d] - gamma_s[col, d], 0) * LOG2_E)
                decayed_key = T.cast(K_s[col, d], "float32") * decay
                key_score += T.cast(K_s[row, d], "float32") * decayed_key
                query_score += T.cast(Q_s[row, d], "float32") * decayed_key
            L_s[row, col] = T.if_then_else(j < r, key_score * row_factor(beta_s, col), 0)
            A_qk_s[row, col] = T.if_then_else(j <= r, query_score, 0)

    return exact_diagonal_block
# --8<-- [end:prepare_exact_block]


# --8<-- [start:prepare_inverse]
def block_inverse_macro(C):
    """The macro block_inverse(L_s, T_s, T_diag_s, merge_s, block_row_f): T = (I + L)^{-1} into T_s
    (C, C) fp32 shared, for L (C, C) strictly lower in L_s, by SUB_BLOCK x SUB_BLOCK blocks. T_diag_s
    (C, SUB_BLOCK) gets the diagonal blocks stacked; merge_s (SUB_BLOCK, C) shared and block_row_f
    (SUB_BLOCK, C) fragment are room for one block row. Stages 5, 6 and 7 invert with it."""
    import tilelang.language as T

    sub = SUB_BLOCK

    @T.macro
    def block_inverse(L_s, T_s, T_diag_s, merge_s, block_row_f):
        # diagonal blocks of T = (I + L)^{-1}: forward substitution, one lane per (block, column), the
        # lane's column of its block in registers: the rows it solved are read back from them, not
        # from shared memory, so the 16 steps need no barrier between them
        T.clear(T_s)
        # every thread clears a part of T_s, and only C // SUB_BLOCK * SUB_BLOCK lanes solve: without a
        # barrier of the whole block, TileLang 0.1.15 syncs the solving lanes among themselves only, and
        # a late clear erased solved entries (compute-sanitizer's racecheck: write-read hazards in
        # kda_prepare; a bf16 forward 3x off when 6 processes shared the H200)
        T.sync_threads()
        for blk, col in T.Parallel(C // sub, sub):
            # T[blk * sub + r, blk * sub + col] for r < sub, one register each (the rows are unrolled
            # as the program is built, so that every index into the list is a number)
            column = [T.alloc_var("float32") for _ in range(sub)]
            for r in tuple(range(sub)):
                i = blk * sub + r
                column[r][0] = T.if_then_else(col == r, 1.0, 0.0)
                for j in tuple(range(r)):
                    column[r][0] -= L_s[i, blk * sub + j] * column[j][0]
                T_s[i, blk * sub + col] = column[r][0]
                T_diag_s[i, col] = column[r][0]
        # block row P from the rows above it: T[P, :P] = -T[P, P] (L[P, :P] T[:P, :P]), as two TF32
        # tensor-core GEMMs over all C columns (a GEMM's sizes must be static; P is a loop variable).
        # Only the columns left of P are kept: there L[P, :] T = L[P, :P] T[:P, :P], because block
        # row P of T_s is still zero left of its diagonal block when the first GEMM reads it
        for p0 in range(sub, C, sub):
            T.gemm(L_s[p0:p0 + sub, :], T_s, block_row_f, clear_accum=True)
            T.copy(block_row_f, merge_s)
            T.gemm(T_diag_s[p0:p0 + sub, :], merge_s, block_row_f, clear_accum=True)
            for r, c in T.Parallel(sub, C):
                if c < p0:
                    T_s[p0 + r, c] = -block_row_f[r, c]

    return block_inverse
# --8<-- [end:prepare_inverse]


# --8<-- [start:prepare_outputs]
def wy_outputs_macro(C):
    """The macro wy_outputs(...): W = diag(beta) T (K e^gamma) and U = diag(beta) T V from T_s, beta_s,
    Kg_s and V_s, staged in W_s and U_s (through the fp32 fragments w_f, u_f) for stores of whole rows."""
    import tilelang.language as T

    @T.macro
    def wy_outputs(T_s, beta_s, A_hat_s, Kg_s, V_s, w_f, u_f, W_s, U_s):
        for r, c in T.Parallel(C, C):
            A_hat_s[r, c] = T_s[r, c] * beta_s[r]  # diag(beta) T, after the inverse
        T.gemm(A_hat_s, Kg_s, w_f, clear_accum=True)
        T.gemm(A_hat_s, V_s, u_f, clear_accum=True)
        # through shared memory, then whole-row stores (TMA): the fragments' own stores are 4-byte
        # writes spread over 8 rows, about 8 L1 wavefronts per instruction
        T.copy(w_f, W_s)
        T.copy(u_f, U_s)

    return wy_outputs
# --8<-- [end:prepare_outputs]


# --8<-- [start:chunk_operands]
# what one chunk's tile holds of a tensor (B batch rows, N rows, H heads; C = chunk size):
KEY_ROWS = "key rows"  # (B, N, H, d_k) -> (C, d_k): W, Q e^gamma, K e^{gamma_C - gamma}
VALUE_BLOCK = "value block"  # (B, N, H, d_v) -> (C, block_dv), the program's d_v columns: U, dO
SCORE_ROWS = "score rows"  # (B, N, H, C) -> (C, C): A_qk
CHUNK_ROW = "chunk row"  # (B, N / C, H, d_k) fp32 -> (d_k,) fp32: e^{gamma_C}


class ChunkOperands(NamedTuple):
    """A chunk loop's operands: `declare()` gives their tiles, `load(...)` fills them with one chunk."""

    declare: object
    load: object


def chunk_operands_macro(C, d_k, block_dv, dtype, holds) -> ChunkOperands:
    """The tiles a chunk loop (the recurrence, the backward's states and state gradient) reads one
    chunk of its operands into, one tile per operand, each holding what `holds` names for it in the
    program's order (KEY_ROWS, VALUE_BLOCK, SCORE_ROWS or CHUNK_ROW: the shapes above, in `dtype`
    but the chunk row's fp32):

        declare() -> the tiles in shared memory, a tuple: each takes the name the program unpacks
            it into (W_s, U_s, ... = declare())
        load(tensors, tiles, b, h, v0, i_c, t0): chunk i_c (rows t0 .. t0 + C - 1) of each tensor of
            batch row b and head h into its tile (a value block: columns v0 .. v0 + block_dv - 1)
    """
    import tilelang.language as T

    accum_dtype = "float32"
    tile_shapes = {KEY_ROWS: ((C, d_k), dtype), VALUE_BLOCK: ((C, block_dv), dtype), SCORE_ROWS: ((C, C), dtype),
                   CHUNK_ROW: ((d_k,), accum_dtype)}

    @T.macro
    def declare():
        return tuple(T.alloc_shared(*tile_shapes[held]) for held in holds)

    @T.macro
    def load(tensors, tiles, b, h, v0, i_c, t0):
        # by position: a loop over the buffers themselves would rename each to the loop's variable
        for position in tuple(range(len(holds))):
            if holds[position] == CHUNK_ROW:
                T.copy(tensors[position][b, i_c, h, :], tiles[position])
            elif holds[position] == VALUE_BLOCK:
                T.copy(tensors[position][b, t0:t0 + C, h, v0:v0 + block_dv], tiles[position])
            else:
                T.copy(tensors[position][b, t0:t0 + C, h, :], tiles[position])

    return ChunkOperands(declare, load)
# --8<-- [end:chunk_operands]


# --8<-- [start:recurrence_chunk]
def chunk_output_macro(C, block_dv):
    """The macro chunk_output(...): one chunk's output from the state S^T (S_f, d_k x block_dv fp32) it
    starts from and the prepare kernel's operands in shared memory, into O_s (C, block_dv); V_new_s
    keeps the pseudo-values for the state's update (advance_state)."""
    import tilelang.language as T

    @T.macro
    def chunk_output(S_f, S_s, W_s, U_s, Q_decayed_s, A_qk_s, V_new_f, V_new_s, acc_o, O_s):
        # the pseudo-values V_new = U - W S^T (S^T cast to the input dtype first)
        T.copy(S_f, S_s)
        T.gemm(W_s, S_s, V_new_f, clear_accum=True)
        for r, j in T.Parallel(C, block_dv):
            V_new_f[r, j] = U_s[r, j] - V_new_f[r, j]
        T.copy(V_new_f, V_new_s)

        # inter-chunk term, then the intra-chunk term added into the same accumulator
        T.gemm(Q_decayed_s, S_s, acc_o, clear_accum=True)
        T.gemm(A_qk_s, V_new_s, acc_o)
        T.copy(acc_o, O_s)

    return chunk_output


def advance_state_macro(d_k, block_dv):
    """The macro advance_state(S_f, chunk_decay_s, K_to_chunk_end_s, V_new_s): the state past one
    chunk, S^T <- Diag(e^{gamma_C}) S^T + (K e^{gamma_C - gamma})^T V_new, once the chunk's output is
    out (stages 5, 6 and 7)."""
    import tilelang.language as T

    @T.macro
    def advance_state(S_f, chunk_decay_s, K_to_chunk_end_s, V_new_s):
        # only now does the state move past this chunk: decay row by row, then the GEMM
        for d, j in T.Parallel(d_k, block_dv):
            S_f[d, j] *= chunk_decay_s[d]
        T.gemm(K_to_chunk_end_s, V_new_s, S_f, transpose_A=True)

    return advance_state
# --8<-- [end:recurrence_chunk]


def wait_for_tensor_cores_macro(threads, issued_together):
    """The macro wait_for_tensor_cores(*accumulators): wait for every GEMM issued with T.wgmma_gemm
    (no wait of its own), then fence their accumulator fragments, so that no read of them is
    scheduled before the wait. The fence names each thread's registers of a fragment: its elements
    over the program's `threads` (left to itself, TileLang 0.1.15 fences as many as the whole tile).
    issued_together=False (the GEMMs were T.gemm, each waited for): nothing."""
    import tilelang.language as T

    @T.macro
    def wait_for_tensor_cores(*accumulators):
        if issued_together:
            T.wait_wgmma(0)
            # by position: a loop over the buffers themselves would rename each to the loop's variable
            for position in tuple(range(len(accumulators))):
                T.warpgroup_fence_operand(accumulators[position],
                                          num_regs=math.prod(accumulators[position].shape) // threads)

    return wait_for_tensor_cores


# --8<-- [start:intra_exact_block]
def exact_diagonal_gradients_macro(channels):
    """The macro exact_diagonal_gradients(Q_s, K_s, gamma_s, dA_qk_T_s, dM_T_s, d0, dQ_scores_s, dK_scores_s,
    dgamma_s, first): the score gradients of the diagonal sub-block of rows and columns
    first .. first + SUB_BLOCK - 1, for the channel pass d0 .. d0 + channels - 1, as reference C's
    score_gradients defines them, each decay e^{gamma_c - gamma_i} (i <= c) taken whole, so <= 1 at
    any gate, and summed in fp32 on the CUDA cores:
        dQ_scores[c]  = sum_i dA_qk[c, i] k_i e^{gamma_c - gamma_i},   dK_rows[c] = sum_i dM[c, i] (the same)
        dK_columns[i] = sum_c (dM[c, i] k_c + dA_qk[c, i] q_c) e^{gamma_c - gamma_i}
        dK_scores     = dK_rows + dK_columns,   dgamma = q ⊙ dQ_scores + k ⊙ (dK_rows - dK_columns)
    Q_s, K_s, gamma_s: (C, d_k); dA_qk_T_s, dM_T_s (C, C): the transposes, read whole (their zeros
    below the diagonal keep each sum to i <= c); the three (C, channels) outputs' rows of the
    sub-block are written over, and the slabs add to them after."""
    import tilelang.language as T

    sub = SUB_BLOCK

    @T.macro
    def exact_diagonal_gradients(Q_s, K_s, gamma_s, dA_qk_T_s, dM_T_s, d0, dQ_scores_s, dK_scores_s, dgamma_s,
                                 first):
        for r, d in T.Parallel(sub, channels):
            row = first + r
            query_row = T.alloc_var("float32")  # dQ_scores[row]
            key_row = T.alloc_var("float32")  # dK_rows[row]
            key_column = T.alloc_var("float32")  # dK_columns[row]
            query_row = 0
            key_row = 0
            key_column = 0
            for j in T.serial(sub):
                other = first + j
                # e^{-|gamma_row - gamma_other|}: the decay from the earlier token to the later, <= 1
                decay = T.exp2(-T.abs(gamma_s[row, d0 + d] - gamma_s[other, d0 + d]) * LOG2_E)
                key = T.cast(K_s[other, d0 + d], "float32") * decay
                # row as the later token (other <= row): dA_qk[row, other] = dA_qk_T[other, row], zero
                # past row, and dM[row, other] likewise; as the earlier token (other >= row) ...
                query_row += dA_qk_T_s[other, row] * key
                key_row += dM_T_s[other, row] * key
                # ... dM[other, row] = dM_T[row, other] and dA_qk[other, row] = dA_qk_T[row, other]
                key_column += dM_T_s[row, other] * key + dA_qk_T_s[row, other] * T.cast(Q_s[other, d0 + d],
                                                                                        "float32") * decay
            dQ_scores_s[row, d] = query_row
            dK_scores_s[row, d] = key_row + key_column
            dgamma_s[row, d] = (T.cast(Q_s[row, d0 + d], "float32") * query_row
                                + T.cast(K_s[row, d0 + d], "float32") * (key_row - key_column))

    return exact_diagonal_gradients
# --8<-- [end:intra_exact_block]
