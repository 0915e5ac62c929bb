"""The backward's kernels, split as the forward is. The backward needs the state S^T at every chunk
start, in reverse order; it recomputes them (as FLA's chunk_kda does: `states`), so a training step
keeps no more activations than the forward's inputs. In launch order (C = chunk_size, per chunk gamma =
cumsum of the log gates from the chunk start), after the forward's prepare with solve_outputs (W, U,
Q e^gamma, K e^{gamma_C - gamma}, A_qk, e^{gamma_C}, and the A_kk and T = (I + L)^{-1} it formed):

states: one program per (block of d_v columns, batch x head), the recurrence without the output:
writes S^T at every chunk start and V_new = U - W S^T.

state_gradient: one program per (block of d_v columns, batch x head), the reverse chunk loop, dS^T
(d_k x block_dv) in registers from dS_N^T back to dS_0^T. Per chunk, dS'^T the gradient of the
state the chunk ends with, written before it moves on:
    dV_new = (K e^{gamma_C - gamma}) dS'^T + A_qk^T dO
    dS^T   = Diag(e^{gamma_C}) dS'^T + (Q e^gamma)^T dO - W^T dV_new

state_products: one program per (chunk, batch x head), every product that sums over d_v:
    d(Q e^gamma) = dO S,   d(K e^{gamma_C - gamma}) = V_new dS',   dW = -dV_new S,
    d gamma_C += e^{gamma_C} rowsum(S^T ⊙ dS'^T)          (fp32 outputs)

intra: one program per (chunk, batch x head), the chunk's own gradients, from the prepare's A_kk
and T:
    dA_hat = dW (K e^gamma)^T + dV_new V^T,   dV = A_hat^T dV_new,   d(K e^gamma) = A_hat^T dW,
    dbeta  = rowsum(dA_hat ⊙ T) + colsum(dL ⊙ A_kk),   dL^T = -T (dA_hat^T A_hat) (strict upper),
    dA_qk^T = V_new dO^T, and dM^T = diag(beta) dL^T through the scores with the forward's anchors,
    dg = reverse cumulative sum of dgamma.
Any gate, as in the forward: a diagonal sub-block whose anchored factors would leave the operands'
range (FAST_SPAN_LOG) is flagged on the device, and its score gradients are taken by their definition,
every decay <= 1 (exact_diagonal_gradients_macro); the prepare took its A_kk so.

Reference C (`stages.s06_backward.reference.kernel_mirror_backward`) runs the same steps in NumPy.
"""

import functools

from stages.common.tilelang_tools import LOG2_E
from stages.kda.config import (CHANNEL_PASSES, DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE, SUB_BLOCK, default_intra_threads,
                               state_products_value_block)
from stages.kda.prepare import build_prepare_program, prepare_outputs
from stages.kda.tensor_types import tensor_types
from stages.kda.tiles import (CHUNK_ROW, KEY_ROWS, SCORE_ROWS, VALUE_BLOCK, advance_state_macro, chunk_operands_macro,
                              cumulative_gates_macro, exact_diagonal_gradients_macro,
                              flag_wide_spans_macro, wait_for_tensor_cores_macro)
from stages.s05_fast_kda.numerics import FAST_SPAN_LOG


# --8<-- [start:states_program]
def build_states_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=DEFAULT_BLOCK_DV,
                         dtype="float16", num_stages=2, threads=128):
    """The states kernel: W (B, N, H, d_k), U (B, N, H, d_v), K e^{gamma_C - gamma} (B, N, H, d_k) in
    `dtype`, e^{gamma_C} (B, N / C, H, d_k) and S_0^T (B, H, d_k, d_v) in fp32 -> S^T at every chunk
    start (B, N / C, H, d_k, d_v) and V_new (B, N, H, d_v), both in `dtype`.

    N must be a multiple of chunk_size, block_dv must divide d_v.
    """
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    num_chunks = N // C
    tensors = tensor_types(B, N, H, d_k, d_v, C, dtype)
    # W, U, K e^{gamma_C - gamma} and e^{gamma_C}: one chunk of each in shared memory
    operands = chunk_operands_macro(C, d_k, block_dv, dtype, (KEY_ROWS, VALUE_BLOCK, KEY_ROWS, CHUNK_ROW))
    advance_state = advance_state_macro(d_k, block_dv)

    @T.prim_func
    def kda_states(
        W: tensors.key_rows,
        U: tensors.value_rows,
        K_to_chunk_end: tensors.key_rows,
        Chunk_decay: tensors.chunk_rows_fp32,
        Initial_state: tensors.states,
        States: tensors.chunk_states,
        V_new: tensors.value_rows,
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv

            W_s, U_s, K_to_chunk_end_s, chunk_decay_s = operands.declare()
            S_s = T.alloc_shared((d_k, block_dv), dtype)  # the state as a GEMM operand, and as stored
            V_new_s = T.alloc_shared((C, block_dv), dtype)

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)
            V_new_f = T.alloc_fragment((C, block_dv), accum_dtype)

            T.copy(Initial_state[b, h, :, v0:v0 + block_dv], S_f)
            for i_c in T.Pipelined(num_chunks, num_stages=num_stages):
                t0 = i_c * C
                operands.load((W, U, K_to_chunk_end, Chunk_decay), (W_s, U_s, K_to_chunk_end_s, chunk_decay_s),
                              b, h, v0, i_c, t0)

                T.copy(S_f, S_s)
                T.fence_proxy_async()  # S_s seen by the TMA store (tiles.py: "TMA stores")
                T.copy(S_s, States[b, i_c, h, :, v0:v0 + block_dv])  # the state this chunk starts from
                T.gemm(W_s, S_s, V_new_f, clear_accum=True)
                for r, j in T.Parallel(C, block_dv):
                    V_new_s[r, j] = U_s[r, j] - V_new_f[r, j]
                T.fence_proxy_async()  # V_new_s seen by the TMA store (tiles.py: "TMA stores")
                T.copy(V_new_s, V_new[b, t0:t0 + C, h, v0:v0 + block_dv])

                advance_state(S_f, chunk_decay_s, K_to_chunk_end_s, V_new_s)

    return kda_states
