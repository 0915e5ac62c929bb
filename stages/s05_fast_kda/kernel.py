"""Stage 5's kernels: the KDA forward as two TileLang kernels, prepare and recurrence, from the fast
path's package (stages.kda), which this stage teaches:

    prepare      stages.kda.prepare.build_prepare_program: one program per (chunk, batch x head), no state
    recurrence   stages.kda.recurrence.build_recurrence_program: one program per (value block, batch x head),
                 the state in registers for the whole sequence
    forward      stages.kda.calls.forward: both, on CUDA tensors

The names below are the ones the stage's page and exercises use. Run `python -m stages.s05_fast_kda.kernel`
to compile both kernels for sm_90a and print their ptxas reports (no GPU needed), or to check them against
the float64 references (and FLA, if installed) on a GPU.
"""

from stages.kda import compiled
from stages.kda.calls import forward
from stages.kda.config import CHANNEL_PASSES, DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE, SUB_BLOCK, default_prepare_threads
from stages.kda.prepare import build_prepare_program
from stages.kda.recurrence import build_recurrence_program
from stages.kda.tiles import advance_state_macro, chunk_output_macro, exact_diagonal_block_macro

__all__ = ["CHANNEL_PASSES", "DEFAULT_BLOCK_DV", "DEFAULT_CHUNK_SIZE", "SUB_BLOCK", "advance_state_macro",
           "build_prepare_program", "build_recurrence_program", "chunk_output_macro", "compile_report",
           "default_prepare_threads", "exact_diagonal_block_macro", "forward"]

compile_report = compiled.compile_report  # the page's: prepare or recurrence, fp16, B 1, N 4096, H 8, d 128


def main():
    import torch

    from stages.common.errors import error_report
    from stages.common.inputs import make_inputs
    from stages.s05_fast_kda.reference import recurrent

    for kernel in ("prepare", "recurrence"):
        print(f"{kernel} sm_90a:", compiled.compile_report(kernel).summary())
    if not torch.cuda.is_available():
        print("no CUDA device: compile-only")
        return
    x = make_inputs(2, 1024, 4, 128, 128, gate="channel", beta_range=(0.1, 0.9), seed=0)
    expected = recurrent(x.q, x.k, x.v, x.g, x.beta)
    g, beta = (torch.tensor(a, dtype=torch.float32, device="cuda") for a in (x.g, x.beta))
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v = (torch.tensor(a, dtype=dtype, device="cuda") for a in (x.q, x.k, x.v))
        o, _ = forward(q, k, v, g, beta)
        print(f"{dtype} kernels vs reference A:", error_report(o, expected))
        try:
            from fla.ops import chunk_kda
        except ImportError:
            continue
        fla_output = chunk_kda(q, k, v, g, beta, scale=1.0)[0]
        print(f"{dtype} FLA chunk_kda vs reference A:", error_report(fla_output, expected))


if __name__ == "__main__":
    main()
