"""Run one saved chunk_kda call again, kernel by kernel, and name the first kernel whose output is not finite.

    python -m benchmarks.replay_call PATH [--device cuda|cpu]

PATH is what `python -m benchmarks.train_kda --nan-trap` saved (NanTrap: q, k, v, g, beta as the
layer passed them, chunk_kda's keyword arguments, do once the backward had it, and the message of the
kernels' value check if it refused the call). The replay runs past that check (checks="off"),
on both paths: it shows what the kernels do with the inputs, not what the check allows. Every kernel of
the call (stage 5's prepare and recurrence, stage 6's five backward kernels) is wrapped so that each
output is checked as it comes out, and the call runs again as the training step ran it:

- `--device cuda`: chunk_kda itself, then o.backward(do), on the GPU's compiled kernels;
- `--device cpu`: the same kernels through the tile interpreter, on the inputs as chunk_kda hands
  them to the kernels (L2-normalized, scaled, padded to the chunk): the dtypes' rounding without the
  GPU's arithmetic (TF32, exp2.approx) or its warp groups. Finite here and not on the GPU points at
  the latter.

Prints one line per kernel call (its outputs finite or not) and the first kernel that was not.
"""

import argparse
import math
import sys

import numpy as np
import torch

from stages.common.checks import padded_length
from stages.kda.config import DEFAULT_CHUNK_SIZE


class Checked:
    """A kernel whose every call reports whether its outputs are finite, and remembers the first that was not."""

    first_failure = None

    def __init__(self, name, kernel):
        self.name, self.kernel = name, kernel

    def __call__(self, *arguments):
        outputs = self.kernel(*arguments)
        tuple_outputs = outputs if isinstance(outputs, (list, tuple)) else (outputs,)
        finite = [bool(np.isfinite(_numpy(x)).all()) for x in tuple_outputs]
        print(f"{self.name}: outputs finite {finite}", flush=True)
        if not all(finite) and Checked.first_failure is None:
            Checked.first_failure = self.name
        return outputs


def _numpy(x):
    return x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x, dtype=np.float64)


def replay_on_cuda(saved):
    """chunk_kda and its backward as the training step ran them, every compiled kernel wrapped (where
    the calls look them up: stages.kda.calls)."""
    import stages.kda.calls as calls
    from stages.kda.autograd import chunk_kda

    prepare, recurrence, backward_kernels = (calls.compiled_prepare, calls.compiled_recurrence,
                                             calls.compiled_backward_kernels)
    calls.compiled_prepare = lambda *a, **keywords: Checked("prepare", prepare(*a, **keywords))
    calls.compiled_recurrence = lambda *a: Checked("recurrence", recurrence(*a))
    calls.compiled_backward_kernels = lambda *a, **keywords: {
        name: Checked(name, kernel) for name, kernel in backward_kernels(*a, **keywords).items()}
    leaves = [x.cuda().requires_grad_(x.is_floating_point()) for x in saved["inputs"]]
    o, _ = chunk_kda(*leaves, **dict(saved["options"], checks="off"))
    if "do" in saved:
        o.backward(saved["do"].cuda())


def replay_on_cpu(saved, chunk_size=DEFAULT_CHUNK_SIZE):
    """The seven kernels through the tile interpreter, on the inputs chunk_kda gives its kernels."""
    from stages.common.interpreter import interpret
    from stages.kda.inputs import InputForm, activate
    from stages.kda.backward import BUILDERS, kernel_arguments
    from stages.kda.calls import run_kernels
    from stages.kda.config import resolve
    from stages.kda.prepare import build_prepare_program, prepare_outputs
    from stages.kda.recurrence import build_recurrence_program

    q, k, v, g, beta = (x.float() for x in saved["inputs"])
    options = saved["options"]
    form = InputForm(l2_normalize=bool(options.get("use_qk_l2norm_in_kernel")),
                     scale=options.get("scale") or 1.0 / math.sqrt(q.shape[-1]))
    q, k, g, beta = activate(form, q, k, g, beta)
    B, N, H, d_k = q.shape
    d_v = v.shape[3]
    N_padded = padded_length(N, chunk_size)
    dtype = str(saved["inputs"][0].dtype).removeprefix("torch.")

    def pad(x):
        return np.pad(_numpy(x).astype(np.float64), [(0, 0), (0, N_padded - N)] + [(0, 0)] * (x.ndim - 2))

    q, k, v, g, beta = map(pad, (q, k, v, g, beta))
    do = pad(saved["do"]) if "do" in saved else np.zeros_like(v)
    initial_state = options.get("initial_state")
    state = np.zeros((B, H, d_k, d_v)) if initial_state is None else _numpy(initial_state)
    config = resolve(B, H, d_k, d_v, num_sms=132, chunk_size=chunk_size)  # the H200's SMs: the GPU run's sizes
    prepare = Checked("prepare", interpret(
        build_prepare_program(B, N_padded, H, d_k, d_v, chunk_size, dtype, config.prepare_threads),
        out_idx=prepare_outputs()))
    recurrence = Checked("recurrence", interpret(
        build_recurrence_program(B, N_padded, H, d_k, d_v, chunk_size, config.block_dv, dtype, config.num_stages,
                                 config.threads, config.programs_per_sm), out_idx=[7, 8]))
    recurrence(*prepare(q, k, v, g, beta), state)
    arguments = kernel_arguments(B, N_padded, H, d_k, d_v, chunk_size, config.block_dv, dtype)
    kernels = {name: Checked(name, interpret(BUILDERS[name][0](*arguments[name]), out_idx=BUILDERS[name][1]))
               for name in arguments}
    run_kernels(kernels, q, k, v, g, beta, do, state, np.zeros((B, H, d_k, d_v)))


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.replay_call", description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="a file saved by train_kda --nan-trap")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    saved = torch.load(args.path, map_location="cpu")
    Checked.first_failure = None
    if "refused" in saved:
        print(f"the kernels' value check refused this call: {saved['refused']}\nrun again past the check:")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            parser.error("--device cuda needs a CUDA device (torch sees none); --device cpu runs the interpreter")
        replay_on_cuda(saved)
    else:
        replay_on_cpu(saved)
    print(f"first kernel with a non-finite output: {Checked.first_failure or 'none'}")
    return Checked.first_failure


if __name__ == "__main__":
    sys.exit(0 if main() is None else 1)
