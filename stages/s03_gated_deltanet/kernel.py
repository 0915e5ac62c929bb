"""Stage 3 kernel: the chunked Gated DeltaNet forward in TileLang.

One program per (block of d_v columns, batch x head). Each program keeps its slice of the state,
S^T (d_k x block_dv), in registers as an fp32 fragment for the whole sequence, and walks the chunks
in a pipelined loop. Per chunk, with gamma the cumulative log gate from the chunk start, one per
token (C of them; kernel layout throughout; reference.kernel_mirror is this control flow in NumPy):

    gamma  = cumsum(g)                               in shared memory, one row per thread
    Gamma  = e^{gamma_c - gamma_i} for i <= c         the decay table, C x C
    L      = strict(K K^T ⊙ Gamma) diag(beta)         GEMM, then the mask
    A_qk   = incl(Q K^T ⊙ Gamma)                      GEMM, then the mask
    X      = (I + L)^{-1} [K ⊙ e^{gamma} | V]          forward substitution, C serial steps
    W, U   = diag(beta) X                             beta after the solve
    V_new  = U - W S^T                                GEMM
    O      = (Q ⊙ e^{gamma}) S^T + A_qk V_new          two GEMMs into one accumulator, written ...
    S^T    = e^{gamma_C} S^T + (K ⊙ e^{gamma_C - gamma})^T V_new      ... before the state moves on

Comments name the seed's ordering constraints where they apply ("constraint 1" to "7", listed on
stage 4's page; stages.common.ordering checks 1, 2 and 7 on the TIR).

Run `python -m stages.s03_gated_deltanet.kernel` to compile it for sm_90a and print its ptxas
report (no GPU needed), or to check it against reference A on a GPU.
"""

import functools
from typing import TYPE_CHECKING

from stages.common.checks import padded_length
from stages.common.device_checks import HOST_CHECKS, check_mode
from stages.common.tilelang_tools import LOG2_E
from stages.common.tilelang_tools import compile_report as _compile_report
from stages.common.torch_checks import (check_gate, check_gate_values, check_on_cuda, check_qkv, check_tile_sizes,
                                        dtype_name, pad_tokens)

if TYPE_CHECKING:
    import torch

DEFAULT_CHUNK_SIZE = 64
DEFAULT_BLOCK_DV = 32


