"""Stage 2 kernel: chunked linear attention with a constant decay per head, in TileLang.

One program per (block of d_v columns, batch x head). Each program keeps its slice of the state,
S^T (d_k x block_dv), in registers as an fp32 fragment for the whole sequence, and walks the chunks
in a pipelined loop (the copies of chunk i+1 overlap the GEMMs of chunk i). alpha = e^g is the
head's constant, so every decay the chunks need depends on the head only: the program builds them
once, before the chunk loop, from G (H,) in float32 (every exp is exp2(x * log2(e))):

    decay[r, j]      = alpha^(r - j) for j <= r, else 0    the table Gamma, the causal mask folded in
    query_decay[r]   = alpha^(r + 1)                       from the chunk start to row r (0-based r)
    key_decay[r]     = alpha^(C - 1 - r)                   from row r to the chunk end
    state_decay      = alpha^C                             across the whole chunk

    acc_o  = Q S^T,  then row r times query_decay[r]      inter-chunk term
    acc_o += (Q K^T ⊙ decay) V                             intra-chunk term
    O      = acc_o                                         written before ...
    S^T    = state_decay S^T + K^T (key_decay ⊙ V)         ... the state moves on

Comments name the seed's ordering constraints where they apply ("constraint 1" to "7", listed on
stage 4's page; stages.common.ordering checks 1, 2 and 7 on the TIR).

Run `python -m stages.s02_scalar_decay.kernel` to compile it for sm_90a and print its ptxas
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
    """The TileLang program for q, k: (B, N, H, d_k), v: (B, N, H, d_v), g: (H,) float32
    -> o: (B, N, H, d_v).

    N must be a multiple of chunk_size (the wrapper pads), block_dv must divide d_v.
    """
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    num_chunks = N // C

    @T.prim_func
    def scalar_decay_fwd(
        Q: T.Tensor((B, N, H, d_k), dtype),
        K: T.Tensor((B, N, H, d_k), dtype),
        V: T.Tensor((B, N, H, d_v), dtype),
        G: T.Tensor((H,), accum_dtype),
        O: T.Tensor((B, N, H, d_v), dtype),
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv

            Q_s = T.alloc_shared((C, d_k), dtype)
            K_s = T.alloc_shared((C, d_k), dtype)
            V_s = T.alloc_shared((C, block_dv), dtype)
            V_decayed_s = T.alloc_shared((C, block_dv), dtype)  # key_decay ⊙ V: V_s stays as loaded
            S_s = T.alloc_shared((d_k, block_dv), dtype)  # the state as a GEMM operand
            scores_s = T.alloc_shared((C, C), dtype)
            key_decay_s = T.alloc_shared((C,), accum_dtype)  # read with V_s's layout, not acc_o's

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state: lives across chunks
            scores = T.alloc_fragment((C, C), accum_dtype)
            acc_o = T.alloc_fragment((C, block_dv), accum_dtype)
            decay = T.alloc_fragment((C, C), accum_dtype)  # Gamma: lives across chunks
            query_decay = T.alloc_fragment((C,), accum_dtype)
            state_decay = T.alloc_var(accum_dtype)

            # the head's decays, once per program: a difference of positions times log2(alpha),
            # never a power of alpha divided by another (that form overflows; see Numerics)
            log2_alpha = G[h] * LOG2_E
            for r, j in T.Parallel(C, C):
                decay[r, j] = T.if_then_else(j <= r, T.exp2((r - j) * log2_alpha), 0)
            for r in T.Parallel(C):
                query_decay[r] = T.exp2((r + 1) * log2_alpha)
                key_decay_s[r] = T.exp2((C - 1 - r) * log2_alpha)
            state_decay = T.exp2(C * log2_alpha)

            T.clear(S_f)  # once, outside the chunk loop: the state carries over (constraint 7)
            for i_c in T.Pipelined(num_chunks, num_stages=num_stages):
                t0 = i_c * C
                T.copy(Q[b, t0:t0 + C, h, :], Q_s)
                T.copy(K[b, t0:t0 + C, h, :], K_s)
                T.copy(V[b, t0:t0 + C, h, v0:v0 + block_dv], V_s)

                # intra-chunk scores Q K^T times the decay table, which also masks j > r
                T.gemm(Q_s, K_s, scores, transpose_B=True, clear_accum=True)
                for r, j in T.Parallel(C, C):
                    scores_s[r, j] = scores[r, j] * decay[r, j]

                # the inter-chunk and intra-chunk terms into one accumulator (constraint 7: clear_accum)
                T.copy(S_f, S_s)
                T.gemm(Q_s, S_s, acc_o, clear_accum=True)
                for r, c in T.Parallel(C, block_dv):
                    acc_o[r, c] *= query_decay[r]  # the inter-chunk term, decayed per row
                T.gemm(scores_s, V_s, acc_o)
                T.copy(acc_o, O[b, t0:t0 + C, h, v0:v0 + block_dv])

                # only now does the state move past this chunk (constraint 1): decay it first (constraint 2), then add
                # K^T (key_decay ⊙ V) (a scalar per row, so it may go on V, the smaller operand)
                for r, c in T.Parallel(C, block_dv):
                    V_decayed_s[r, c] = V_s[r, c] * key_decay_s[r]
                for d, c in T.Parallel(d_k, block_dv):
                    S_f[d, c] *= state_decay
                T.gemm(K_s, V_decayed_s, S_f, transpose_A=True)

    return scalar_decay_fwd
# --8<-- [end:program]


@functools.cache
def _compiled(B, N, H, d_k, d_v, chunk_size, block_dv, dtype, num_stages, threads):
    import tilelang

    program = build_program(B, N, H, d_k, d_v, chunk_size, block_dv, dtype, num_stages, threads)
    return tilelang.compile(program, out_idx=[4], target="cuda")


# --8<-- [start:forward]
def forward(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor",
            chunk_size: int = DEFAULT_CHUNK_SIZE, block_dv: int = DEFAULT_BLOCK_DV, num_stages: int = 2,
            threads: int = 128, checks: str = "host") -> "torch.Tensor":
    """Run the kernel on CUDA tensors q, k: (B, N, H, d_k), v: (B, N, H, d_v), fp16 or bf16, and
    g = log(alpha): (H,) float32, finite and <= 0.

    Returns o: (B, N, H, d_v) in the input dtype. N need not be a multiple of chunk_size: the
    sequence is zero-padded, which is exact (see reference.kernel_mirror). checks="host" (the
    default) reads g's values to the host and refuses a bad one (a pass over g and a device sync);
    "off" skips that: the caller vouches for them. The kernel sets no value flags, so stage 5's
    "device" is not a mode here (stages.common.device_checks.HOST_CHECKS).
    """
    check_mode(checks, HOST_CHECKS)
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate("g", g, (H,), "(H,)")
    check_tile_sizes(d_k, d_v, chunk_size, block_dv)
    if checks == "host":
        check_gate_values(g)
    check_on_cuda({"q": q, "k": k, "v": v, "g": g})

    N_padded = padded_length(N, chunk_size)
    q, k, v = pad_tokens(N_padded, q, k, v)
    kernel = _compiled(B, N_padded, H, d_k, d_v, chunk_size, block_dv, dtype_name(q), num_stages, threads)
    return kernel(q, k, v, g)[:, :N]
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
    from stages.s02_scalar_decay.reference import recurrent

    print("sm_90a:", compile_report().summary())
    if not torch.cuda.is_available():
        print("no CUDA device: compile-only")
        return
    x = make_inputs(2, 1024, 4, 128, 128, gate="head", seed=0)
    expected = recurrent(x.q, x.k, x.v, x.g)
    q, k, v = (torch.tensor(a, dtype=torch.float16, device="cuda") for a in (x.q, x.k, x.v))
    g = torch.tensor(x.g, dtype=torch.float32, device="cuda")
    print("fp16 kernel vs reference A:", error_report(forward(q, k, v, g), expected))


if __name__ == "__main__":
    main()
