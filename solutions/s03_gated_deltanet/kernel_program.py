"""Exercise s03.kernel_program (fix): Gated DeltaNet token by token, a TileLang program of its own.

Not the chunked kernel of this stage (that one is exercise s03.build_kernel): reference A's
recurrence as a program, one token at a time, the way a decode step runs it. One program per (block
of d_v columns, batch x head) keeps its slice of the state S^T (d_k x block_dv) in registers as an
fp32 fragment and, for each token t,

    S^T <- alpha_t S^T                           the decay, one number for the whole state
    u   =  beta_t (v_t - (S^T)^T k_t)            what the decayed state does not yet hold for k_t
    S^T <- S^T + k_t u^T                          the write
    o_t =  (S^T)^T q_t                            the output, read from the updated state

which is S_t = alpha_t S_{t-1} (I - beta_t k_t k_t^T) + beta_t v_t k_t^T in the kernel layout: the
delta rule's delete and write as one correction. The two products with a vector are element-wise
products summed over the key channels (T.reduce_sum): no tensor cores, d_k x block_dv of work per
token on the CUDA cores, which is why the chunked kernel exists.

The program compiles and looks right, and carries one known bug, one that no compiler sees. Find it
and fix it. Without a GPU the tests run the program through the course's tile interpreter
(stages.common.interpreter): in float64 it must equal reference A, in fp16 match it within fp16's
rounding. With nvcc they compile it for sm_90a, and on a GPU they run it.
Read: stage 3 page, "s03.kernel_program".  Check: course check s03
"""

from stages.common.tilelang_tools import LOG2_E
from stages.s03_gated_deltanet.kernel import DEFAULT_BLOCK_DV


def build_recurrent_program(B, N, H, d_k, d_v, block_dv=DEFAULT_BLOCK_DV, dtype="float16", threads=128):
    """The token-by-token program for q, k: (B, N, H, d_k), v: (B, N, H, d_v) in `dtype`, g and beta:
    (B, N, H) in fp32 -> o: (B, N, H, d_v) in `dtype`. State S^T: (d_k, block_dv) per program, fp32.

    block_dv must divide d_v; N is any length (no chunks, no padding).
    """
    import tilelang.language as T

    accum_dtype = "float32"

    @T.prim_func
    def gated_deltanet_recurrent(
        Q: T.Tensor((B, N, H, d_k), dtype),
        K: T.Tensor((B, N, H, d_k), dtype),
        V: T.Tensor((B, N, H, d_v), dtype),
        G: T.Tensor((B, N, H), accum_dtype),
        Beta: T.Tensor((B, N, H), accum_dtype),
        O: T.Tensor((B, N, H, d_v), dtype),
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv

            q_s = T.alloc_shared((d_k,), accum_dtype)
            k_s = T.alloc_shared((d_k,), accum_dtype)
            v_s = T.alloc_shared((block_dv,), accum_dtype)

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state: lives across the tokens
            product_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # k ⊙ S^T, then q ⊙ S^T
            recalled_f = T.alloc_fragment((block_dv,), accum_dtype)  # (S^T)^T k: what the state holds for k
            u_f = T.alloc_fragment((block_dv,), accum_dtype)  # beta (v - recalled)
            o_f = T.alloc_fragment((block_dv,), accum_dtype)

            # EXERCISE BEGIN
            T.clear(S_f)
            for t in T.serial(N):
                for d in T.Parallel(d_k):
                    q_s[d] = Q[b, t, h, d]
                    k_s[d] = K[b, t, h, d]
                for j in T.Parallel(block_dv):
                    v_s[j] = V[b, t, h, v0 + j]

                # the decay first, then what the decayed state recalls for k
                for d, j in T.Parallel(d_k, block_dv):
                    S_f[d, j] *= T.exp2(G[b, t, h] * LOG2_E)
                    product_f[d, j] = k_s[d] * S_f[d, j]
                T.reduce_sum(product_f, recalled_f, dim=0)
                for j in T.Parallel(block_dv):
                    u_f[j] = Beta[b, t, h] * (v_s[j] - recalled_f[j])

                # the write, then the output read from the updated state
                for d, j in T.Parallel(d_k, block_dv):
                    S_f[d, j] += k_s[d] * u_f[j]
                    product_f[d, j] = q_s[d] * S_f[d, j]
                T.reduce_sum(product_f, o_f, dim=0)
                T.copy(o_f, O[b, t, h, v0:v0 + block_dv])
            # EXERCISE END

    return gated_deltanet_recurrent
