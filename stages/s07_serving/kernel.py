"""Stage 7's kernels: the KDA decode step over a pool of states, and prefill of packed batches, from the
fast path's package (stages.kda), which this stage teaches:

    decode    stages.kda.decode.build_decode_program, run by stages.kda.calls.decode: one program per
              (value block, batch x head) reads its state's slice from the pool at slots[b], advances it
              by one token and writes it back in place
    prefill   stages.kda.calls.prefill: a packed batch (FLA's cu_seqlens), each sequence from its own
              initial state, in two launches and no copy of the tokens: the prepare with packed loads
              (one program per row of the chunk table, chunk-aligned outputs) and the recurrence walking
              each sequence's chunks (stages.kda.prepare, stages.kda.recurrence with `packed`)

The names below are the ones the stage's page and exercises use. Run `python -m stages.s07_serving.kernel`
to compile the kernels for sm_90a and print their ptxas reports (no GPU needed), or to check them against
the references on a GPU.
"""

import numpy as np

from stages.kda import compiled
from stages.kda.calls import decode, prefill, varlen_forward, varlen_index
from stages.kda.config import DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE, DEFAULT_THREADS, most_chunks
from stages.kda.decode import build_decode_program

__all__ = ["DEFAULT_BLOCK_DV", "DEFAULT_CHUNK_SIZE", "DEFAULT_THREADS", "build_decode_program", "compile_report",
           "decode", "most_chunks", "prefill", "varlen_compile_report", "varlen_forward", "varlen_index"]


def compile_report(B=64, P=256, H=32, d_k=128, d_v=128, block_dv=DEFAULT_BLOCK_DV, dtype="bfloat16",
                   threads=DEFAULT_THREADS):
    """The decode kernel (with its value flags, decode's default) lowered and compiled for sm_90a."""
    return compiled.compile_report("decode", B=B, P=P, H=H, d_k=d_k, d_v=d_v, block_dv=block_dv, dtype=dtype,
                                   threads=threads, value_flags=True)


def varlen_compile_report(kernel="recurrence", H=32, d_k=128, d_v=128, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=64,
                          dtype="bfloat16", value_flags=False):
    """One of prefill's kernels ("prepare" or "recurrence", packed) lowered and compiled for sm_90a as
    prefill compiles them: the token, row, chunk and sequence counts run-time sizes."""
    return compiled.compile_report(kernel, H=H, d_k=d_k, d_v=d_v, chunk_size=chunk_size, block_dv=block_dv,
                                   dtype=dtype, value_flags=value_flags, packed=True)


def main():
    import torch

    from stages.common.errors import error_report
    from stages.common.inputs import l2_normalize
    from stages.s07_serving.reference import decode_step

    print("decode sm_90a:", compile_report().summary())
    for kernel in ("prepare", "recurrence"):
        print(f"prefill's {kernel} sm_90a:", varlen_compile_report(kernel).summary())
    if not torch.cuda.is_available():
        print("no CUDA device: compile-only")
        return
    rng = np.random.default_rng(0)
    B, P, H, D = 8, 32, 4, 128
    q, k = (l2_normalize(rng.standard_normal((B, H, D))) for _ in range(2))
    v = rng.standard_normal((B, H, D))
    g, beta = np.log(rng.uniform(0.9, 0.999, (B, H, D))), rng.uniform(0.1, 0.9, (B, H))
    pool = rng.standard_normal((P, H, D, D)).astype(np.float32).astype(np.float64) * 0.1
    slots = rng.permutation(P)[:B].astype(np.int32)
    expected_pool = pool.copy()
    expected = decode_step(q, k, v, g, beta, expected_pool, slots)
    for dtype in (torch.float16, torch.bfloat16):
        pool_gpu = torch.tensor(pool, dtype=torch.float32, device="cuda")
        o, _ = decode(*(torch.tensor(a, dtype=dtype, device="cuda") for a in (q, k, v)),
                      *(torch.tensor(a, dtype=torch.float32, device="cuda") for a in (g, beta)), pool_gpu,
                      torch.tensor(slots, device="cuda"))
        print(f"{dtype} o vs reference:", error_report(o, expected))
        print(f"{dtype} pool vs reference:", error_report(pool_gpu, expected_pool))


if __name__ == "__main__":
    main()
