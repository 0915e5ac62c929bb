"""Stage 5 references in NumPy float64: the KDA forward split into a parallel part and a sequential part.

    S_t = S_{t-1} Diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T        o_t = S_t q_t
                                                             (paper layout: S is d_v x d_k)

The math is stage 4's; what changes is where each piece is computed. Everything of a chunk that
does not read the state is computed for all chunks at once (the prepare kernel); only what reads
the state is left in the chunk loop (the recurrence kernel). For chunk [t] with gamma[r] = G[0] +
... + G[r] (a vector of d_k log decays, restarted at every chunk):

    prepare, parallel over chunks:                    recurrence, sequential over chunks:
      A_kk[c, i] = (k_c ⊙ e^{gamma_c - gamma_i}) · k_i  (i < c)     V_new = U - W S^T
      A_qk[c, j] = (q_c ⊙ e^{gamma_c - gamma_j}) · k_j  (j <= c)    O     = Q_decayed S^T + A_qk V_new
      T = (I + L)^{-1},  L[c, i] = beta_i A_kk[c, i]                  S^T  <- Diag(chunk_decay) S^T
      W = diag(beta) T (K ⊙ e^{gamma}),  U = diag(beta) T V                 + K_to_chunk_end^T V_new
      Q_decayed = Q ⊙ e^{gamma},  K_to_chunk_end = K ⊙ e^{gamma_C - gamma},  chunk_decay = e^{gamma_C}

- `recurrent` (A) is stage 4's reference A, token by token: the recurrence has not changed.
- `chunkwise` (B) is the split in two plain loops: one over chunks that carries nothing from one
  chunk to the next, then the loop that carries the state S^T (d_k x d_v, the kernel layout).
- `kernel_mirror` (C) is the two kernels' control flow in NumPy: `prepare` mirrors the prepare kernel
  (A_kk and A_qk from GEMMs on 16-row sub-blocks with anchored exponents, `intra_chunk_scores`; the
  inverse by blocks, `block_inverse`), `recurrence` mirrors the recurrence kernel.
"""

from dataclasses import dataclass

import numpy as np
from numpy.typing import DTypeLike

from stages.common.checks import (Float64Array, check_array, check_chunking, check_divisor, check_gate_and_beta, check_qkv,
                                  check_shaped, padded_length)
from stages.s04_kda.reference import recurrent  # noqa: F401  reference A is stage 4's

SUB_BLOCK = 16  # rows of a sub-block: the tensor cores' M and K granularity


