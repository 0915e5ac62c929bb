"""Benchmark every stage's kernel against FLA 0.6.0 and plain torch on one CUDA machine.

    python -m benchmarks.bench [--stages s01,s02] [--quick] [--out DIR] [--no-precision | --no-timings]

For each stage whose kernel exists: check it against the float64 reference at a small shape; at each
benchmark shape of DESIGN.md check it against FLA's chunk kernel and time ours, FLA's and the
plain-torch chunked forward in this one process (CUDA events via triton.testing.do_bench: warm-up,
then the median of repeats); compute the bytes the forward must move and the time that traffic
alone takes at 4.3 TB/s (what a copy reaches; the specification says 4.8). Then the precision
study: fp16 and bf16 against float64 as N grows.
A shape that fails is recorded with its error and the run goes on.

Writes DIR/bench.csv, DIR/precision.csv and DIR/meta.json (versions, the command, a digest of each
measured kernel's source, so that the page can flag results of a kernel that has changed since, and
this machine's roofs from benchmarks/roofs.py).
`course regenerate` turns the committed CSVs into the tables and plots of the benchmarks page
(benchmarks/figures.py), on any machine.
"""

import argparse
import csv
import importlib.util
import json
import math
import platform
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from benchmarks import plain_torch, roofs
from stages.common.program_digest import modules_digest

MEMORY_BANDWIDTH = 4.3e12  # bytes/s, what a device-to-device copy reached on an H200 (spec: 4.8; benchmarks/roofs.py)
SHAPES = [(1, 4096, 32, 128), (1, 16384, 32, 128), (1, 65536, 32, 128), (8, 4096, 16, 128)]  # B, N, H, D
QUICK_SHAPES = [(1, 4096, 32, 128), (8, 4096, 16, 128)]
PRECISION_LENGTHS = [1024, 4096, 16384, 65536]
GATE_RANGE = (0.9, 0.999)
UNSAFE_GATE_RANGE = (0.5, 0.999)
BETA_RANGE = (0.1, 0.9)


@dataclass(frozen=True)
class Stage:
    """How to run one stage: our kernel, FLA's, and plain torch, on the same inputs."""

    name: str
    kernel_module: str  # module with forward(q, k, v, *gates)
    fla_name: str
    gate: str  # "none", "head", "token" or "channel", as stages.common.inputs
    has_beta: bool
    plain: object  # the plain-torch function
    # the modules whose build_*program functions build the kernels, where kernel_module does not (stage
    # 5's: its kernel module, which names the builders of stages.kda it teaches, as the site reads it)
    program_modules: tuple[str, ...] = ()
    forward_returns_state: bool = False  # forward returns (o, final state or None), the fast path's convention

    def inputs_bytes(self, B, N, H, D, element_size):
        """Bytes the forward must read and write at least: q, k, v, gates, beta in; o out."""
        tokens = B * N * H
        moved = tokens * 4 * D * element_size  # q, k, v read and o written
        moved += {"none": 0, "head": 4 * H / tokens, "token": 4, "channel": 4 * D}[self.gate] * tokens
        moved += 4 * tokens if self.has_beta else 0
        return moved

    def kernel_digest(self):
        """Which kernel a run measured: the first 12 hex digits of the SHA-256 of the code of the
        program modules' builders (their top-level `build_*program` functions and the macros they build
        with: modules_digest), so that an edit of the wrapper, a comment or a snippet marker does not
        mark old results stale."""
        return modules_digest(self.program_modules or (self.kernel_module,))


STAGES = {
    "s01": Stage("s01_linear_attention", "stages.s01_linear_attention.kernel", "chunk_linear_attn", "none", False,
                 plain_torch.linear_attention),
    "s02": Stage("s02_scalar_decay", "stages.s02_scalar_decay.kernel", "chunk_simple_gla", "head", False,
                 plain_torch.scalar_decay),
    "s03": Stage("s03_gated_deltanet", "stages.s03_gated_deltanet.kernel", "chunk_gated_delta_rule", "token", True,
                 plain_torch.gated_deltanet),
    "s04": Stage("s04_kda", "stages.s04_kda.kernel", "chunk_kda", "channel", True, plain_torch.kda),
    "s05": Stage("s05_fast_kda", "stages.kda.calls", "chunk_kda", "channel", True, plain_torch.kda,
                 program_modules=("stages.s05_fast_kda.kernel",), forward_returns_state=True),
}


