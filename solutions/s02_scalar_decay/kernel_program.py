"""Exercise s02.kernel_program (fix): linear attention with a decay per head, token by token, as a
TileLang program of its own.

Not the chunked kernel of this stage (that one is exercise s02.build_kernel): reference A's
recurrence as a program, one token at a time, the way a decode step runs it. One program per (block
of d_v columns, batch x head) keeps its slice of the state S^T (d_k x block_dv) in registers as an
fp32 fragment and, for each token t,

    S^T <- alpha S^T + k_t v_t^T                  the old state fades by the head's alpha = e^g
    o_t =  (S^T)^T q_t                            the output, read from the updated state

The product with q_t is a column of element-wise products summed over the key channels
(T.reduce_sum): no tensor cores, d_k x block_dv of work per token on the CUDA cores, which is why the
chunked kernel exists. Every exp is exp2(x * log2(e)), as in the course's kernels.

The program compiles and looks right, and carries one known bug, one that no compiler sees. Find it
and fix it. Without a GPU the tests run the program through the course's tile interpreter
(stages.common.interpreter): in float64 it must equal reference A, in fp16 match it within fp16's
rounding. With nvcc they compile it for sm_90a, and on a GPU they run it.
Read: stage 2 page, "s02.kernel_program".  Check: course check s02
"""

from stages.common.tilelang_tools import LOG2_E
from stages.s02_scalar_decay.kernel import DEFAULT_BLOCK_DV


def build_recurrent_program(B, N, H, d_k, d_v, block_dv=DEFAULT_BLOCK_DV, dtype="float16", threads=128):
    """The token-by-token program for q, k: (B, N, H, d_k), v: (B, N, H, d_v) in `dtype`, g: (H,) fp32
    -> o: (B, N, H, d_v) in `dtype`. State S^T: (d_k, block_dv) per program, fp32.

    block_dv must divide d_v; N is any length (no chunks, no padding).
    """
    import tilelang.language as T

    accum_dtype = "float32"

    @T.prim_func
    def scalar_decay_recurrent(
        Q: T.Tensor((B, N, H, d_k), dtype),
        K: T.Tensor((B, N, H, d_k), dtype),
        V: T.Tensor((B, N, H, d_v), dtype),
        G: T.Tensor((H,), accum_dtype),
        O: T.Tensor((B, N, H, d_v), dtype),
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv

            q_s = T.alloc_shared((d_k,), accum_dtype)
            k_s = T.alloc_shared((d_k,), accum_dtype)
            v_s = T.alloc_shared((block_dv,), accum_dtype)

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state: lives across the tokens
            product_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # q ⊙ S^T, summed over d
            o_f = T.alloc_fragment((block_dv,), accum_dtype)
            alpha = T.alloc_var(accum_dtype)  # the head's decay per token, the same at every step

            # EXERCISE BEGIN
            alpha = T.exp2(G[h] * LOG2_E)
            T.clear(S_f)
            for t in T.serial(N):
                for d in T.Parallel(d_k):
                    q_s[d] = Q[b, t, h, d]
                    k_s[d] = K[b, t, h, d]
                for j in T.Parallel(block_dv):
                    v_s[j] = V[b, t, h, v0 + j]
                # the old state fades, the token's key and value are added undecayed
                for d, j in T.Parallel(d_k, block_dv):
                    S_f[d, j] = alpha * S_f[d, j] + k_s[d] * v_s[j]
                    product_f[d, j] = q_s[d] * S_f[d, j]
                T.reduce_sum(product_f, o_f, dim=0)
                T.copy(o_f, O[b, t, h, v0:v0 + block_dv])
            # EXERCISE END

    return scalar_decay_recurrent