# --8<-- [start:chunkwise]
def chunkwise(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
              chunk_size: int) -> Float64Array:
    """Reference B: every chunk's tensors first (no state read), then the state loop. State S^T: (d_k, d_v).

    The last chunk may be shorter than chunk_size: nothing in the math needs equal chunks.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="channel")
    check_chunking(N, d_v, chunk_size)
    o = np.zeros((B, N, H, d_v))
    for b in range(B):
        for h in range(H):
            per_chunk = []
            for start in range(0, N, chunk_size):  # no state here: every chunk on its own
                rows = slice(start, min(start + chunk_size, N))
                Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h]
                beta_c = beta[b, rows, h]
                C = len(Q)
                gamma = np.cumsum(g[b, rows, h], axis=0)  # (C, d_k): log decay from the chunk start
                A_kk, A_qk = np.zeros((C, C)), np.zeros((C, C))
                for c in range(C):
                    for i in range(c + 1):
                        decay = np.exp(gamma[c] - gamma[i])  # every entry <= 1: i <= c
                        A_kk[c, i] = (K[c] * decay) @ K[i] if i < c else 0.0  # strict: i < c
                        A_qk[c, i] = (Q[c] * decay) @ K[i]  # inclusive: a token sees itself
                T = np.linalg.inv(np.eye(C) + A_kk * beta_c[None, :])  # L[c, i] = beta_i A_kk[c, i] ...
                A_hat = beta_c[:, None] * T  # ... pairs with diag(beta) T
                per_chunk.append((rows, A_hat @ (K * np.exp(gamma)), A_hat @ V, Q * np.exp(gamma),
                                  K * np.exp(gamma[-1] - gamma), A_qk, np.exp(gamma[-1])))
            S_T = np.zeros((d_k, d_v))
            for rows, W, U, Q_decayed, K_to_chunk_end, A_qk, chunk_decay in per_chunk:  # the state loop
                V_new = U - W @ S_T
                o[b, rows, h] = Q_decayed @ S_T + A_qk @ V_new
                S_T = chunk_decay[:, None] * S_T + K_to_chunk_end.T @ V_new
    return o
# --8<-- [end:chunkwise]


@dataclass
class ChunkTensors:
    """What the prepare kernel writes to HBM and the recurrence kernel reads, N_padded = chunks * C.

    w, q_decayed, k_to_chunk_end: (B, N_padded, H, d_k); u: (B, N_padded, H, d_v);
    a_qk: (B, N_padded, H, C), row r of a chunk holds A_qk[r, :]; chunk_decay: (B, chunks, H, d_k).
    In the kernel all but chunk_decay (fp32) are stored in the input dtype.
    """

    w: np.ndarray
    u: np.ndarray
    q_decayed: np.ndarray
    k_to_chunk_end: np.ndarray
    a_qk: np.ndarray
    chunk_decay: np.ndarray


# --8<-- [start:kernel_mirror]
def kernel_mirror(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                  chunk_size: int, block_dv: int, sub_block: int = SUB_BLOCK) -> Float64Array:
    """Reference C: the prepare kernel, then the recurrence kernel. State S^T: (d_k, block_dv) per program.

    Like the kernel's wrapper, it zero-pads N up to a multiple of chunk_size. The padding is exact:
    a padded token has k = v = 0, beta = 0 and g = 0 (no decay), so it leaves the state as it was.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="channel")
    check_chunking(N, d_v, chunk_size, block_dv)
    o, _ = recurrence(prepare(q, k, v, g, beta, chunk_size, sub_block), block_dv)
    return o[:, :N]
# --8<-- [end:kernel_mirror]


