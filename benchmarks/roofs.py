"""The two roofs of the machine a benchmark runs on, measured there.

    python -m benchmarks.roofs        measure them on this machine's GPU and print them as JSON

- **Bandwidth**: a device-to-device copy of a large buffer (`dst.copy_(src)`), counted as the bytes
  read plus the bytes written per second. This is what a kernel that only streams memory reaches,
  below what the memory is specified for (the H200's HBM3e: 4.8 TB/s).
- **Compute**: a bf16 GEMM in torch (`torch.matmul`, fp32 accumulation on the tensor cores), counted
  as 2 M N K floating-point operations per second.

Both are timed as the kernels are (`triton.testing.do_bench`: warm-up, then the median of repeats).
benchmarks/bench.py records them in the run's meta.json under "roofs" (FIELDS); the benchmarks page
reads them there (kdacourse.results.roofs_of), beside the figures DESIGN.md fixed before runs
measured their own.
"""

import json
import sys

DESIGN_COPY_BANDWIDTH = 4.30e12  # bytes/s: a device-to-device copy on an H200, measured before this module (DESIGN.md)

COPY_BYTES = 1 << 30  # 1 GiB copied: far larger than the L2 cache (50 MiB on the H200)
GEMM_SIZE = 8192  # M = N = K: large enough that the GEMM is bound by the tensor cores
FIELDS = ("copy_bytes", "copy_ms", "bandwidth_bytes_per_s", "gemm_size", "gemm_ms", "bf16_flops_per_s")


def _do_bench(function):
    """Milliseconds of one call: the median of CUDA-event timings after warm-up, as bench.py times."""
    from triton.testing import do_bench

    return do_bench(function, warmup=25, rep=100, return_mode="median")


def measure(device="cuda", copy_bytes=COPY_BYTES, gemm_size=GEMM_SIZE, timer=None):
    """Measure both roofs on `device`; returns the dict that meta.json records (FIELDS).

    `timer(function) -> milliseconds` defaults to triton's do_bench; tests pass their own to check the
    arithmetic on a CPU.
    """
    import torch

    timer = timer or _do_bench
    source = torch.empty(copy_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1)
    destination = torch.empty_like(source)
    copy_ms = timer(lambda: destination.copy_(source))  # noqa: F821  ruff: the del below runs after the call
    del source, destination
    a = torch.randn(gemm_size, gemm_size, device=device).to(torch.bfloat16)
    b = torch.randn(gemm_size, gemm_size, device=device).to(torch.bfloat16)
    c = torch.empty(gemm_size, gemm_size, dtype=torch.bfloat16, device=device)
    gemm_ms = timer(lambda: torch.matmul(a, b, out=c))
    moved = 2 * (copy_bytes // 2) * 2  # bf16 elements of 2 bytes, each read once and written once
    return dict(copy_bytes=moved, copy_ms=copy_ms, bandwidth_bytes_per_s=moved / (copy_ms * 1e-3),
                gemm_size=gemm_size, gemm_ms=gemm_ms,
                bf16_flops_per_s=2 * gemm_size ** 3 / (gemm_ms * 1e-3))


def measure_or_error(**kwargs):
    """`measure`, or {"error": ...} if it fails: a run's other results are kept either way."""
    try:
        return measure(**kwargs)
    except Exception as error:  # noqa: BLE001 - recorded, not raised: the roofs are one part of a run
        return {"error": f"{type(error).__name__}: {error}"}


def tb_per_s(bytes_per_s):
    return f"{bytes_per_s / 1e12:.2f} TB/s"


def tflop_per_s(flops_per_s):
    return f"{flops_per_s / 1e12:.0f} TFLOP/s"


def main():
    import torch

    if not torch.cuda.is_available():
        print("measuring the roofs needs a CUDA device; torch sees none", file=sys.stderr)
        return 2
    roofs = measure()
    print(json.dumps(roofs, indent=2))
    print(f"{torch.cuda.get_device_name()}: copy {tb_per_s(roofs['bandwidth_bytes_per_s'])}, "
          f"bf16 GEMM {tflop_per_s(roofs['bf16_flops_per_s'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