def make_inputs(stage, B, N, H, D, dtype, gate_range=GATE_RANGE, seed=0):
    """Inputs on the GPU: L2-normalized q, k; v ~ N(0, 1); g = log U(gate_range) (fp32); beta ~ U(BETA_RANGE) (fp32)."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, device="cuda", generator=generator, dtype=torch.float32)

    def uniform(low, high, *shape):
        return low + (high - low) * torch.rand(*shape, device="cuda", generator=generator, dtype=torch.float32)

    q = torch.nn.functional.normalize(normal(B, N, H, D), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(normal(B, N, H, D), dim=-1).to(dtype)
    v = normal(B, N, H, D).to(dtype)
    gate_shape = {"none": None, "head": (H,), "token": (B, N, H), "channel": (B, N, H, D)}[stage.gate]
    gates = [] if gate_shape is None else [torch.log(uniform(*gate_range, *gate_shape))]
    if stage.has_beta:
        gates.append(uniform(*BETA_RANGE, B, N, H))
    return [q, k, v, *gates]


def ours(stage):
    """Our forward of the stage, returning o (as `fla` returns FLA's)."""
    forward = importlib.import_module(stage.kernel_module).forward
    if stage.forward_returns_state:
        return lambda *args: forward(*args)[0]
    return forward


def fla(stage):
    """FLA's chunk kernel of the stage with the course's conventions: no scale, no normalizer."""
    import fla.ops as ops

    function = getattr(ops, stage.fla_name)
    if stage.gate == "none":
        return lambda q, k, v: function(q, k, v, scale=1.0, normalize=False)[0]
    if stage.gate == "head":
        return lambda q, k, v, g: function(q, k, v, g_gamma=g, scale=1.0)[0]
    return lambda q, k, v, g, beta: function(q, k, v, g, beta, scale=1.0)[0]


def plain(stage):
    return stage.plain


def relative_l2(actual, expected):
    import torch

    actual, expected = actual.double(), expected.double()
    if not torch.isfinite(actual).all():
        return math.nan
    return float(torch.linalg.vector_norm(actual - expected) / torch.linalg.vector_norm(expected))


def time_ms(function, args):
    import torch
    from triton.testing import do_bench

    with torch.no_grad():
        return float(do_bench(lambda: function(*args), warmup=25, rep=100, return_mode="median"))


def float64_reference(stage, args):
    return plain(stage)(*[x.double() for x in args])


def cuda_is_missing(program):
    """True, after saying so on stderr, where torch (or a CUDA device for it) is missing: `program` times
    CUDA kernels and has nothing to measure without one."""
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None and torch.cuda.is_available():
        return False
    print(f"{program} needs a CUDA device (it times CUDA kernels); torch sees none", file=sys.stderr)
    return True


def seconds_log(started):
    """A log function: each message printed after the seconds since `started` (a time.monotonic())."""
    def log(message):
        print(f"[{time.monotonic() - started:6.0f} s] {message}", flush=True)

    return log


def run_meta(program, argv, packages=("triton", "tilelang", "fla")):
    """Where and how a timing run ran, for its meta JSON: the GPU, torch and its CUDA, each of `packages`'
    versions ("not installed" where one is missing), Python, the command as typed, the date and the
    moment it started (to the second, the machine's clock: what orders two runs of one day)."""
    import torch

    versions = {}
    for name in packages:
        try:
            versions[name] = getattr(importlib.import_module(name), "__version__", "?")
        except ImportError:
            versions[name] = "not installed"
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda, **versions,
                python=platform.python_version(),
                command=f"python -m {program} " + " ".join(sys.argv[1:] if argv is None else argv),
                date=time.strftime("%Y-%m-%d"), started=time.strftime("%Y-%m-%dT%H:%M:%S"))


class Deadline(Exception):
    """The run's time is up: what was measured so far is kept."""


def check_deadline(deadline):
    if deadline is not None and time.monotonic() > deadline:
        raise Deadline()


def run_stage(stage, shapes, writer, log, deadline=None):
    """Correctness at a small shape, then check and time at every benchmark shape."""
    import torch

    try:
        forward = ours(stage)
    except ImportError as error:
        log(f"{stage.name}: no kernel yet ({error}); skipped")
        return
    small = make_inputs(stage, 2, 1024, 4, 128, torch.float16)
    error = relative_l2(forward(*small), float64_reference(stage, small))
    log(f"{stage.name}: fp16 kernel vs float64 reference at B=2, N=1024, H=4, D=128: rel L2 {error:.2e}")
    writer.writerow(dict(stage=stage.name, B=2, N=1024, H=4, D=128, dtype="float16", impl="ours",
                         rel_l2_vs_float64=f"{error:.3e}"))
    for B, N, H, D in shapes:
        check_deadline(deadline)
        args = make_inputs(stage, B, N, H, D, torch.bfloat16)
        bound_ms = stage.inputs_bytes(B, N, H, D, 2) / MEMORY_BANDWIDTH * 1e3
        reference_output = None
        for impl, function in (("fla", fla(stage)), ("ours", forward), ("torch", plain(stage))):
            row = dict(stage=stage.name, B=B, N=N, H=H, D=D, dtype="bfloat16", impl=impl,
                       bytes=int(stage.inputs_bytes(B, N, H, D, 2)), memory_bound_ms=f"{bound_ms:.4f}")
            started = time.monotonic()
            try:
                output = function(*args)
                if impl == "fla":
                    reference_output = output
                elif reference_output is not None:
                    row["rel_l2_vs_fla"] = f"{relative_l2(output, reference_output):.3e}"
                del output
                row["time_ms"] = f"{time_ms(function, args):.4f}"
            except Exception as failure:  # a failing shape is recorded, the run goes on
                row["error"] = f"{type(failure).__name__}: {str(failure)[:200]}"
                traceback.print_exc()
            torch.cuda.empty_cache()
            writer.writerow(row)
            log(f"{stage.name} B={B} N={N} H={H} D={D} {impl}: {row.get('time_ms', 'failed')} ms "
                f"{row.get('rel_l2_vs_fla', '')} ({time.monotonic() - started:.0f} s)")


