"""Stage 5's kernels called again and again on the same inputs: are the outputs the same, bit for bit?

    python -m benchmarks.studies.s05_repeatability [--calls 200] [--shape 2,1024,4,128] [--dtype bfloat16]
                                                   [--busy-gpu SECONDS]

The kernels use no atomics and no split reductions, so every call on the same inputs must give the
same bits; a call that does not shows a race (a read that a barrier does not order after its write),
which may hide on an idle GPU and show when the timing changes. Stage 5's bf16 match test failed once
(rel L2 0.031 against a floor of 3.3e-3, B=2 N=1024 H=4) while a second test process shared the GPU,
and passed alone: this looks for that failure without pytest. With --busy-gpu another process keeps
the GPU busy with GEMMs for that many seconds while the calls run (the conditions of the failure).
Prints how many calls differ from the first, in which output, and each call's error against float64
(stages.s05_fast_kda.reference.recurrent on the CPU) where it differs. Needs CUDA and TileLang.
"""

import argparse
import subprocess
import sys
import time

import numpy as np

from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.s05_fast_kda import reference


def busy_gpu(seconds):
    """Keep the GPU busy with bf16 GEMMs for `seconds` (run in a process of its own)."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(20):
            a = torch.nn.functional.normalize(a @ a, dim=-1)
        torch.cuda.synchronize()


def write_prepare_source(path, B, N, H, D, dtype, checks):
    """The CUDA source of the prepare kernel forward launched (compiled once per shape: from the cache)."""
    from stages.s05_fast_kda import kernel

    compiled = kernel.compiled_flagged_prepare if checks == "device" else kernel.compiled_prepare
    source = compiled(B, N, H, D, D, kernel.DEFAULT_CHUNK_SIZE, dtype, None).get_kernel_source()
    with open(path, "w") as f:
        f.write(source)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--shape", default="2,1024,4,128", help="B,N,H,D")
    parser.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    parser.add_argument("--busy-gpu", type=float, default=0, help="seconds of GEMMs in another process (0: none)")
    parser.add_argument("--checks", default="device", choices=["device", "off"], help="forward's checks")
    parser.add_argument("--source", default=None,
                        help="write the prepare kernel's CUDA source here (a sanitizer's line numbers point into it)")
    parser.add_argument("--busy-child", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.busy_child is not None:
        busy_gpu(args.busy_child)
        return 0

    import torch

    from stages.s05_fast_kda.kernel import forward

    B, N, H, D = (int(part) for part in args.shape.split(","))
    # the inputs of tests/test_s05_fast_kda.py::test_kernels_match_reference at this shape
    x = make_inputs(B, N, H, D, D, gate="channel", gate_range=(0.9, 0.999), beta_range=(0.1, 0.9), seed=B + N)
    expected = reference.recurrent(x.q, x.k, x.v, x.g, x.beta)
    dtype = getattr(torch, args.dtype)
    inputs = [torch.tensor(a, device="cuda", dtype=dtype if i < 3 else torch.float32)
              for i, a in enumerate((x.q, x.k, x.v, x.g, x.beta))]
    first = forward(*inputs, checks=args.checks)
    torch.cuda.synchronize()
    if args.source:
        write_prepare_source(args.source, B, N, H, D, args.dtype, args.checks)
    print(f"B={B} N={N} H={H} D={D} {args.dtype}: first call {error_report(first.double().cpu().numpy(), expected)}",
          flush=True)
    busy = None
    if args.busy_gpu:
        busy = subprocess.Popen([sys.executable, "-m", "benchmarks.studies.s05_repeatability",
                                 "--busy-child", str(args.busy_gpu)])
        time.sleep(3)  # its CUDA context and first GEMMs
    differing = 0
    for call in range(1, args.calls + 1):
        o = forward(*inputs, checks=args.checks)
        torch.cuda.synchronize()
        if not torch.equal(o, first):
            differing += 1
            rows = (o != first).any(dim=-1).nonzero()
            print(f"call {call}: differs from the first at {len(rows)} (b, n, h) rows, the first "
                  f"{rows[:4].tolist()}; {error_report(o.double().cpu().numpy(), expected)}", flush=True)
    if busy is not None:
        busy.wait()
    print(f"{differing} of {args.calls} calls differ from the first call"
          f"{' (GPU shared with GEMMs)' if args.busy_gpu else ''}")
    return 1 if differing else 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
