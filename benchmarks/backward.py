"""Stage 6 against FLA 0.6.0's chunk_kda, forward and backward, measured as benchmarks/fair.py measures
the forward: kernels alone and whole calls apart, in interleaved rounds, with the spread over rounds.

    python -m benchmarks.backward --out DIR [--quick] [--rounds 3] [--shapes ...] [--deadline SECONDS]

At each shape (bench.SHAPES by default; bf16, d_k = d_v = 128, the benchmark's inputs and a random
dLoss/do) it first compiles, autotunes, captures and checks (our gradients against FLA's), then
times, in each round:

- ours `fwd_bwd_kernels`: stage 5's two forward kernels and the five backward kernels
  (stages.s06_backward.kernel.run_kernels) on preallocated inputs, as one CUDA graph; `backward_kernels`
  the backward's five alone; each backward kernel alone (`prepare`, `states`, `state_gradient`,
  `state_products`, `intra`) on the outputs of the one before;
- ours `fwd_bwd_call`: stage 5's `forward` then stage 6's `backward`, as a caller runs them, value
  checks off (check_values=False: FLA checks no values either);
- FLA `fwd_bwd_call`: chunk_kda forward, then torch.autograd.grad of its output with dLoss/do, as a
  caller runs them; FLA `fwd_bwd_kernels`: the same captured as a CUDA graph, if it captures; FLA
  `backward_call`: torch.autograd.grad alone, on a kept forward graph.

A measurement that does not capture as a graph is timed with CUDA events around the launches instead
(the row's `method` says which). Every time is the median of triton.testing.do_bench's timings after
warm-up; each round runs the measurements in the reverse order of the one before.

Writes DIR/backward.csv (one row per round and measurement) and DIR/backward_meta.json (machine,
versions, command, the backward kernel's digest, rel L2 of our gradients against FLA's per shape;
"complete": false until the run ends). Commit them as benchmarks/results/backward.csv and
backward_meta.json.
"""

import argparse
import gc
import json
import platform
import sys
import time
import traceback
from pathlib import Path

from benchmarks import bench, fair

SHAPES = bench.SHAPES  # B, N, H, D
QUICK_SHAPES = [(1, 4096, 32, 128), (8, 4096, 16, 128)]
ROUNDS, QUICK_ROUNDS = 3, 2
DTYPE = "bfloat16"
BACKWARD_KERNELS = ("prepare", "states", "state_gradient", "state_products", "intra")
# (impl, what) in the order of an odd round; even rounds run it backwards
MEASUREMENTS = [("fla", "fwd_bwd_call"), ("ours", "fwd_bwd_call"), ("fla", "fwd_bwd_kernels"),
                ("ours", "fwd_bwd_kernels"), ("fla", "backward_call"), ("ours", "backward_kernels"),
                *(("ours", kernel) for kernel in BACKWARD_KERNELS)]
FIELDS = ["round", "B", "N", "H", "D", "dtype", "impl", "what", "method", "time_ms", "error"]
CSV_NAME, META_NAME = "backward.csv", "backward_meta.json"
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta")


# ------------------------------------------------------------------ arguments and statistics (no GPU)

def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help=f"folder for {CSV_NAME} and {META_NAME}")
    parser.add_argument("--quick", action="store_true",
                        help=f"{len(QUICK_SHAPES)} shapes, {QUICK_ROUNDS} rounds, shorter timings")
    parser.add_argument("--rounds", type=int, default=None, help=f"rounds (default {ROUNDS}, quick {QUICK_ROUNDS})")
    parser.add_argument("--shapes", type=fair.parse_shapes, default=None,
                        help="B,N,H,D;B,N,H,D;... instead of the benchmark shapes")
    parser.add_argument("--block-dv", type=int, default=None,
                        help="value columns per program of the two chunk loops (default: the wrapper's)")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which no new shape or round is started (what was measured is kept)")
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    args.rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    return args


def comparisons(rows):
    """{shape: {name: Spread}}: FLA / ours, round by round, for forward + backward as kernels and as
    calls, and ours' backward kernels against FLA's backward call."""
    pairs = {"fwd+bwd kernels FLA / ours": (("fla", "fwd_bwd_kernels"), ("ours", "fwd_bwd_kernels")),
             "fwd+bwd call FLA / ours": (("fla", "fwd_bwd_call"), ("ours", "fwd_bwd_call")),
             "backward FLA call / ours kernels": (("fla", "backward_call"), ("ours", "backward_kernels"))}
    return {shape: {name: fair.paired(measured, fla, ours, _ratio) for name, (fla, ours) in pairs.items()}
            for shape, measured in fair.times(rows).items()}


def _ratio(a, b):
    return a / b


def open_writer(path):
    """A csv.DictWriter over FIELDS on `path`, header written, every row flushed at once."""
    import csv

    f = open(path, "w", newline="")
    writer = bench._flushing(csv.DictWriter(f, FIELDS), f)
    writer.writeheader()
    return writer, f


# ------------------------------------------------------------------ on the GPU