# --8<-- [start:program]
def build_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=DEFAULT_BLOCK_DV,
                  dtype="float16", num_stages=2, threads=128):
    """The TileLang program for q, k: (B, N, H, d_k), v: (B, N, H, d_v), g: (B, N, H) fp32,
    beta: (B, N, H) fp32 -> o: (B, N, H, d_v). State S^T: (d_k, block_dv) per program.

    N must be a multiple of chunk_size (the wrapper pads), block_dv must divide d_v.
    """
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    num_chunks = N // C
    width = d_k + block_dv  # the columns of [K ⊙ e^{gamma} | V], solved together

    @T.prim_func
    def gated_delta_rule_fwd(
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

            T.clear(S_f)  # once, outside the chunk loop: the state carries over (constraint 7)
            for i_c in T.Pipelined(num_chunks, num_stages=num_stages):
                t0 = i_c * C
                T.copy(Q[b, t0:t0 + C, h, :], Q_s)
                T.copy(K[b, t0:t0 + C, h, :], K_s)
                T.copy(V[b, t0:t0 + C, h, v0:v0 + block_dv], V_s)
                # the gates are read by the threads that use them, outside the copy pipeline, so
                # that no prefetch of the next chunk can overwrite them while this chunk reads them
                for r in T.Parallel(C):
                    beta_s[r] = Beta[b, t0 + r, h]
                    # gamma restarts at every chunk; each row sums its own prefix (C threads, no scan)
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
                # constraint 6: beta only now, after the solve: diag(beta) T, the pairing of L[c, i] = beta_i M[c, i]
                for r, d in T.Parallel(C, d_k):
                    W_s[r, d] = beta_s[r] * X_s[r, d]
                T.copy(S_f, S_s)
                T.gemm(W_s, S_s, W_S, clear_accum=True)
                for r, j in T.Parallel(C, block_dv):
                    V_new_s[r, j] = beta_s[r] * X_s[r, d_k + j] - W_S[r, j]  # U - W S^T

                # Q K^T is done, so Q_s may now take its decay: Q ⊙ e^{gamma}
                for r, d in T.Parallel(C, d_k):
                    Q_s[r, d] = Q_s[r, d] * T.exp2(gamma_s[r] * LOG2_E)
                # the inter-chunk and intra-chunk terms into one accumulator (constraint 7: clear_accum)
                T.gemm(Q_s, S_s, acc_o, clear_accum=True)
                T.gemm(A_qk_s, V_new_s, acc_o)
                T.copy(acc_o, O[b, t0:t0 + C, h, v0:v0 + block_dv])

                # only now does the state move past this chunk (constraint 1): decay it first (constraint 2), then add
                # (K ⊙ e^{gamma_C - gamma})^T V_new, the chunk's keys decayed to the chunk's end
                for d, j in T.Parallel(d_k, block_dv):
                    S_f[d, j] *= T.exp2(gamma_s[C - 1] * LOG2_E)
                for r, d in T.Parallel(C, d_k):
                    K_s[r, d] = K_s[r, d] * T.exp2((gamma_s[C - 1] - gamma_s[r]) * LOG2_E)
                T.gemm(K_s, V_new_s, S_f, transpose_A=True)

    return gated_delta_rule_fwd
# --8<-- [end:program]


@functools.cache
def _compiled(B, N, H, d_k, d_v, chunk_size, block_dv, dtype, num_stages, threads):
    import tilelang

    program = build_program(B, N, H, d_k, d_v, chunk_size, block_dv, dtype, num_stages, threads)
    return tilelang.compile(program, out_idx=[5], target="cuda")


# --8<-- [start:forward]
def forward(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
            chunk_size: int = DEFAULT_CHUNK_SIZE, block_dv: int = DEFAULT_BLOCK_DV, num_stages: int = 2,
            threads: int = 128, checks: str = "host") -> "torch.Tensor":
    """Run the kernel on CUDA tensors q, k: (B, N, H, d_k), v: (B, N, H, d_v), fp16 or bf16, and
    g = log(alpha), beta: (B, N, H), float32, with g <= 0 and 0 <= beta <= 1.

    Returns o: (B, N, H, d_v) in the input dtype. N need not be a multiple of chunk_size: the
    sequence is zero-padded, which is exact (see reference.kernel_mirror). checks="host" (the
    default) reads g's and beta's values to the host and refuses a bad one (passes over the gates, a
    device sync per check); "off" skips that: the caller vouches for them. The kernel sets no value
    flags, so stage 5's "device" is not a mode here (stages.common.device_checks.HOST_CHECKS).
    """
    check_mode(checks, HOST_CHECKS)
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate("g", g, (B, N, H), "(B, N, H)")
    check_gate("beta", beta, (B, N, H), "(B, N, H)")
    check_tile_sizes(d_k, d_v, chunk_size, block_dv)
    if checks == "host":
        check_gate_values(g, beta)
    check_on_cuda({"q": q, "k": k, "v": v, "g": g, "beta": beta})

    N_padded = padded_length(N, chunk_size)
    q, k, v, g, beta = pad_tokens(N_padded, q, k, v, g, beta)
    kernel = _compiled(B, N_padded, H, d_k, d_v, chunk_size, block_dv, dtype_name(q), num_stages, threads)
    return kernel(q, k, v, g, beta)[:, :N]
# --8<-- [end:forward]


@functools.cache  # the page's report and the compile test share one nvcc run
def compile_report(B=1, N=4096, H=8, d_k=128, d_v=128, chunk_size=DEFAULT_CHUNK_SIZE,
                   block_dv=DEFAULT_BLOCK_DV, dtype="float16", num_stages=2, threads=128):
    """Lower and compile the kernel for sm_90a without a GPU; see stages.common.tilelang_tools."""
    check_tile_sizes(d_k, d_v, chunk_size, block_dv)
    return _compile_report(build_program(B, N, H, d_k, d_v, chunk_size, block_dv, dtype, num_stages, threads))


def main():
    import torch

    from stages.common.errors import error_report
    from stages.common.inputs import make_inputs
    from stages.s03_gated_deltanet.reference import recurrent

    print("sm_90a:", compile_report().summary())
    if not torch.cuda.is_available():
        print("no CUDA device: compile-only")
        return
    x = make_inputs(2, 1024, 4, 128, 128, gate="token", beta_range=(0.1, 0.9), seed=0)
    expected = recurrent(x.q, x.k, x.v, x.g, x.beta)
    q, k, v = (torch.tensor(a, dtype=torch.float16, device="cuda") for a in (x.q, x.k, x.v))
    g, beta = (torch.tensor(a, dtype=torch.float32, device="cuda") for a in (x.g, x.beta))
    print("fp16 kernel vs reference A:", error_report(forward(q, k, v, g, beta), expected))


if __name__ == "__main__":
    main()
