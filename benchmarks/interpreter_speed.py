"""Time every stage kernel through the tile interpreter on one CPU core.

    python -m benchmarks.interpreter_speed [--runs 5] [--out benchmarks/results/interpreter_speed.csv]

At B=1, N=256, H=2, d_k = d_v = 64, fp16, the kernels' default chunk and block sizes. For each kernel
(stages 1-4's program, stage 5's prepare and recurrence) it measures three things apart:

- parse: TileLang turning the Python `@T.prim_func` into TIR (`build_*program`), once TileLang is
  imported;
- set-up: `interpret(...)` compiling that TIR into closures;
- run: one call of the interpreted kernel on NumPy inputs, the median (and the fastest) of --runs calls.

The process is pinned to one core and BLAS to one thread before NumPy loads, and every figure is the
process's CPU time (time.process_time): what one core spends, which other work on a shared machine
does not inflate. Each row also carries the
run's rel L2 error against reference A (a timed run must be a right one) and the digest of the kernel
module's program builders (stages.common.program_digest), so the page can tell when a kernel has
changed since the figures were measured. `course regenerate` renders the CSV on the interpreter page
(kdacourse/pages/interpreter.py).
"""

import os

for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):  # before NumPy loads
    os.environ[_variable] = "1"

import argparse  # noqa: E402
import csv  # noqa: E402
import importlib.util  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "interpreter_speed.csv"
SHAPE = {"B": 1, "N": 256, "H": 2, "d": 64}
DTYPE = "float16"
FIELDS = ["kernel", "B", "N", "H", "d", "dtype", "parse_s", "setup_s", "run_median_s", "run_min_s", "runs",
          "rel_l2_vs_reference_a", "kernel_digest", "machine"]
# kernel name -> (stage package, builder, gate kind)
KERNELS = {
    "s01 build_program": ("s01_linear_attention", "build_program", "none"),
    "s02 build_program": ("s02_scalar_decay", "build_program", "head"),
    "s03 build_program": ("s03_gated_deltanet", "build_program", "token"),
    "s04 build_program": ("s04_kda", "build_program", "channel"),
    "s05 build_prepare_program": ("s05_fast_kda", "build_prepare_program", "channel"),
    "s05 build_recurrence_program": ("s05_fast_kda", "build_recurrence_program", "channel"),
}


def machine():
    """The CPU's model name, its core count, and that this process ran on one of them."""
    model = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [line.split(":", 1)[1].strip() for line in cpuinfo.read_text().splitlines()
                 if line.startswith("model name")]
        model = names[0] if names else model
    return f"{model}, {os.cpu_count()} cores, pinned to one; Python {platform.python_version()}, NumPy {np.__version__}"


def pin_to_one_core():
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})


def _builder(package, name):
    """The program builder, without any functools cache (a cached build would time as zero)."""
    module = importlib.import_module(f"stages.{package}.kernel")
    builder = getattr(module, name)
    return getattr(builder, "__wrapped__", builder), module


def _median_and_min(function, runs):
    times = []
    result = None
    for _ in range(runs):
        started = time.process_time()
        result = function()
        times.append(time.process_time() - started)
    return statistics.median(times), min(times), result


def measure(runs=5):
    """One row per kernel (see FIELDS)."""
    import tilelang  # noqa: F401  (imported once, outside every timing)

    from stages.common.program_digest import program_digest
    from stages.common.errors import error_report
    from stages.common.inputs import make_inputs
    from stages.common.interpreter import interpret

    B, N, H, d = SHAPE["B"], SHAPE["N"], SHAPE["H"], SHAPE["d"]
    where = machine()
    rows = []
    prepared = None  # stage 5's prepare outputs feed its recurrence
    for kernel, (package, name, gate) in KERNELS.items():
        build, module = _builder(package, name)
        x = make_inputs(B, N, H, d, d, gate=gate, seed=0)
        arguments = [a for a in (x.q, x.k, x.v, x.g, x.beta) if a is not None]
        parse_s, _, program = _median_and_min(lambda f=build: f(B, N, H, d, d, dtype=DTYPE), runs)
        n_params = len(program.params)
        if name == "build_prepare_program":
            out_idx = list(range(5, n_params))
        elif name == "build_recurrence_program":
            out_idx = [n_params - 2, n_params - 1]
            arguments = list(prepared) + [np.zeros((B, H, d, d))]
        else:
            out_idx = [n_params - 1]
        setup_s, _, kernel_function = _median_and_min(lambda p=program, o=out_idx: interpret(p, out_idx=o), runs)
        kernel_function(*arguments)  # a first call outside the timing (NumPy's first-use costs)
        run_median, run_min, result = _median_and_min(lambda f=kernel_function, a=arguments: f(*a), runs)
        if name == "build_prepare_program":
            prepared, error = result, ""
        else:
            reference = importlib.import_module(f"stages.{package if package != 's05_fast_kda' else 's04_kda'}.reference")
            o = result[0] if name == "build_recurrence_program" else result
            gates = [a for a in (x.g, x.beta) if a is not None]
            error = f"{error_report(o, reference.recurrent(x.q, x.k, x.v, *gates)).rel_l2:.3e}"
        digest = program_digest(Path(importlib.util.find_spec(module.__name__).origin).read_text())
        rows.append({"kernel": kernel, "B": B, "N": N, "H": H, "d": d, "dtype": DTYPE,
                     "parse_s": f"{parse_s:.3f}", "setup_s": f"{setup_s:.4f}", "run_median_s": f"{run_median:.3f}",
                     "run_min_s": f"{run_min:.3f}", "runs": runs, "rel_l2_vs_reference_a": error,
                     "kernel_digest": digest, "machine": where})
        print(f"{kernel:30s} parse {parse_s:6.3f} s   set-up {setup_s:7.4f} s   run {run_median:6.3f} s "
              f"(min {run_min:.3f})   rel L2 vs A {error or '-'}", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="timed calls per kernel (the median is reported)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="the CSV to write")
    args = parser.parse_args(argv)
    pin_to_one_core()
    rows = measure(args.runs)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {args.out} ({rows[0]['machine']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