class Shape:
    """One shape's inputs, callables and captured graphs, kept for all rounds."""

    def __init__(self, B, N, H, D, block_dv, log):
        import torch

        from stages.s05_fast_kda import kernel as stage5
        from stages.s06_backward import kernel

        self.B, self.N, self.H, self.D = B, N, H, D
        self.label = f"B={B} N={N} H={H} D={D}"
        self.errors, self.methods, self.functions = {}, {}, {}
        q, k, v, g, beta = bench.make_inputs(bench.STAGES["s05"], B, N, H, D, torch.bfloat16)
        do = torch.randn(q.shape, device=q.device, generator=torch.Generator(device="cuda").manual_seed(1)).to(q.dtype)
        state = torch.zeros(B, H, D, D, dtype=torch.float32, device=q.device)
        C = kernel.DEFAULT_CHUNK_SIZE
        block_dv = block_dv or kernel.DEFAULT_BLOCK_DV
        shape = (B, N, H, D, D, C)
        if N % C:
            raise ValueError(f"N = {N} must be a multiple of the chunk size {C} here (the kernels take padded inputs)")
        forward_prepare = stage5._compiled_prepare(*shape, DTYPE, None)
        recurrence = stage5._compiled_recurrence(*shape, stage5.DEFAULT_BLOCK_DV, DTYPE, 2, 128)

        def backward_kernels():
            return kernel.run_kernels(kernel._compiled, q, k, v, g, beta, do, state, state, C, block_dv, DTYPE)

        def forward_and_backward_kernels():
            recurrence(*forward_prepare(q, k, v, g, beta), state)
            return backward_kernels()

        self._graph_or_events(("ours", "fwd_bwd_kernels"), forward_and_backward_kernels, log)
        self._graph_or_events(("ours", "backward_kernels"), backward_kernels, log)
        for what, launch in self._kernels_alone(kernel, q, k, v, g, beta, do, state, shape, block_dv).items():
            self._graph_or_events(("ours", what), launch, log)

        def ours_call():
            stage5.forward(q, k, v, g, beta, check_values=False)
            return kernel.backward(q, k, v, g, beta, do, block_dv=block_dv, check_values=False)

        self.functions[("ours", "fwd_bwd_call")], self.methods[("ours", "fwd_bwd_call")] = ours_call, "events"
        ours = backward_kernels()[:5]
        self.rel_l2_vs_fla = None
        try:
            fla_forward_backward, fla_backward = _fla_calls(q, k, v, g, beta, do)
            fla_gradients = fla_forward_backward()
            self.rel_l2_vs_fla = {name: bench.relative_l2(a, b) for name, a, b in zip(GRADIENTS, ours, fla_gradients)}
            del fla_gradients
            for what, function in (("fwd_bwd_call", fla_forward_backward), ("backward_call", fla_backward)):
                self.functions[("fla", what)], self.methods[("fla", what)] = function, "events"
            self._graph(("fla", "fwd_bwd_kernels"), fla_forward_backward, log)
        except Exception as failure:  # FLA missing or failing: ours is still measured
            for what in ("fwd_bwd_call", "backward_call", "fwd_bwd_kernels"):
                self.errors.setdefault(("fla", what), fair._error(failure))
            log(f"{self.label}: FLA failed: {fair._error(failure)}")
        del ours
        torch.cuda.synchronize()

    @staticmethod
    def _kernels_alone(kernel, q, k, v, g, beta, do, state, shape, block_dv):
        """{kernel name: a launch of it alone}, each on the outputs of the kernels before it (computed once)."""
        compiled = {name: kernel._compiled(name, *shape, *((block_dv,) if name in kernel.WITH_BLOCK_DV else ()),
                                           DTYPE) for name in BACKWARD_KERNELS}
        w, u, q_decayed, k_to_chunk_end, a_qk, chunk_decay = compiled["prepare"](q, k, v, g, beta)
        states, v_new = compiled["states"](w, u, k_to_chunk_end, chunk_decay, state)
        d_states, dv_new, _ = compiled["state_gradient"](q_decayed, k_to_chunk_end, w, a_qk, chunk_decay, do, state)
        products = compiled["state_products"](states, d_states, v_new, dv_new, do, chunk_decay)
        return {
            "prepare": lambda: compiled["prepare"](q, k, v, g, beta),
            "states": lambda: compiled["states"](w, u, k_to_chunk_end, chunk_decay, state),
            "state_gradient": lambda: compiled["state_gradient"](q_decayed, k_to_chunk_end, w, a_qk, chunk_decay, do,
                                                                 state),
            "state_products": lambda: compiled["state_products"](states, d_states, v_new, dv_new, do, chunk_decay),
            "intra": lambda: compiled["intra"](q, k, v, g, beta, do, v_new, dv_new, *products),
        }

    _graph = fair.Shape._graph
    _graph_or_events = fair.Shape._graph_or_events

    def measure(self, round_number, writer, log, order, timer):
        for key in order:
            impl, what = key
            row = dict(round=round_number, B=self.B, N=self.N, H=self.H, D=self.D, dtype=DTYPE, impl=impl,
                       what=what, method=self.methods.get(key, ""))
            if key in self.errors:
                row["error"] = self.errors[key]
            elif key in self.functions:
                try:
                    row["time_ms"] = f"{timer(self.functions[key]):.4f}"
                except Exception as failure:  # recorded, the run goes on
                    row["error"] = fair._error(failure)
                    traceback.print_exc()
            else:
                continue
            writer.writerow(row)
            log(f"round {round_number} {self.label} {impl} {what}: {row.get('time_ms', 'failed')} ms "
                f"({row['method']}){' ' + row['error'] if row.get('error') else ''}")


