"""Exercise s05.recurrence (fix): the recurrence kernel's control flow in NumPy.

The loops are the kernel's: grid.x over blocks of value columns, grid.y over (batch, head), then the
pipelined loop over chunks with the state S^T (d_k x block_dv) kept for the whole program. Everything
that does not read the state (W, U, the decayed queries and keys, A_qk, e^{gamma_C}) comes prepared.

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 5 page, "Reference C: the two kernels' control flow".  Check: course check s05
"""

from typing import TYPE_CHECKING

import numpy as np

from stages.common.checks import Float64Array, check_chunking, check_shaped

if TYPE_CHECKING:  # the annotation only: prepare's result, made by the library
    from stages.s05_fast_kda.reference import ChunkTensors


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
                S_T += tensors.k_to_chunk_end[b, rows, h].T @ V_new  # ... then takes the chunk (GEMM)
                S_T *= tensors.chunk_decay[b, i_c, h][:, None]  # ... then the state decays, row by row ...
            # EXERCISE END
            final_state[b, h, :, cols] = S_T
    return o, final_state