# --8<-- [end:states_program]


# --8<-- [start:state_gradient_program]
def build_state_gradient_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=DEFAULT_BLOCK_DV,
                                 dtype="float16", num_stages=2, threads=128):
    """The reverse chunk loop: Q e^gamma, K e^{gamma_C - gamma}, W (B, N, H, d_k), A_qk (B, N, H, C),
    dO (B, N, H, d_v) in `dtype`, e^{gamma_C} (B, N / C, H, d_k) and dS_N^T (B, H, d_k, d_v) in fp32
    -> dS^T at every chunk end (B, N / C, H, d_k, d_v) and dV_new (B, N, H, d_v) in `dtype`, and
    dS_0^T (B, H, d_k, d_v) in fp32.
    """
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    num_chunks = N // C
    tensors = tensor_types(B, N, H, d_k, d_v, C, dtype)
    # Q e^gamma, K e^{gamma_C - gamma}, W, A_qk, e^{gamma_C} and dO: one chunk of each in shared memory
    operands = chunk_operands_macro(C, d_k, block_dv, dtype,
                                    (KEY_ROWS, KEY_ROWS, KEY_ROWS, SCORE_ROWS, CHUNK_ROW, VALUE_BLOCK))

    @T.prim_func
    def kda_state_gradient(
        Q_decayed: tensors.key_rows,
        K_to_chunk_end: tensors.key_rows,
        W: tensors.key_rows,
        A_qk: tensors.score_rows,
        Chunk_decay: tensors.chunk_rows_fp32,
        dO: tensors.value_rows,
        D_final_state: tensors.states,
        D_states: tensors.chunk_states,
        dV_new: tensors.value_rows,
        D_initial_state: tensors.states,
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv

            Q_decayed_s, K_to_chunk_end_s, W_s, A_qk_s, chunk_decay_s, dO_s = operands.declare()
            dS_s = T.alloc_shared((d_k, block_dv), dtype)  # dS'^T as a GEMM operand, and as stored
            dV_new_s = T.alloc_shared((C, block_dv), dtype)
            minus_dV_new_s = T.alloc_shared((C, block_dv), dtype)  # the GEMM adds: -W^T dV_new

            dS_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state's gradient: lives across chunks
            dV_new_f = T.alloc_fragment((C, block_dv), accum_dtype)

            T.copy(D_final_state[b, h, :, v0:v0 + block_dv], dS_f)
            for step in T.Pipelined(num_chunks, num_stages=num_stages):
                i_c = num_chunks - 1 - step  # the last chunk first
                t0 = i_c * C
                operands.load((Q_decayed, K_to_chunk_end, W, A_qk, Chunk_decay, dO),
                              (Q_decayed_s, K_to_chunk_end_s, W_s, A_qk_s, chunk_decay_s, dO_s), b, h, v0, i_c, t0)

                T.copy(dS_f, dS_s)
                T.fence_proxy_async()  # dS_s seen by the TMA store (tiles.py: "TMA stores")
                T.copy(dS_s, D_states[b, i_c, h, :, v0:v0 + block_dv])  # the gradient this chunk ends with
                # through the state update, then through the output
                T.gemm(K_to_chunk_end_s, dS_s, dV_new_f, clear_accum=True)
                T.gemm(A_qk_s, dO_s, dV_new_f, transpose_A=True)
                for r, j in T.Parallel(C, block_dv):
                    dV_new_s[r, j] = dV_new_f[r, j]
                    minus_dV_new_s[r, j] = -dV_new_f[r, j]
                T.fence_proxy_async()  # dV_new_s seen by the TMA store (tiles.py: "TMA stores")
                T.copy(dV_new_s, dV_new[b, t0:t0 + C, h, v0:v0 + block_dv])

                # back past the chunk: the decay row by row, the output's read of S, V_new's read of S
                for d, j in T.Parallel(d_k, block_dv):
                    dS_f[d, j] *= chunk_decay_s[d]
                T.gemm(Q_decayed_s, dO_s, dS_f, transpose_A=True)
                T.gemm(W_s, minus_dV_new_s, dS_f, transpose_A=True)
            T.copy(dS_f, D_initial_state[b, h, :, v0:v0 + block_dv])

    return kda_state_gradient
# --8<-- [end:state_gradient_program]


# --8<-- [start:state_products_program]
def build_state_products_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=256):
    """The products through the states: S^T (chunk starts), dS^T (chunk ends) (B, N / C, H, d_k, d_v),
    V_new, dV_new, dO (B, N, H, d_v) in `dtype`, e^{gamma_C} (B, N / C, H, d_k) fp32 -> d(Q e^gamma),
    d(K e^{gamma_C - gamma}), dW (B, N, H, d_k) and d gamma_C (B, N / C, H, d_k), all fp32.

    Every product sums over d_v, so a program walks d_v in blocks of state_products_value_block(d_k,
    d_v) columns, the GEMMs adding each block's terms into the same accumulators: one block up to
    d_k = d_v = 128; four of 64 at 256, where S^T and dS^T whole would take 2 x 128 KiB.
    """
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    num_chunks = N // C
    tensors = tensor_types(B, N, H, d_k, d_v, C, dtype)
    value_block = state_products_value_block(d_k, d_v)
    value_starts = tuple(range(0, d_v, value_block))  # a tuple: the parser unrolls it in Python

    @T.prim_func
    def kda_state_products(
        States: tensors.chunk_states,
        D_states: tensors.chunk_states,
        V_new: tensors.value_rows,
        dV_new: tensors.value_rows,
        dO: tensors.value_rows,
        Chunk_decay: tensors.chunk_rows_fp32,
        dQ_decayed: tensors.key_rows_fp32,
        dK_to_chunk_end: tensors.key_rows_fp32,
        dW: tensors.key_rows_fp32,
        D_gamma_last: tensors.chunk_rows_fp32,
    ):
        with T.Kernel(num_chunks, B * H, threads=threads) as (i_c, i_bh):
            b, h = i_bh // H, i_bh % H
            t0 = i_c * C

            S_s = T.alloc_shared((d_k, value_block), dtype)
            dS_s = T.alloc_shared((d_k, value_block), dtype)
            V_new_s = T.alloc_shared((C, value_block), dtype)
            dV_new_s = T.alloc_shared((C, value_block), dtype)
            dO_s = T.alloc_shared((C, value_block), dtype)

            dq_f = T.alloc_fragment((C, d_k), accum_dtype)
            dk_f = T.alloc_fragment((C, d_k), accum_dtype)
            dw_f = T.alloc_fragment((C, d_k), accum_dtype)

            for v0 in value_starts:  # unrolled: one block of columns after another
                first, last = v0 == 0, v0 + value_block == d_v
                T.copy(States[b, i_c, h, :, v0:v0 + value_block], S_s)
                T.copy(D_states[b, i_c, h, :, v0:v0 + value_block], dS_s)
                T.copy(V_new[b, t0:t0 + C, h, v0:v0 + value_block], V_new_s)
                T.copy(dV_new[b, t0:t0 + C, h, v0:v0 + value_block], dV_new_s)
                T.copy(dO[b, t0:t0 + C, h, v0:v0 + value_block], dO_s)

                T.gemm(dO_s, S_s, dq_f, transpose_B=True, clear_accum=first)  # dO S: S^T is stored
                T.gemm(V_new_s, dS_s, dk_f, transpose_B=True, clear_accum=first)
                T.gemm(dV_new_s, S_s, dw_f, transpose_B=True, clear_accum=first)
                if last:
                    T.copy(dq_f, dQ_decayed[b, t0:t0 + C, h, :])
                    T.copy(dk_f, dK_to_chunk_end[b, t0:t0 + C, h, :])
                    for r, d in T.Parallel(C, d_k):
                        dW[b, t0 + r, h, d] = -dw_f[r, d]

                # rowsum(S^T ⊙ dS'^T) over the block's columns: one lane per row walks them; lane d starts
                # at column d, so that the lanes of a warp read 32 different shared-memory banks at every
                # step. The blocks after the first add to what the first wrote (the same thread's row,
                # past the barrier before the next block's loads)
                for d in T.Parallel(d_k):
                    row_dot = T.alloc_var(accum_dtype)
                    row_dot = 0
                    for j in T.serial(value_block):
                        column = (j + d) % value_block
                        row_dot += T.cast(S_s[d, column], accum_dtype) * T.cast(dS_s[d, column], accum_dtype)
                    if first:
                        D_gamma_last[b, i_c, h, d] = Chunk_decay[b, i_c, h, d] * row_dot
                    else:
                        D_gamma_last[b, i_c, h, d] += Chunk_decay[b, i_c, h, d] * row_dot

    return kda_state_products