def _fla_calls(q, k, v, g, beta, do):
    """FLA's forward + backward and its backward alone, as a training step calls them (autograd), with
    the course's conventions (no scale); each returns (dq, dk, dv, dg, dbeta)."""
    import torch
    from fla.ops import chunk_kda

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]

    def forward_backward():
        with torch.enable_grad():
            o = chunk_kda(*leaves, scale=1.0)[0]
            return torch.autograd.grad(o, leaves, do)

    with torch.enable_grad():
        kept = chunk_kda(*leaves, scale=1.0)[0]

    def backward_only():
        return torch.autograd.grad(kept, leaves, do, retain_graph=True)

    return forward_backward, backward_only


def make_timer(quick):
    """fair's timer, without its torch.no_grad (FLA's backward needs autograd)."""
    from triton.testing import do_bench

    warmup, rep = (10, 40) if quick else (25, 100)
    return lambda function: float(do_bench(function, warmup=warmup, rep=rep, return_mode="median"))


def run(args, log, started):
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = None if args.deadline is None else started + args.deadline
    timer = make_timer(args.quick)
    notes = {}
    writer, f = open_writer(out / CSV_NAME)
    try:
        for B, N, H, D in args.shapes:
            bench.check_deadline(deadline)
            log(f"B={B} N={N} H={H} D={D}: compile, autotune, capture, check")
            try:
                shape = Shape(B, N, H, D, args.block_dv, log)
            except Exception as failure:
                traceback.print_exc()
                notes[f"B={B} N={N} H={H} D={D}"] = {"error": fair._error(failure)}
                writer.writerow(dict(round=0, B=B, N=N, H=H, D=D, dtype=DTYPE, impl="ours", what="setup",
                                     error=fair._error(failure)))
                torch.cuda.empty_cache()
                continue
            notes[shape.label] = {"rel_l2_ours_vs_fla": shape.rel_l2_vs_fla,
                                  "methods": {f"{i} {w}": m for (i, w), m in shape.methods.items()}}
            log(f"{shape.label}: rel L2 ours vs FLA {shape.rel_l2_vs_fla}")
            try:
                for round_number in range(1, args.rounds + 1):
                    if round_number > 1:
                        bench.check_deadline(deadline)
                    order = MEASUREMENTS if round_number % 2 else MEASUREMENTS[::-1]
                    shape.measure(round_number, writer, log, order, timer)
            finally:
                del shape
                gc.collect()
                torch.cuda.empty_cache()
    except bench.Deadline:
        log("deadline reached: no new shape or round started")
    finally:
        f.close()
    return notes


def main(argv=None):
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("benchmarks.backward needs a CUDA device (it times CUDA graphs and kernels); torch sees none",
              file=sys.stderr)
        return 2
    started = time.monotonic()

    def log(message):
        print(f"[{time.monotonic() - started:6.0f} s] {message}", flush=True)

    log(f"shapes {args.shapes}, {args.rounds} rounds, out {args.out}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    meta = run_meta(args, argv, torch)
    write_meta(args.out, meta, started, complete=False)
    meta["shapes"] = run(args, log, started)
    write_meta(args.out, meta, started, complete=True)
    for shape, named in sorted(comparisons(fair.read_rows(Path(args.out) / CSV_NAME)).items()):
        log(f"B={shape[0]} N={shape[1]} H={shape[2]} D={shape[3]}: "
            + "; ".join(f"{name} {spread.text('{:.2f}')}" for name, spread in named.items() if spread is not None))
    log(f"done: {args.out}/{CSV_NAME}, {META_NAME}")
    return 0


def run_meta(args, argv, torch):
    versions = {}
    for name in ("triton", "tilelang", "fla"):
        try:
            versions[name] = getattr(__import__(name), "__version__", "?")
        except ImportError:
            versions[name] = "not installed"
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda, **versions,
                python=platform.python_version(),
                command="python -m benchmarks.backward " + " ".join(sys.argv[1:] if argv is None else argv),
                date=time.strftime("%Y-%m-%d"), rounds=args.rounds, quick=args.quick, dtype=DTYPE,
                block_dv=args.block_dv, kernel=kernel_digest())


def kernel_digest():
    """The digest of stage 6's kernel file as bench.py computes it for a stage's kernels."""
    return bench.program_digest(Path(__file__).resolve().parent.parent.joinpath(
        "stages", "s06_backward", "kernel.py").read_text())


def write_meta(out, meta, started, complete):
    meta = dict(meta, seconds=round(time.monotonic() - started), complete=complete)
    (Path(out) / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