# --8<-- [start:prepare]
def prepare(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
            chunk_size: int, sub_block: int = SUB_BLOCK, operand_dtype: DTypeLike = np.float64) -> ChunkTensors:
    """The prepare kernel's control flow: one program per (chunk, batch x head). Returns ChunkTensors.

    operand_dtype is the type the kernel casts GEMM operands and stored tensors to (np.float16
    mirrors an fp16 kernel's rounding and range; the default float64 rounds nothing).
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="channel")
    check_chunking(N, d_v, chunk_size)
    C = chunk_size
    check_divisor("sub_block", sub_block, "chunk_size", C)
    q, k, v, g = (_pad_tokens(x, padded_length(N, C)) for x in (q, k, v, g))
    beta = _pad_tokens(beta[..., None], padded_length(N, C))[..., 0]
    N_padded = q.shape[1]
    out = ChunkTensors(np.zeros((B, N_padded, H, d_k)), np.zeros((B, N_padded, H, d_v)), np.zeros((B, N_padded, H, d_k)),
                       np.zeros((B, N_padded, H, d_k)), np.zeros((B, N_padded, H, C)), np.zeros((B, N_padded // C, H, d_k)))

    def operand(x):  # the cast to the GEMM's input type
        return x.astype(operand_dtype).astype(np.float64)

    for i_c in range(N_padded // C):  # grid.x: one program per chunk, no state: all run at once
        for i_bh in range(B * H):  # grid.y
            b, h = divmod(i_bh, H)
            rows = slice(i_c * C, (i_c + 1) * C)
            Q, K, V = q[b, rows, h], k[b, rows, h], v[b, rows, h]
            beta_c = beta[b, rows, h]
            gamma = np.cumsum(g[b, rows, h], axis=0)  # T.cumsum over the chunk's gate tile
            A_kk, A_qk = intra_chunk_scores(Q, K, gamma, sub_block, operand_dtype)
            T = block_inverse(A_kk * beta_c[None, :], sub_block)  # fp32 on chip: no cast
            A_hat = operand(beta_c[:, None] * T)  # diag(beta) T, cast once for both GEMMs
            out.w[b, rows, h] = operand(A_hat @ operand(K * np.exp(gamma)))  # GEMM
            out.u[b, rows, h] = operand(A_hat @ operand(V))  # GEMM
            out.q_decayed[b, rows, h] = operand(Q * np.exp(gamma))
            out.k_to_chunk_end[b, rows, h] = operand(K * np.exp(gamma[-1] - gamma))
            out.a_qk[b, rows, h] = operand(A_qk)
            out.chunk_decay[b, i_c, h] = np.exp(gamma[-1])  # fp32: it multiplies the state
    return out
# --8<-- [end:prepare]


# --8<-- [start:intra_chunk_scores]
def intra_chunk_scores(Q: Float64Array, K: Float64Array, gamma: Float64Array, sub_block: int,
                       operand_dtype: DTypeLike = np.float64) -> tuple[Float64Array, Float64Array]:
    """A_kk (C x C, strictly lower) and A_qk (C x C, lower with the diagonal) of one chunk, as GEMMs.

    Q, K: (C, d_k) rows of the chunk; gamma: (C, d_k) cumulative log gates from the chunk start.
    e^{gamma_c - gamma_i} = e^{gamma_c - gamma_a} e^{gamma_a - gamma_i} for any anchor row a: each
    factor goes into one GEMM operand, and the anchor is chosen so that neither factor is large.
    """
    check_array("K", K, 2, "(C, d_k)")
    check_shaped("Q", Q, K.shape, f"K's (C, d_k) = {K.shape}")
    check_shaped("gamma", gamma, K.shape, f"K's (C, d_k) = {K.shape}")
    C = len(K)
    check_divisor("sub_block", sub_block, "C", C)

    def operand(x):  # the cast to the GEMM's input type
        return x.astype(operand_dtype).astype(np.float64)

    # EXERCISE BEGIN
    # diagonal sub-blocks: one C x C GEMM, each row and column anchored at the middle row of its
    # sub-block, so that no factor exceeds a_min^{-sub_block/2}; only the block diagonal is kept
    sub_index = np.arange(C) // sub_block
    middle = gamma[sub_index * sub_block + sub_block // 2]  # (C, d_k): each row's anchor
    Q_row, K_row = operand(Q * np.exp(gamma - middle)), operand(K * np.exp(gamma - middle))
    K_col = operand(K * np.exp(middle - gamma))
    same_block = sub_index[:, None] == sub_index[None, :]
    A_kk = np.where(same_block, K_row @ K_col.T, 0.0)  # GEMM
    A_qk = np.where(same_block, Q_row @ K_col.T, 0.0)  # GEMM
    # off-diagonal: one column slab of sub_block keys at a time, anchored at the first row below
    # the slab; gamma never increases, so both factors are <= 1
    for s0 in range(sub_block, C, sub_block):
        slab, below = slice(s0 - sub_block, s0), slice(s0, C)
        anchor = gamma[s0]
        K_col = operand(K[slab] * np.exp(anchor - gamma[slab]))
        Q_row, K_row = np.zeros_like(Q), np.zeros_like(K)  # rows above the anchor stay zero
        Q_row[below] = operand(Q[below] * np.exp(gamma[below] - anchor))
        K_row[below] = operand(K[below] * np.exp(gamma[below] - anchor))
        A_kk[:, slab] += K_row @ K_col.T  # GEMM, C x sub_block
        A_qk[:, slab] += Q_row @ K_col.T  # GEMM, C x sub_block
    # EXERCISE END
    return np.tril(A_kk, -1), np.tril(A_qk)
# --8<-- [end:intra_chunk_scores]


# --8<-- [start:block_inverse]
def block_inverse(L: Float64Array, block: int) -> Float64Array:
    """(I + L)^{-1} for L strictly lower triangular (C x C), by sub-blocks of `block` rows.

    The diagonal blocks are inverted by forward substitution, all at once (one lane per (block,
    column)); then each block row P takes the rows above it with two products:
        T[P, :P] = -T[P, P] (L[P, :P] T[:P, :P])       from (I + L) T = I, block row P.
    """
    C = len(L)
    check_shaped("L", L, (C, C), f"(C, C) = {(C, C)}")
    check_divisor("block", block, "C", C)
    T = np.zeros((C, C))
    # EXERCISE BEGIN
    for r in range(block):  # forward substitution, row r of every diagonal block
        for s0 in range(0, C, block):
            i, cols = s0 + r, slice(s0, s0 + block)
            T[i, cols] = -L[i, s0:i] @ T[s0:i, cols]
            T[i, i] = 1.0
    for p0 in range(block, C, block):  # merge: block row P from the finished rows above it
        rows, above = slice(p0, p0 + block), slice(0, p0)
        T[rows, above] = -T[rows, rows] @ (L[rows, above] @ T[above, above])
    # EXERCISE END
    return T
# --8<-- [end:block_inverse]


# --8<-- [start:recurrence]
def recurrence(tensors: "ChunkTensors", block_dv: int,
               initial_state: Float64Array | None = None) -> tuple[Float64Array, Float64Array]:
    """The recurrence kernel's control flow: one program per (block of d_v columns, batch x head).

    tensors: ChunkTensors from `prepare`; initial_state: S_0^T (B, H, d_k, d_v) or None for zeros.
    Returns (o: (B, N_padded, H, d_v), the final state S^T: (B, H, d_k, d_v)).
    """
    B, N_padded, H, d_k = tensors.w.shape
    d_v, C = tensors.u.shape[3], tensors.a_qk.shape[3]
    check_chunking(N_padded, d_v, C, block_dv)
    if initial_state is not None:
        check_shaped("initial_state", initial_state, (B, H, d_k, d_v), f"(B, H, d_k, d_v) = {(B, H, d_k, d_v)}")
    o = np.zeros((B, N_padded, H, d_v))
    final_state = np.zeros((B, H, d_k, d_v))
    for i_v in range(d_v // block_dv):  # grid.x: one program per block of value columns
        cols = slice(i_v * block_dv, (i_v + 1) * block_dv)
        for i_bh in range(B * H):  # grid.y: one program per (batch, head)
            b, h = divmod(i_bh, H)
            # EXERCISE BEGIN
            S_T = np.zeros((d_k, block_dv)) if initial_state is None else initial_state[b, h][:, cols].copy()
            for i_c in range(N_padded // C):  # the pipelined chunk loop
                rows = slice(i_c * C, (i_c + 1) * C)
                W, U = tensors.w[b, rows, h], tensors.u[b, rows, h, cols]
                V_new = U - W @ S_T  # GEMM: the pseudo-values
                acc_o = tensors.q_decayed[b, rows, h] @ S_T  # GEMM: the inter-chunk term
                acc_o += tensors.a_qk[b, rows, h] @ V_new  # GEMM: the intra-chunk term, accumulated
                o[b, rows, h, cols] = acc_o  # the chunk's output is written ...
                S_T *= tensors.chunk_decay[b, i_c, h][:, None]  # ... then the state decays, row by row ...
                S_T += tensors.k_to_chunk_end[b, rows, h].T @ V_new  # ... then takes the chunk (GEMM)
            # EXERCISE END
            final_state[b, h, :, cols] = S_T
    return o, final_state
# --8<-- [end:recurrence]


def _pad_tokens(x, length):
    """Zero-pad axis 1 (tokens) of a (B, N, H, D) array to `length`."""
    return np.pad(x, ((0, 0), (0, length - x.shape[1]), (0, 0), (0, 0)))
