"""Where does the backward's extra bf16 error come from? The intra kernel's score-gradient GEMMs, with
their operands in bf16 (as the kernel is) and in fp32 (as FLA keeps them), through the tile interpreter.

    python -m benchmarks.studies.s06_intra_operand_precision [--seeds 3] [--shape 1,128,2,64]

On the H200 our dq, dk and dg were 1.12 to 1.16 times FLA's error from float64 at gentle gates
(benchmarks.studies.s06_gradient_accuracy). FLA's intra backward multiplies the fp32 score gradients
dA_qk, dA_kk with the decayed keys and queries in TF32 GEMMs; ours rounded both operands to bf16.
This study found where it mattered (the diagonal sub-blocks' GEMMs, and A_hat in dv's), and the
kernel now takes those operands as their bf16 rounding plus the remainder; it still shows what is
left. It builds variants of stage 6's intra kernel with a group of its GEMM operands in fp32
(OPERAND_GROUPS: the score gradients' shared buffers with the remainders, each side of them, then the
WY backward's), runs the five backward kernels through the interpreter on the same bf16 inputs
(gates in [0.5, 0.999]) with the kernel and each variant, and prints each gradient's rel L2 from
reference A and the kernel's over the variant's. The interpreter's fp32 GEMM is exact fp32, a little
better than TF32. The variants are for this study only: at d = 128 their buffers do not fit the
H200's shared memory. No GPU needed.
"""

import argparse
import re
import sys

import numpy as np

from benchmarks import fair
from benchmarks.studies import function_source, load_edited
from stages.common.errors import error_report
from stages.common.inputs import make_backward_inputs
from stages.common.interpreter import interpret
from stages.s06_backward import kernel, reference

GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state")
# the intra kernel's GEMM operands, in `dtype` in the kernel, by group (a GEMM's two operands share a dtype):
OPERAND_GROUPS = {
    # the score gradients: the decayed queries and keys of a channel pass, the slabs' column keys, dM^T,
    # dA_qk^T and their diagonal blocks, and the remainders of the diagonal blocks' operands (zero in fp32)
    "scores": ("K_row_s", "Q_row_s", "K_col_s", "K_row_low_s", "Q_row_low_s", "K_col_low_s", "K_slab_col_s",
               "dM_T_s", "dA_qk_T_s", "dM_T_diagonal_s", "dA_qk_T_diagonal_s", "dM_T_diagonal_low_s",
               "dA_qk_T_diagonal_low_s"),
    # each side of those GEMMs alone (the interpreter multiplies operands of two dtypes; TileLang would not)
    "score gradients dA": ("dM_T_s", "dA_qk_T_s", "dM_T_diagonal_s", "dA_qk_T_diagonal_s", "dM_T_diagonal_low_s",
                           "dA_qk_T_diagonal_low_s"),
    "decayed keys and queries": ("K_row_s", "Q_row_s", "K_col_s", "K_row_low_s", "Q_row_low_s", "K_col_low_s",
                                 "K_slab_col_s"),
    # back through W and U and the solve: A_hat = diag(beta) T (and the remainder of its rounding, zero
    # in fp32), T, dA_hat, dA_hat^T A_hat, and the chunk's K e^gamma, V, dW, dV_new
    "wy": ("A_hat_s", "A_hat_low_s", "T_op_s", "dA_hat_s", "product_s", "K_decayed_s", "V_s", "dW_s", "dV_new_s"),
}


def intra_source():
    """The source of stage 6's build_intra_program, dedented, for a study to edit."""
    return function_source(kernel.build_intra_program)


def load_intra_variant(source, name):
    """build_intra_program from an edited `source` (intra_source's), in the namespace of stage 6's kernel
    module, loaded as the module `name`."""
    return load_edited(source, kernel, name).build_intra_program


def build_fp32_operand_intra(group):
    """stage 6's build_intra_program with OPERAND_GROUPS[group] allocated in fp32 (accum_dtype), every
    other line the kernel's own."""
    source = intra_source()
    for name in OPERAND_GROUPS[group]:
        source, count = re.subn(rf"(\b{name} = T\.alloc_shared\([^\n]*?\), )dtype\)", r"\1accum_dtype)", source)
        if count != 1:
            raise RuntimeError(f"stage 6's intra kernel no longer allocates {name} as this study expects")
    return load_intra_variant(source, f"intra_fp32_{group.replace(' ', '_')}")


def interpreted_backward(intra_builder, x, do, initial_state, d_final_state, chunk_size, dtype):
    """The five backward kernels through the interpreter (N a multiple of chunk_size), intra built by intra_builder."""
    B, N, H, d_k = x.q.shape
    arguments = kernel.kernel_arguments(B, N, H, d_k, x.v.shape[3], chunk_size, 32, dtype)
    kernels = {}
    for name, args in arguments.items():
        build, outputs = kernel.BUILDERS[name]
        kernels[name] = interpret((intra_builder if name == "intra" else build)(*args), out_idx=outputs)
    return kernel.run_kernels(kernels, x.q, x.k, x.v, x.g, x.beta, do, initial_state, d_final_state)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--shape", type=fair.parse_shapes, default=[(1, 128, 2, 64)],
                        help="B,N,H,D with N a multiple of 64 (default 1,128,2,64)")
    args = parser.parse_args(argv)
    (B, N, H, D), = args.shape
    if N % 64:
        parser.error("N must be a multiple of the chunk, 64")
    builds = {"bf16 operands (the kernel)": kernel.build_intra_program}
    builds.update({f"{group} operands in fp32": build_fp32_operand_intra(group) for group in OPERAND_GROUPS})
    errors = {label: {name: [] for name in GRADIENTS} for label in builds}
    for seed in range(args.seeds):
        x, do, initial_state, d_final_state = make_backward_inputs(B, N, H, D, D, seed, gate_range=(0.5, 0.999))
        exact = reference.recurrent_backward(x.q, x.k, x.v, x.g, x.beta, do, initial_state, d_final_state)
        for label, build in builds.items():
            gradients = interpreted_backward(build, x, do, initial_state, d_final_state, 64, "bfloat16")
            for name, actual in zip(GRADIENTS, gradients):
                errors[label][name].append(error_report(np.asarray(actual, np.float64), getattr(exact, name)).rel_l2)
        print(f"seed {seed} done", flush=True)
    kernel_label, *variants = builds
    print(f"\nB, N, H, D = {B}, {N}, {H}, {D}, bf16, {args.seeds} seeds: mean rel L2 from reference A, and the "
          "kernel's over each variant's")
    print(f"| gradient | {' | '.join(builds)} | {' | '.join(f'ratio to {label}' for label in variants)} |")
    print("|---" * (1 + 2 * len(variants) + 1) + "|")
    for name in GRADIENTS:
        means = [np.mean(errors[label][name]) for label in builds]
        print(f"| {name} | {' | '.join(f'{m:.3e}' for m in means)} | "
              f"{' | '.join(f'{means[0] / m:.3f}' for m in means[1:])} |")


if __name__ == "__main__":
    sys.exit(main())
