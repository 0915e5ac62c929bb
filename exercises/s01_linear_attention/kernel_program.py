"""Exercise s01.kernel_program (fill): linear attention token by token, a TileLang program of its own.

Not the chunked kernel of this stage (that one is exercise s01.build_kernel): reference A's
recurrence as a program, one token at a time, the way a decode step runs it. One program per (block
of d_v columns, batch x head) keeps its slice of the state S^T (d_k x block_dv) in registers as an
fp32 fragment and, for each token t,

    S^T <- S^T + k_t v_t^T                        the token's write
    o_t =  (S^T)^T q_t                            the output, read from the updated state

The token's q, k and v are loaded into shared vectors for you; fill in the rest of the step: the
write, then the output, a column of element-wise products summed over the key channels
(T.reduce_sum sums a fragment along one axis into another), stored to O. Every buffer you need is
allocated above the loop. There are no tensor cores here: d_k x block_dv of work per token on the
CUDA cores, which is why the chunked kernel exists.

Without a GPU the tests run your program through the course's tile interpreter
(stages.common.interpreter) and compare it with reference A; with nvcc they also compile it for
sm_90a, and on a GPU they run it.
Read: stage 1 page, "s01.kernel_program".  Check: course check s01
"""

from stages.s01_linear_attention.kernel import DEFAULT_BLOCK_DV


def build_recurrent_program(B, N, H, d_k, d_v, block_dv=DEFAULT_BLOCK_DV, dtype="float16", threads=128):
    """The token-by-token program for q, k: (B, N, H, d_k), v: (B, N, H, d_v) in `dtype` -> o: (B, N,
    H, d_v) in `dtype`. State S^T: (d_k, block_dv) per program, fp32.

    block_dv must divide d_v; N is any length (no chunks, no padding).
    """
    import tilelang.language as T

    accum_dtype = "float32"

    @T.prim_func
    def linear_attention_recurrent(
        Q: T.Tensor((B, N, H, d_k), dtype),
        K: T.Tensor((B, N, H, d_k), dtype),
        V: T.Tensor((B, N, H, d_v), dtype),
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

            T.clear(S_f)  # once, before the token loop: the state carries over
            for t in T.serial(N):
                for d in T.Parallel(d_k):
                    q_s[d] = Q[b, t, h, d]
                    k_s[d] = K[b, t, h, d]
                for j in T.Parallel(block_dv):
                    v_s[j] = V[b, t, h, v0 + j]

                # EXERCISE BEGIN
                raise NotImplementedError("s01.kernel_program: fill this region; see the docstring and the page")
                # EXERCISE END

    return linear_attention_recurrent