# --8<-- [end:state_products_program]


# --8<-- [start:intra_setup]
def build_intra_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
                        channel_passes=CHANNEL_PASSES):
    """The chunk's own gradients: q, k (B, N, H, d_k), v, dO, V_new, dV_new (B, N, H, d_v) in `dtype`;
    g (B, N, H, d_k), beta (B, N, H), A_kk and T (B, N, H, C) as the prepare kernel wrote them
    (solve_outputs), d(Q e^gamma), d(K e^{gamma_C - gamma}), dW (B, N, H, d_k) and
    d gamma_C (B, N / C, H, d_k) in fp32 -> dv (B, N, H, d_v) in `dtype`, dq, dk, dg (B, N, H, d_k)
    and dbeta (B, N, H) in fp32 (dq and dk unrounded for what the caller does in front of the kernels:
    the L2 norm's backward, FLA's scale).

    The score gradients' GEMMs (through A_kk and A_qk) work on d_k / channel_passes channels at a
    time, as stage 5's prepare kernel's score GEMMs do. threads=None takes
    default_intra_threads(chunk_size, d_k, channel_passes). Any gate <= 0: the diagonal sub-blocks
    whose gates span more than FAST_SPAN_LOG allows (the diagonal operands are in the input dtype,
    their factors computed in fp32) are taken by their definition instead of the anchored GEMMs.
    """
    import tilelang.language as T

    threads = threads or default_intra_threads(chunk_size, d_k, channel_passes)
    C, sub = chunk_size, SUB_BLOCK
    accum_dtype = "float32"
    num_chunks = N // C
    tensors = tensor_types(B, N, H, d_k, d_v, C, dtype)
    channels = d_k // channel_passes
    blocks = C // sub
    # the span the anchored factors may take: they are computed in fp32 (from gamma) and stored in
    # `dtype`, so both types must hold them (a float64 program keeps fp32's span)
    largest_span = min(FAST_SPAN_LOG[dtype], FAST_SPAN_LOG[accum_dtype])
    cumulative_gates = cumulative_gates_macro(C, d_k)
    flag_wide_spans = flag_wide_spans_macro(C, d_k, largest_span)
    exact_diagonal_gradients = exact_diagonal_gradients_macro(channels)
    # GEMMs issued together and waited for once where they are Hopper's wgmma, whose tiles take rows in
    # 64s: a 32-token chunk's GEMMs take T.gemm, which waits for each
    issued_together = C >= 64
    issue_gemm = T.wgmma_gemm if issued_together else T.gemm
    # the fp32 buffers that elementwise passes read in a GEMM accumulator's order (a warp: 8 rows, 8
    # columns) take 8 more words a row: rows of 64 or 128 words all start in bank 0, so those 8 rows
    # met in the same 8 banks (the H200 profile: 44% of shared-memory wavefronts were bank conflicts)
    row_pad = 8
    wait_for_tensor_cores = wait_for_tensor_cores_macro(threads, issued_together)

    @T.prim_func
    def kda_intra(
        Q: tensors.qk,
        K: tensors.qk,
        V: tensors.v,
        G: tensors.g,
        Beta: tensors.beta,
        A_kk: tensors.score_rows_fp32,
        Inverse: tensors.score_rows_fp32,
        dO: tensors.value_rows,
        V_new: tensors.value_rows,
        dV_new: tensors.value_rows,
        dQ_decayed: tensors.key_rows_fp32,
        dK_to_chunk_end: tensors.key_rows_fp32,
        dW: tensors.key_rows_fp32,
        D_gamma_last: tensors.chunk_rows_fp32,
        dQ: tensors.key_rows_fp32,
        dK: tensors.key_rows_fp32,
        dV: tensors.v,
        dG: tensors.key_rows_fp32,
        dBeta: tensors.beta,
    ):
        with T.Kernel(num_chunks, B * H, threads=threads) as (i_c, i_bh):
            b, h = i_bh // H, i_bh % H
            t0 = i_c * C

            # q and k padded too: the slabs' first pass reads them in the accumulator's order, where 8
            # rows of 128 half-precision words met in the same 4 banks
            Q_s = T.alloc_shared((C, d_k + row_pad), dtype)
            K_s = T.alloc_shared((C, d_k + row_pad), dtype)
            gamma_s = T.alloc_shared((C, d_k + row_pad), accum_dtype)
            beta_s = T.alloc_shared((C,), accum_dtype)
            K_row_s = T.alloc_shared((C, channels), dtype)  # GEMM operands: decay from the anchor to the row
            Q_row_s = T.alloc_shared((C, channels), dtype)
            K_col_s = T.alloc_shared((C, channels), dtype)  # ... and from the column to the anchor
            # what rounding the diagonal sub-blocks' three operands to `dtype` dropped
            K_row_low_s = T.alloc_shared((C, channels), dtype)
            Q_row_low_s = T.alloc_shared((C, channels), dtype)
            K_col_low_s = T.alloc_shared((C, channels), dtype)
            # the slabs' column operand in the score gradients' GEMMs, a buffer of its own: as the slice
            # K_col_s[0:sub, :] it is a B operand whose channels run along the rows, and TileLang 0.1.15
            # gives the second warp group of a 256-thread program an offset into it computed from the
            # slice's 16 rows instead of the buffer's C (wrong dq, dk, dg on the H200)
            K_slab_col_s = T.alloc_shared((sub, channels), dtype)
            A_kk_s = T.alloc_shared((C, C + row_pad), accum_dtype)  # M, strictly lower
            T_s = T.alloc_shared((C, C + row_pad), accum_dtype)  # (I + L)^{-1}, L = A_kk diag(beta)
            T_op_s = T.alloc_shared((C, C), dtype)  # T and diag(beta) T as GEMM operands
            A_hat_s = T.alloc_shared((C, C), dtype)
            A_hat_low_s = T.alloc_shared((C, C), dtype)  # what rounding A_hat to `dtype` dropped
            K_decayed_s = T.alloc_shared((C, d_k), dtype)  # K e^gamma
            dW_s = T.alloc_shared((C, d_k), dtype)
            V_s = T.alloc_shared((C, d_v), dtype)
            dV_new_s = T.alloc_shared((C, d_v), dtype)
            V_new_s = T.alloc_shared((C, d_v), dtype)
            dO_s = T.alloc_shared((C, d_v), dtype)
            dA_hat_s = T.alloc_shared((C, C), dtype)
            product_s = T.alloc_shared((C, C), dtype)  # dA_hat^T A_hat
            # dM^T and dA_qk^T: transposed, so a column slab of dM is a slab of rows of dM^T; and their
            # diagonal sub-blocks alone, for the anchored diagonal GEMMs
            dM_T_s = T.alloc_shared((C, C), dtype)
            dA_qk_T_s = T.alloc_shared((C, C), dtype)
            dM_T_diagonal_s = T.alloc_shared((C, C), dtype)
            dA_qk_T_diagonal_s = T.alloc_shared((C, C), dtype)
            # ... and what rounding those two to `dtype` dropped
            dM_T_diagonal_low_s = T.alloc_shared((C, C), dtype)
            dA_qk_T_diagonal_low_s = T.alloc_shared((C, C), dtype)
            dbeta_s = T.alloc_shared((C,), accum_dtype)
            # the score gradients of one channel pass (dk's: by rows and by columns, summed), and dgamma (fp32)
            dQ_scores_s = T.alloc_shared((C, channels + row_pad), accum_dtype)
            dK_scores_s = T.alloc_shared((C, channels + row_pad), accum_dtype)
            dgamma_s = T.alloc_shared((C, channels + row_pad), accum_dtype)
            exact_s = T.alloc_shared((blocks,), "int32")  # 1: the sub-block is taken by its definition

            dA_hat_f = T.alloc_fragment((C, C), accum_dtype)
            dv_f = T.alloc_fragment((C, d_v), accum_dtype)
            dk_decayed_f = T.alloc_fragment((C, d_k), accum_dtype)
            square_f = T.alloc_fragment((C, C), accum_dtype)  # one C x C product after another
            row_sum_f = T.alloc_fragment((C,), accum_dtype)
            rows_f = T.alloc_fragment((C, channels), accum_dtype)  # the score GEMMs of one pass
            rows_k_f = T.alloc_fragment((C, channels), accum_dtype)
            columns_f = T.alloc_fragment((C, channels), accum_dtype)
            slab_columns_f = T.alloc_fragment((sub, channels), accum_dtype)
            # the decays from an anchor to each row (the diagonal sub-blocks' and each slab's) and from
            # each column to the diagonal's anchor, kept from the pass that scales the GEMMs' operands to
            # the pass that scales their outputs (registers are free: shared memory allows one block an
            # SM, so each thread may hold 255)
            to_row_f = T.alloc_fragment((C, channels), accum_dtype)
            from_column_f = T.alloc_fragment((C, channels), accum_dtype)

            T.copy(Q[b, t0:t0 + C, h, :], Q_s[:, 0:d_k])
            T.copy(K[b, t0:t0 + C, h, :], K_s[:, 0:d_k])
            T.copy(Beta[b, t0:t0 + C, h], beta_s)
            T.copy(G[b, t0:t0 + C, h, :], gamma_s[:, 0:d_k])
            # A_kk and T as the prepare kernel computed them for the forward (solve_outputs): the backward
            # differentiates the very matrices the forward used, and does not compute them again
            T.copy(A_kk[b, t0:t0 + C, h, :], A_kk_s[:, 0:C])
            T.copy(Inverse[b, t0:t0 + C, h, :], T_s[:, 0:C])
            cumulative_gates(gamma_s)
            flag_wide_spans(gamma_s, exact_s)
            # --8<-- [end:intra_setup]


            # --8<-- [start:intra_wy]
            # back through W = A_hat (K e^gamma) and U = A_hat V, A_hat = diag(beta) T
            for r, c in T.Parallel(C, C):
                T_op_s[r, c] = T_s[r, c]
                A_hat = T_s[r, c] * beta_s[r]
                A_hat_s[r, c] = A_hat
                A_hat_low_s[r, c] = A_hat - A_hat_s[r, c]
            for r, d in T.Parallel(C, d_k):
                K_decayed_s[r, d] = K_s[r, d] * T.exp2(gamma_s[r, d] * LOG2_E)
                dW_s[r, d] = dW[b, t0 + r, h, d]
            T.copy(V[b, t0:t0 + C, h, :], V_s)
            T.copy(dV_new[b, t0:t0 + C, h, :], dV_new_s)
            # five GEMMs into three accumulators, issued together and waited for once (the kernel's shared
            # waits save 0.06 of its 4.97 ms on the H200: archive/studies/s06_intra_sections.py)
            issue_gemm(dW_s, K_decayed_s, dA_hat_f, transpose_B=True, clear_accum=True)
            issue_gemm(dV_new_s, V_s, dA_hat_f, transpose_B=True)
            # dv = A_hat^T dV_new with A_hat in two parts, its rounding and the remainder: dV_new is
            # exact in `dtype`, so rounding A_hat was most of dv's error beyond the inputs' (5% in bf16:
            # archive/studies/s06_intra_operand_precision.py)
            issue_gemm(A_hat_s, dV_new_s, dv_f, transpose_A=True, clear_accum=True)
            issue_gemm(A_hat_low_s, dV_new_s, dv_f, transpose_A=True)
            # d(K e^gamma) = A_hat^T dW, parked in dK until the channel passes add the rest: shared memory
            # has no room for it beside the score gradients' operands. Other threads read it back there,
            # after the __syncthreads() that the shared-memory steps between place, which make a block's
            # global writes visible to all its threads
            issue_gemm(A_hat_s, dW_s, dk_decayed_f, transpose_A=True, clear_accum=True)
            wait_for_tensor_cores(dA_hat_f, dv_f, dk_decayed_f)
            T.copy(dv_f, dV[b, t0:t0 + C, h, :])
            T.copy(dk_decayed_f, dK[b, t0:t0 + C, h, :])

            # beta by rows, after the solve: rowsum(dA_hat ⊙ T)
            for r, c in T.Parallel(C, C):
                dA_hat_s[r, c] = dA_hat_f[r, c]
                square_f[r, c] = dA_hat_f[r, c] * T_s[r, c]
            T.reduce_sum(square_f, row_sum_f, dim=1)
            T.copy(row_sum_f, dbeta_s)

            # through the solve: dL^T = -T dT^T T = -T (dA_hat^T A_hat), kept strictly upper
            T.gemm(dA_hat_s, A_hat_s, square_f, transpose_A=True, clear_accum=True)
            T.copy(square_f, product_s)
            T.gemm(T_op_s, product_s, square_f, clear_accum=True)
            # beta by columns, inside the solve: dbeta_i += sum_c dL[c, i] A_kk[c, i]; dM^T = diag(beta) dL^T
            for i, c in T.Parallel(C, C):
                dL_T = T.if_then_else(c > i, -square_f[i, c], 0)
                dM_T_s[i, c] = dL_T * beta_s[i]
                dM_T_diagonal = T.if_then_else(i // sub == c // sub, dL_T * beta_s[i], 0)
                dM_T_diagonal_s[i, c] = dM_T_diagonal
                dM_T_diagonal_low_s[i, c] = dM_T_diagonal - dM_T_diagonal_s[i, c]
                square_f[i, c] = dL_T * A_kk_s[c, i]
            T.reduce_sum(square_f, row_sum_f, dim=1)
            for r in T.Parallel(C):
                dBeta[b, t0 + r, h] = dbeta_s[r] + row_sum_f[r]

            # dA_qk^T = V_new dO^T, upper with the diagonal (j <= c)
            T.copy(V_new[b, t0:t0 + C, h, :], V_new_s)
            T.copy(dO[b, t0:t0 + C, h, :], dO_s)
            T.gemm(V_new_s, dO_s, square_f, transpose_B=True, clear_accum=True)
            for i, c in T.Parallel(C, C):
                dA_qk_T = T.if_then_else(c >= i, square_f[i, c], 0)
                dA_qk_T_s[i, c] = dA_qk_T
                dA_qk_T_diagonal = T.if_then_else(i // sub == c // sub, dA_qk_T, 0)
                dA_qk_T_diagonal_s[i, c] = dA_qk_T_diagonal
                dA_qk_T_diagonal_low_s[i, c] = dA_qk_T_diagonal - dA_qk_T_diagonal_s[i, c]
            # --8<-- [end:intra_wy]

            # --8<-- [start:intra_scores]
            for channel_pass in range(channel_passes):
                d0 = channel_pass * channels
                # diagonal sub-blocks, anchored at their middle row. A GEMM below multiplies every
                # block's operands by the other blocks' zeros, so an inf in one would spread NaN to all
                # rows: the exponents are clamped to the span in range, which changes no sub-block but
                # the flagged ones, taken again by their definition after the GEMMs
                for r, d in T.Parallel(C, channels):
                    from_anchor = T.max(T.min(gamma_s[r, d0 + d] - gamma_s[(r // sub) * sub + sub // 2, d0 + d],
                                              largest_span), -largest_span) * LOG2_E
                    to_row_f[r, d] = T.exp2(from_anchor)
                    from_column_f[r, d] = T.exp2(-from_anchor)
                    query_to_row = T.cast(Q_s[r, d0 + d], accum_dtype) * to_row_f[r, d]
                    key_to_row = T.cast(K_s[r, d0 + d], accum_dtype) * to_row_f[r, d]
                    key_from_column = T.cast(K_s[r, d0 + d], accum_dtype) * from_column_f[r, d]
                    Q_row_s[r, d] = query_to_row
                    K_row_s[r, d] = key_to_row
                    K_col_s[r, d] = key_from_column
                    Q_row_low_s[r, d] = query_to_row - Q_row_s[r, d]
                    K_row_low_s[r, d] = key_to_row - K_row_s[r, d]
                    K_col_low_s[r, d] = key_from_column - K_col_s[r, d]
                # both sides of each product in two parts, their rounding and the remainder, and three GEMMs
                # for it (all but remainder x remainder): these GEMMs carry most of the chunk's score
                # gradients, and with both sides in `dtype` they were an eighth of dq's error in bf16
                # (archive/studies/s06_intra_operand_precision.py)
                issue_gemm(dA_qk_T_diagonal_s, K_col_s, rows_f, transpose_A=True, clear_accum=True)
                issue_gemm(dA_qk_T_diagonal_low_s, K_col_s, rows_f, transpose_A=True)
                issue_gemm(dA_qk_T_diagonal_s, K_col_low_s, rows_f, transpose_A=True)
                issue_gemm(dM_T_diagonal_s, K_col_s, rows_k_f, transpose_A=True, clear_accum=True)
                issue_gemm(dM_T_diagonal_low_s, K_col_s, rows_k_f, transpose_A=True)
                issue_gemm(dM_T_diagonal_s, K_col_low_s, rows_k_f, transpose_A=True)
                issue_gemm(dM_T_diagonal_s, K_row_s, columns_f, clear_accum=True)
                issue_gemm(dM_T_diagonal_low_s, K_row_s, columns_f)
                issue_gemm(dM_T_diagonal_s, K_row_low_s, columns_f)
                issue_gemm(dA_qk_T_diagonal_s, Q_row_s, columns_f)
                issue_gemm(dA_qk_T_diagonal_low_s, Q_row_s, columns_f)
                issue_gemm(dA_qk_T_diagonal_s, Q_row_low_s, columns_f)
                wait_for_tensor_cores(rows_f, rows_k_f, columns_f)
                # dgamma's terms multiply each GEMM by its other operand as the GEMMs took it (both parts):
                # the pair (c, i) then adds one product to dgamma_c and subtracts the same product from
                # dgamma_i, and the two cancel in every dg[s] with s <= i, as they do in exact arithmetic
                for r, d in T.Parallel(C, channels):
                    query_to_row = T.cast(Q_row_s[r, d], accum_dtype) + T.cast(Q_row_low_s[r, d], accum_dtype)
                    key_to_row = T.cast(K_row_s[r, d], accum_dtype) + T.cast(K_row_low_s[r, d], accum_dtype)
                    key_from_column = T.cast(K_col_s[r, d], accum_dtype) + T.cast(K_col_low_s[r, d], accum_dtype)
                    dQ_scores_s[r, d] = rows_f[r, d] * to_row_f[r, d]
                    dK_scores_s[r, d] = rows_k_f[r, d] * to_row_f[r, d] + columns_f[r, d] * from_column_f[r, d]
                    dgamma_s[r, d] = (query_to_row * rows_f[r, d] + key_to_row * rows_k_f[r, d]
                                      - key_from_column * columns_f[r, d])
                # the flagged sub-blocks' rows, written over: a uniform branch, as in the recompute
                for blk in T.serial(blocks):
                    if exact_s[blk] == 1:
                        exact_diagonal_gradients(Q_s, K_s, gamma_s, dA_qk_T_s, dM_T_s, d0, dQ_scores_s, dK_scores_s,
                                                 dgamma_s, blk * sub)

                # a slab of sub key columns at a time, anchored at the first row below it: rows from s0
                # on take their decay from the anchor (<= 1); rows above are zero, since the column
                # GEMM sums over rows and the diagonal block is done
                for s0 in tuple(range(sub, C, sub)):
                    slab = s0 - sub
                    for r, d in T.Parallel(C, channels):
                        to_row_f[r, d] = T.if_then_else(
                            r >= s0, T.exp2((gamma_s[r, d0 + d] - gamma_s[s0, d0 + d]) * LOG2_E), 0)
                        Q_row_s[r, d] = Q_s[r, d0 + d] * to_row_f[r, d]
                        K_row_s[r, d] = K_s[r, d0 + d] * to_row_f[r, d]
                    for r, d in T.Parallel(sub, channels):
                        K_slab_col_s[r, d] = K_s[slab + r, d0 + d] * T.exp2(
                            (gamma_s[s0, d0 + d] - gamma_s[slab + r, d0 + d]) * LOG2_E)
                    # the two wgmma GEMMs run while the slab's 16 rows (too few for wgmma) take the
                    # synchronous path
                    issue_gemm(dA_qk_T_s[slab:s0, :], K_slab_col_s, rows_f, transpose_A=True, clear_accum=True)
                    issue_gemm(dM_T_s[slab:s0, :], K_slab_col_s, rows_k_f, transpose_A=True, clear_accum=True)
                    T.gemm(dM_T_s[slab:s0, :], K_row_s, slab_columns_f, clear_accum=True)
                    T.gemm(dA_qk_T_s[slab:s0, :], Q_row_s, slab_columns_f)
                    wait_for_tensor_cores(rows_f, rows_k_f)
                    # every row takes part, rows above s0 adding zeros (their to_row is 0, and so are their
                    # rows of Q_row_s and K_row_s): at 256 threads, `if r >= s0` here lowered to a branch
                    # that whole warps skip around a __syncthreads(), and the d = 128 runs stalled
                    for r, d in T.Parallel(C, channels):
                        dQ_scores_s[r, d] += rows_f[r, d] * to_row_f[r, d]
                        dK_scores_s[r, d] += rows_k_f[r, d] * to_row_f[r, d]
                        dgamma_s[r, d] += Q_row_s[r, d] * rows_f[r, d] + K_row_s[r, d] * rows_k_f[r, d]
                    for r, d in T.Parallel(sub, channels):
                        dK_scores_s[slab + r, d] += slab_columns_f[r, d] * T.exp2(
                            (gamma_s[s0, d0 + d] - gamma_s[slab + r, d0 + d]) * LOG2_E)
                        dgamma_s[slab + r, d] -= K_slab_col_s[r, d] * slab_columns_f[r, d]
                # --8<-- [end:intra_scores]

                # --8<-- [start:intra_gates]
                # the gradients of this pass's channels; dgamma's terms of Q e^gamma, K e^gamma (+) and
                # K e^{gamma_C - gamma} (-)
                for r, d in T.Parallel(C, channels):
                    decay_from_start = T.exp2(gamma_s[r, d0 + d] * LOG2_E)
                    decay_to_end = T.exp2((gamma_s[C - 1, d0 + d] - gamma_s[r, d0 + d]) * LOG2_E)
                    dq_decayed = dQ_decayed[b, t0 + r, h, d0 + d] * decay_from_start
                    dk_decayed = dK[b, t0 + r, h, d0 + d] * decay_from_start
                    dk_to_end = dK_to_chunk_end[b, t0 + r, h, d0 + d] * decay_to_end
                    dQ[b, t0 + r, h, d0 + d] = dq_decayed + dQ_scores_s[r, d]
                    dK[b, t0 + r, h, d0 + d] = dk_decayed + dK_scores_s[r, d] + dk_to_end
                    query, key = T.cast(Q_s[r, d0 + d], accum_dtype), T.cast(K_s[r, d0 + d], accum_dtype)
                    dgamma_s[r, d] += query * dq_decayed + key * (dk_decayed - dk_to_end)
                # gamma_C lies in the last row, which every dg[s] sums: its terms (the state's decay,
                # and every row's e^{gamma_C - gamma}, recomputed here) go to every row; then dg is the
                # reverse cumulative sum, one lane per channel
                for d in T.Parallel(channels):
                    running = T.alloc_var(accum_dtype)
                    running = D_gamma_last[b, i_c, h, d0 + d]
                    for r in T.serial(C):
                        running += K_s[r, d0 + d] * dK_to_chunk_end[b, t0 + r, h, d0 + d] * T.exp2(
                            (gamma_s[C - 1, d0 + d] - gamma_s[r, d0 + d]) * LOG2_E)
                    for r in T.serial(C):
                        running += dgamma_s[C - 1 - r, d]
                        dG[b, t0 + C - 1 - r, h, d0 + d] = running

    return kda_intra
# --8<-- [end:intra_gates]


# every kernel of the backward, in launch order: its builder and the indices of its outputs (as
# tilelang.compile's and the interpreter's out_idx take them)
BUILDERS = {
    "prepare": (functools.partial(build_prepare_program, solve_outputs=True), prepare_outputs(solve_outputs=True)),
    "states": (build_states_program, [5, 6]),
    "state_gradient": (build_state_gradient_program, [7, 8, 9]),
    "state_products": (build_state_products_program, [6, 7, 8, 9]),
    "intra": (build_intra_program, [14, 15, 16, 17, 18]),
}
WITH_BLOCK_DV = ("states", "state_gradient")  # the two chunk loops split d_v; the per-chunk kernels do not


def kernel_arguments(B, N, H, d_k, d_v, chunk_size, block_dv, dtype):
    """{kernel: its builder's arguments} for one backward on inputs of N tokens (a multiple of
    chunk_size), in launch order: each takes the shape, chunk_size and dtype, the two chunk loops
    block_dv too."""
    shape = (B, N, H, d_k, d_v, chunk_size)
    return {name: (*shape, *((block_dv,) if name in WITH_BLOCK_DV else ()), dtype) for name in BUILDERS}