def run_precision(stage, writer, log, lengths=PRECISION_LENGTHS, heads=4, deadline=None):
    """Relative L2 against float64 as N grows, fp16 and bf16, ours and FLA, inside and outside the safe gates."""
    import torch

    try:
        implementations = (("ours", ours(stage)), ("fla", fla(stage)))
    except ImportError:
        return
    gate_ranges = [GATE_RANGE] + ([UNSAFE_GATE_RANGE] if stage.gate != "none" else [])
    for gate_range in gate_ranges:
        for N in lengths:
            check_deadline(deadline)
            exact = make_inputs(stage, 1, N, heads, 128, torch.float64, gate_range)
            expected = float64_reference(stage, exact)
            for dtype in (torch.float16, torch.bfloat16):
                args = [x.to(dtype) if i < 3 else x.float() for i, x in enumerate(exact)]
                for impl, function in implementations:
                    row = dict(stage=stage.name, N=N, dtype=str(dtype).removeprefix("torch."), impl=impl,
                               gate_lower=gate_range[0], gate_upper=gate_range[1])
                    try:
                        row["rel_l2_vs_float64"] = f"{relative_l2(function(*args), expected):.3e}"
                    except Exception as failure:
                        row["error"] = f"{type(failure).__name__}: {str(failure)[:200]}"
                    writer.writerow(row)
                    log(f"precision {stage.name} N={N} {row['dtype']} {impl} gates {gate_range}: "
                        f"{row.get('rel_l2_vs_float64', row.get('error'))}")


def flushing(writer, file):
    """A csv writer whose rows reach the disk at once: a run stopped from outside keeps them."""
    write_row = writer.writerow

    def writerow(row):
        write_row(row)
        file.flush()

    writer.writerow = writerow
    return writer


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", default=",".join(STAGES), help="comma-separated: s01,s02,...")
    parser.add_argument("--quick", action="store_true", help="two shapes instead of four")
    halves = parser.add_mutually_exclusive_group()
    halves.add_argument("--no-precision", action="store_true", help="skip the precision study")
    halves.add_argument("--no-timings", action="store_true", help="only the precision study")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the CSVs")
    parser.add_argument("--precision-lengths", default=",".join(map(str, PRECISION_LENGTHS)),
                        help="sequence lengths of the precision study")
    parser.add_argument("--precision-heads", type=int, default=4, help="heads in the precision study")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which no new shape is started (what was measured is kept)")
    args = parser.parse_args(argv)

    if cuda_is_missing("benchmarks.bench"):
        return 2

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log = seconds_log(started)

    selected = [STAGES[name] for name in args.stages.split(",")]
    deadline = None if args.deadline is None else started + args.deadline
    bench_fields = ["stage", "B", "N", "H", "D", "dtype", "impl", "time_ms", "rel_l2_vs_fla", "rel_l2_vs_float64",
                    "bytes", "memory_bound_ms", "error"]
    if not args.no_timings:
        with open(out / "bench.csv", "w", newline="") as f:
            writer = flushing(csv.DictWriter(f, bench_fields), f)
            writer.writeheader()
            try:
                for stage in selected:
                    run_stage(stage, QUICK_SHAPES if args.quick else SHAPES, writer, log, deadline)
            except Deadline:
                log("deadline reached during the timings")
    if not args.no_precision:
        precision_fields = ["stage", "N", "dtype", "impl", "gate_lower", "gate_upper", "rel_l2_vs_float64", "error"]
        with open(out / "precision.csv", "w", newline="") as f:
            writer = flushing(csv.DictWriter(f, precision_fields), f)
            writer.writeheader()
            lengths = [int(n) for n in args.precision_lengths.split(",")]
            try:
                for stage in selected:
                    run_precision(stage, writer, log, lengths, args.precision_heads, deadline)
            except Deadline:
                log("deadline reached during the precision study")
    meta = dict(run_meta("benchmarks.bench", argv), seconds=round(time.monotonic() - started),
                kernels={stage.name: stage.kernel_digest() for stage in selected},
                roofs=roofs.measure_or_error())  # this machine's copy bandwidth and bf16 GEMM rate
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    log(f"done: {out}/bench.csv, precision.csv, meta.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
