"""Each of stage 6's backward kernels alone on a GPU, against reference C's buffers for it.

    python -m benchmarks.studies.s06_kernel_parts [--dtype bfloat16] [--intra-threads 128,256] [--time 1,16384,32]

The whole backward's GPU test says that a gradient is wrong; this says which kernel makes it wrong.
At B=1, N=256, H=2, d_k = d_v = 128, C = 64 (gates down to 0.5, both states, as the kernel tests
draw them), reference C (stages.s06_backward.reference) gives every kernel's inputs and expected
outputs in float64. Each kernel gets those inputs cast to its parameters' dtypes and prints the rel L2
of each output against reference C: within the dtype's rounding (a few 1e-3 in bf16) or not. The
intra kernel runs once per thread count of --intra-threads, which is how its 256-thread build was
found wrong (benchmarks/results/s06_intra_threads.log). With --time B,N,H the intra kernel is then
timed at each thread count at that shape (d = 128, its inputs random normal: the time does not
depend on the values), the median of triton's do_bench. Needs CUDA and TileLang.
"""

import argparse
import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from stages.common.errors import error_report
from stages.common.inputs import make_backward_inputs
from stages.s05_fast_kda import reference as stage5
from stages.s06_backward import reference
from stages.s06_backward.kernel import BUILDERS, build_intra_program

B, N, H, D, C, BLOCK_DV = 1, 256, 2, 128, 64, 32


def cases(dtype, intra_threads):
    """{name: (program, output indices, inputs, expected outputs)}, each from reference C."""
    x, do, S_0, dS_N = make_backward_inputs(B, N, H, D, D, seed=3)
    tensors = stage5.prepare(x.q, x.k, x.v, x.g, x.beta, C)
    states = reference.chunk_states(tensors, BLOCK_DV, S_0)
    state_grads = reference.state_gradients(tensors, do, BLOCK_DV, dS_N)
    products = reference.state_products(tensors, states, state_grads, do)
    intra = reference.intra_gradients(x.q, x.k, x.v, x.g, x.beta, do, states.v_new, state_grads.dv_new, products, C)

    def builder(name, *size):
        build, outputs = BUILDERS[name]
        return build(B, N, H, D, D, C, *size, dtype), outputs

    found = {
        "states": (*builder("states", BLOCK_DV), (tensors.w, tensors.u, tensors.k_to_chunk_end, tensors.chunk_decay, S_0),
                   (states.states, states.v_new)),
        "state_gradient": (*builder("state_gradient", BLOCK_DV),
                           (tensors.q_decayed, tensors.k_to_chunk_end, tensors.w, tensors.a_qk, tensors.chunk_decay,
                            do, dS_N),
                           (state_grads.d_states, state_grads.dv_new, state_grads.d_initial_state)),
        "state_products": (*builder("state_products"),
                           (states.states, state_grads.d_states, states.v_new, state_grads.dv_new, do,
                            tensors.chunk_decay),
                           (products.dq_decayed, products.dk_to_chunk_end, products.dw, products.d_gamma_last)),
    }
    intra_inputs = (x.q, x.k, x.v, x.g, x.beta, *reference.solve_outputs(x.k, x.g, x.beta, C), do, states.v_new,
                    state_grads.dv_new, products.dq_decayed, products.dk_to_chunk_end, products.dw,
                    products.d_gamma_last)
    for threads in intra_threads:
        found[f"intra at {threads} threads"] = (build_intra_program(B, N, H, D, D, C, dtype, threads=threads),
                                                BUILDERS["intra"][1], intra_inputs, intra)
    return found


def run(kernel, program, inputs):
    """The compiled kernel on `inputs` cast to its parameters' dtypes; its outputs in float64."""
    import torch

    dtypes = [str(program.buffer_map[param].dtype) for param in program.params]
    outputs = kernel(*(torch.tensor(np.ascontiguousarray(a)).to("cuda", getattr(torch, dtype))
                       for a, dtype in zip(inputs, dtypes)))
    return [o.double().cpu().numpy() for o in (outputs if isinstance(outputs, (list, tuple)) else [outputs])]


def main(argv=None):
    import tilelang

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--intra-threads", default="128,256", help="thread counts to build the intra kernel with")
    parser.add_argument("--time", default=None, help="B,N,H at which to time the intra kernel at each thread count")
    args = parser.parse_args(argv)
    found = cases(args.dtype, [int(t) for t in args.intra_threads.split(",")])
    with ThreadPoolExecutor(len(found)) as pool:  # TileLang lowers without the GIL: compile all at once
        compiled = {name: pool.submit(tilelang.compile, program, out_idx=outputs, target="cuda")
                    for name, (program, outputs, _, _) in found.items()}
    print(f"B={B} N={N} H={H} d={D} C={C} {args.dtype}: each output's rel L2 against reference C")
    for name, (program, _, inputs, expected) in found.items():
        actual = run(compiled[name].result(), program, inputs)
        print(f"{name:24s}", "  ".join(f"{error_report(a, e).rel_l2:.2e}" for a, e in zip(actual, expected)), flush=True)
    if args.time:
        time_intra(args.dtype, [int(t) for t in args.intra_threads.split(",")], *map(int, args.time.split(",")))


def time_intra(dtype, intra_threads, B_time, N_time, H_time):
    """The intra kernel alone at (B_time, N_time, H_time), d = 128, for each thread count: ms."""
    import tilelang
    import torch
    from triton.testing import do_bench

    for threads in intra_threads:
        program = build_intra_program(B_time, N_time, H_time, D, D, C, dtype, threads=threads)
        kernel = tilelang.compile(program, out_idx=BUILDERS["intra"][1], target="cuda")
        inputs = [torch.randn(*(int(n) for n in program.buffer_map[param].shape), device="cuda")
                  .to(getattr(torch, str(program.buffer_map[param].dtype)))
                  for param in program.params[:BUILDERS["intra"][1][0]]]
        milliseconds = do_bench(functools.partial(kernel, *inputs), warmup=25, rep=100, return_mode="median")
        print(f"intra at {threads} threads, B={B_time} N={N_time} H={H_time}: {milliseconds:.4f} ms", flush=True)


if __name__ == "__main__":
    main()
