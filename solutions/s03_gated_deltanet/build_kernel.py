"""Exercise s03.build_kernel (build): stage 3's TileLang kernel, written whole from an empty body.

Write build_program so that it returns a `@T.prim_func` computing the chunked Gated DeltaNet forward,
as reference C does (exercise s03.kernel_mirror: your kernel_mirror.py beside this file): per chunk, the UT
transform of its keys and values by a forward substitution, the pseudo-values V_new = U - W S^T, the
output, and the state's move past the chunk. Any correct program passes: choose your own grid,
tiles, pairing of beta and order, within what the tests below ask.

What is given, and what the tests need:
- the signature below, and the parameters of the prim_func in this order: Q, K, V, G, Beta (inputs;
  G the log gate and Beta the write strength per token, float32 of shape (B, N, H)), O (the output,
  written once per element);
- the layout: the state is kept as S^T (d_k x d_v), as in reference C; a program may own a block of
  block_dv of its columns;
- the buffer names that the ordering check reads in your TIR (stages.common.ordering): the state is
  an fp32 fragment `S_f` that lives across the chunk loop, its copy that the products read is the
  shared buffer `S_s`, and each chunk's output is summed in the fp32 fragment `acc_o`; the state's
  decay is a store into `S_f` (an element-wise loop), its update a `T.gemm` into `S_f`;
- the chunk loop is the program's one `T.Pipelined` loop; every exp is exp2(x * log2(e)).

The tests (tests/exercises/s03_gated_deltanet/test_build_kernel.py), all on a CPU:
- float64 through the tile interpreter equals reference C, with one chunk and with several chunks
  and two blocks of value columns, gates a in [0.5, 0.99], beta varying per token, and with some
  beta at 0 and some at 1; fp16 is within fp16's rounding of reference A;
- strong gates: some tokens with g = -50, in float64 and fp16;
- a length that is not a multiple of the chunk, zero-padded as the wrapper pads it (g = 0, beta = 0);
- the program writes O and nothing else (the inputs are unchanged);
- ordering constraints 1, 2 and 7: the output reads the state before the chunk changes it; the state
  decays before the product adds the chunk to it; the state is cleared once, before the chunk loop,
  the output accumulator in every chunk;
- the cost at B = 1, N = 1024, H = 4, d_k = d_v = 128, your tile defaults: at most 1.25 times the
  course kernel's global bytes and GEMM FLOPs, and at least half its GEMM FLOPs, as
  stages.common.program_cost counts them from your TIR (a tile loaded from global memory twice goes
  over; products summed element by element, off the tensor cores, fall short; the tune exercise asks
  for more);
- the H200's budget at d_k = d_v = 128, chunk_size = 64: at most 227 KiB of shared memory per block
  (counted from your TIR); with `course check s03 --compile` (nvcc), no register spills.
Read: stage 3 page, "s03.build_kernel".  Check: course check s03
"""

from stages.common.tilelang_tools import LOG2_E
from stages.s03_gated_deltanet.kernel import DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE


