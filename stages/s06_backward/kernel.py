"""Stage 6's kernels: the KDA backward as TileLang kernels, split as stage 5's forward is, from the fast
path's package (stages.kda), which this stage teaches:

    the kernels  stages.kda.backward: states, state_gradient, state_products, intra (their docstring
                 gives the math of each), after the forward's prepare with its solve outputs
    backward     stages.kda.calls.backward: the five launches (run_kernels), on CUDA tensors

The names below are the ones the stage's page and exercises use. Run `python -m stages.s06_backward.kernel`
to compile the four kernels for sm_90a and print their ptxas reports (no GPU needed), or to check the
backward against the float64 reference on a GPU.
"""

from stages.kda import compiled
from stages.kda.backward import (BUILDERS, build_intra_program, build_state_gradient_program,
                                 build_state_products_program, build_states_program, kernel_arguments)
from stages.kda.calls import backward, run_kernels
from stages.kda.config import DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE
from stages.kda.prepare import build_prepare_program
from stages.kda.recurrence import build_recurrence_program

# every builder a training step runs (the forward's two, the backward's four): the benchmarks digest
# the stage's results through this module (stages.common.program_digest follows the names it imports)
__all__ = ["BUILDERS", "DEFAULT_BLOCK_DV", "DEFAULT_CHUNK_SIZE", "KERNELS", "backward", "build_intra_program",
           "build_prepare_program", "build_recurrence_program", "build_state_gradient_program",
           "build_state_products_program", "build_states_program", "compile_report", "kernel_arguments", "run_kernels"]

KERNELS = ("states", "state_gradient", "state_products", "intra")  # the backward's own; prepare is the forward's


def compile_report(kernel="intra", B=1, N=4096, H=8, d_k=128, d_v=128, chunk_size=DEFAULT_CHUNK_SIZE,
                   block_dv=DEFAULT_BLOCK_DV, dtype="bfloat16"):
    """One of the backward's kernels lowered and compiled for sm_90a without a GPU."""
    return compiled.compile_report(kernel, B=B, N=N, H=H, d_k=d_k, d_v=d_v, chunk_size=chunk_size,
                                   block_dv=block_dv, dtype=dtype)


def main():
    import torch

    from stages.common.errors import error_report
    from stages.common.inputs import make_inputs
    from stages.s06_backward.reference import recurrent_backward

    for kernel in KERNELS:
        print(f"{kernel} sm_90a:", compile_report(kernel).summary())
    if not torch.cuda.is_available():
        print("no CUDA device: compile-only")
        return
    x = make_inputs(2, 1000, 4, 128, 128, gate="channel", gate_range=(0.5, 1.0), beta_range=(0.0, 1.0), seed=0)
    rng = torch.Generator().manual_seed(0)
    do = torch.randn(x.v.shape, generator=rng, dtype=torch.float64).numpy()
    expected = recurrent_backward(x.q, x.k, x.v, x.g, x.beta, do)
    g, beta = (torch.tensor(a, dtype=torch.float32, device="cuda") for a in (x.g, x.beta))
    for dtype in (torch.float16, torch.bfloat16):
        q, k, v, do_cuda = (torch.tensor(a, dtype=dtype, device="cuda") for a in (x.q, x.k, x.v, do))
        for name, actual in zip(("dq", "dk", "dv", "dg", "dbeta"), backward(q, k, v, g, beta, do_cuda)):
            print(f"{dtype} {name} vs reference A:", error_report(actual, getattr(expected, name)))


if __name__ == "__main__":
    main()