def build_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=DEFAULT_BLOCK_DV,
                  dtype="float16", num_stages=2, threads=128):
    """The TileLang program for q, k: (B, N, H, d_k), v: (B, N, H, d_v), g: (B, N, H) fp32,
    beta: (B, N, H) fp32 -> o: (B, N, H, d_v). State S^T: (d_k, block_dv) per program.

    N must be a multiple of chunk_size (the wrapper pads), block_dv must divide d_v.
    """
    # EXERCISE BEGIN
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    num_chunks = N // C
    width = d_k + block_dv  # the columns of [K ⊙ e^{gamma} | V], solved together

    @T.prim_func
    def gated_deltanet_fwd(
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

            Q_s = T.alloc_shared((C, d_k), dtype)
            K_s = T.alloc_shared((C, d_k), dtype)
            V_s = T.alloc_shared((C, block_dv), dtype)
            gamma_s = T.alloc_shared((C,), accum_dtype)
            beta_s = T.alloc_shared((C,), accum_dtype)
            L_s = T.alloc_shared((C, C), accum_dtype)  # every thread reads row r of L
            X_s = T.alloc_shared((C, width), accum_dtype)  # [K ⊙ e^{gamma} | V], solved in place
            W_s = T.alloc_shared((C, d_k), dtype)
            S_s = T.alloc_shared((d_k, block_dv), dtype)  # the state as a GEMM operand
            A_qk_s = T.alloc_shared((C, C), dtype)
            V_new_s = T.alloc_shared((C, block_dv), dtype)

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state: lives across chunks
            Gamma = T.alloc_fragment((C, C), accum_dtype)
            scores = T.alloc_fragment((C, C), accum_dtype)  # K K^T, then Q K^T
            W_S = T.alloc_fragment((C, block_dv), accum_dtype)
            acc_o = T.alloc_fragment((C, block_dv), accum_dtype)

            T.clear(S_f)  # once, outside the chunk loop: the state carries over
            for i_c in T.Pipelined(num_chunks, num_stages=num_stages):
                t0 = i_c * C
                T.copy(Q[b, t0:t0 + C, h, :], Q_s)
                T.copy(K[b, t0:t0 + C, h, :], K_s)
                T.copy(V[b, t0:t0 + C, h, v0:v0 + block_dv], V_s)
                # gamma restarts at every chunk; each row sums its own prefix (C threads, no scan)
                for r in T.Parallel(C):
                    beta_s[r] = Beta[b, t0 + r, h]
                    gamma_s[r] = 0
                    for j in T.serial(r + 1):
                        gamma_s[r] += G[b, t0 + j, h]

                # the decay table; above the diagonal the exponent is positive and unused
                for c, i in T.Parallel(C, C):
                    Gamma[c, i] = T.if_then_else(i <= c, T.exp2((gamma_s[c] - gamma_s[i]) * LOG2_E), 0)

                # L[c, i] = beta_i e^{gamma_c - gamma_i} k_c . k_i, strictly below the diagonal
                T.gemm(K_s, K_s, scores, transpose_B=True, clear_accum=True)
                for c, i in T.Parallel(C, C):
                    L_s[c, i] = T.if_then_else(i < c, beta_s[i] * scores[c, i] * Gamma[c, i], 0)
                # A_qk[c, j] = e^{gamma_c - gamma_j} q_c . k_j, the diagonal included
                T.gemm(Q_s, K_s, scores, transpose_B=True, clear_accum=True)
                for c, j in T.Parallel(C, C):
                    A_qk_s[c, j] = T.if_then_else(j <= c, scores[c, j] * Gamma[c, j], 0)

                # the right-hand sides [K ⊙ e^{gamma} | V], solved together
                for r, d in T.Parallel(C, d_k):
                    X_s[r, d] = K_s[r, d] * T.exp2(gamma_s[r] * LOG2_E)
                for r, j in T.Parallel(C, block_dv):
                    X_s[r, d_k + j] = V_s[r, j]

                # one forward substitution for both right-hand sides: row r needs rows j < r solved
                for r in T.serial(1, C):
                    for col in T.Parallel(width):
                        for j in T.serial(r):
                            X_s[r, col] -= L_s[r, j] * X_s[j, col]
                # beta only now, after the solve: diag(beta) T, the pairing of L[c, i] = beta_i M[c, i]
                for r, d in T.Parallel(C, d_k):
                    W_s[r, d] = beta_s[r] * X_s[r, d]
                T.copy(S_f, S_s)
                T.gemm(W_s, S_s, W_S, clear_accum=True)
                for r, j in T.Parallel(C, block_dv):
                    V_new_s[r, j] = beta_s[r] * X_s[r, d_k + j] - W_S[r, j]  # U - W S^T

                # Q K^T is done, so Q_s may now take its decay: Q ⊙ e^{gamma}
                for r, d in T.Parallel(C, d_k):
                    Q_s[r, d] = Q_s[r, d] * T.exp2(gamma_s[r] * LOG2_E)
                T.gemm(Q_s, S_s, acc_o, clear_accum=True)
                T.gemm(A_qk_s, V_new_s, acc_o)
                T.copy(acc_o, O[b, t0:t0 + C, h, v0:v0 + block_dv])

                # only now does the state move past this chunk: decay it first, then add
                # (K ⊙ e^{gamma_C - gamma})^T V_new, the chunk's keys decayed to the chunk's end
                for d, j in T.Parallel(d_k, block_dv):
                    S_f[d, j] *= T.exp2(gamma_s[C - 1] * LOG2_E)
                for r, d in T.Parallel(C, d_k):
                    K_s[r, d] = K_s[r, d] * T.exp2((gamma_s[C - 1] - gamma_s[r]) * LOG2_E)
                T.gemm(K_s, V_new_s, S_f, transpose_A=True)

    return gated_deltanet_fwd
    # EXERCISE END
