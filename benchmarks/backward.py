"""Stage 6 against FLA 0.6.0's chunk_kda, forward and backward, measured as benchmarks/fair.py measures
the forward: kernels alone and whole calls apart, in interleaved rounds, with the spread over rounds.

    python -m benchmarks.backward --out DIR [--quick] [--rounds 3] [--shapes ...] [--block-dv 32|64]
                                  [--no-fla] [--deadline SECONDS]

At each shape (bench.SHAPES by default; bf16, d_k = d_v = 128, the benchmark's inputs and a random
dLoss/do) it times:

- ours `fwd_bwd_kernels`: stage 5's two forward kernels and the five backward kernels
  (stages.kda.calls.run_kernels) on preallocated inputs, as one CUDA graph; `backward_kernels`
  the backward's five alone; each backward kernel alone (`prepare`, `states`, `state_gradient`,
  `state_products`, `intra`) on the outputs of the one before. Each is built as the calls build
  it at this shape, with the KernelConfig stages.kda.config.resolve gives it on this GPU (the
  recurrence and the backward's chunk loops: 64 value columns where B * H * d_v / 64 programs fill
  the SMs, else 32), the backward's block_dv set by --block-dv if given;
- ours `fwd_bwd_call`: stages.kda.calls.forward then backward, as a caller runs them, value
  checks off (checks="off": FLA checks no values either); `fwd_bwd_call_default`: the same calls with
  their default checks (checks="device": each kernel flags a bad gate or beta on the device, no host
  sync), what a caller pays who passes nothing; `fwd_bwd_call_kept`: checks off, the forward's prepare
  outputs kept for the backward (chunk_kda's disable_recompute=True: forward_and_prepared, then
  backward with prepared=), one kernel fewer for six tensors of memory;
- FLA `fwd_bwd_call`: chunk_kda forward, then torch.autograd.grad of its output with dLoss/do, as a
  caller runs them; FLA `fwd_bwd_call_kept`: the same with FLA's disable_recompute=True (its forward
  keeps its intermediate tensors for the backward); FLA `backward_call`: torch.autograd.grad alone, on
  a kept forward graph. FLA's forward + backward is not captured as a graph (FLA_GRAPH_NOT_TRIED says
  why).

The order, each step logged with the seconds since the start: every kernel of every shape compiled
at once in threads (TileLang lowers without the GIL, nvcc is a subprocess); then per shape, each of
our kernels called once and waited for (its first call loads it), ours captured and timed (round 1,
in the CSV before FLA is touched), FLA's first call (Triton compiles and autotunes its kernels there:
minutes on a fresh machine), our gradients checked against FLA's, FLA timed (round 1), then rounds 2
on with every measurement, each round in the reverse order of the one before. --no-fla times ours alone. A measurement that does not capture as a graph is timed with CUDA
events around the launches instead (the row's `method` says which). Every time is the median of
triton.testing.do_bench's timings after warm-up.

Writes DIR/backward.csv (one row per round and measurement) and DIR/backward_meta.json (machine,
versions, command, the kernels' digest, per shape the block_dv of both passes and rel L2 of our
gradients against FLA's; "complete": false until the run ends). Commit them as
benchmarks/results/backward.csv and backward_meta.json.
"""

import argparse
import gc
import json
import sys
import time
import traceback
from pathlib import Path

from benchmarks import bench, fair
from stages.common.program_digest import modules_digest

SHAPES = bench.SHAPES  # B, N, H, D
QUICK_SHAPES = [(1, 4096, 32, 128), (8, 4096, 16, 128)]
ROUNDS, QUICK_ROUNDS = 3, 2
DTYPE = "bfloat16"
BACKWARD_KERNELS = ("prepare", "states", "state_gradient", "state_products", "intra")
# (impl, what) in the order of an odd round; even rounds run it backwards
MEASUREMENTS = [("fla", "fwd_bwd_call"), ("ours", "fwd_bwd_call"), ("ours", "fwd_bwd_call_default"),
                ("fla", "fwd_bwd_call_kept"),
                ("ours", "fwd_bwd_call_kept"), ("fla", "fwd_bwd_kernels"),
                ("ours", "fwd_bwd_kernels"), ("fla", "backward_call"), ("ours", "backward_kernels"),
                *(("ours", kernel) for kernel in BACKWARD_KERNELS)]
FIELDS = ["round", "B", "N", "H", "D", "dtype", "impl", "what", "method", "time_ms", "error"]
CSV_NAME, META_NAME = "backward.csv", "backward_meta.json"
# Capturing FLA's forward + backward (autograd) as a graph failed on the H200 (2026-12-01:
# cudaErrorStreamCaptureInvalidated, autograd's AccumulateGrad on another stream), and the next graph
# replay in that process met an illegal memory access: FLA is timed as calls only.
FLA_GRAPH_NOT_TRIED = ("not tried: capturing autograd's backward invalidated the capture on the H200 and "
                       "left the process unable to replay graphs")
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta")
KERNEL_MODULE = "stages.s06_backward.kernel"  # what kernel_digest covers: it names every builder a training step runs


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
                        help="value columns per program of the backward's two chunk loops (default: the call's)")
    parser.add_argument("--no-fla", action="store_true", help="time ours alone (no FLA set-up, no ratios)")
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
    calls, and ours' backward kernels against FLA's backward call; what our default checks cost (our
    call with them against our call without)."""
    pairs = {"fwd+bwd FLA call / ours kernels": (("fla", "fwd_bwd_call"), ("ours", "fwd_bwd_kernels")),
             "fwd+bwd call FLA / ours": (("fla", "fwd_bwd_call"), ("ours", "fwd_bwd_call")),
             "fwd+bwd call FLA / ours, forward tensors kept": (("fla", "fwd_bwd_call"), ("ours", "fwd_bwd_call_kept")),
             "fwd+bwd call, both keeping, FLA / ours": (("fla", "fwd_bwd_call_kept"), ("ours", "fwd_bwd_call_kept")),
             "fwd+bwd call FLA / ours, default checks": (("fla", "fwd_bwd_call"), ("ours", "fwd_bwd_call_default")),
             "ours fwd+bwd call, default checks / checks off": (("ours", "fwd_bwd_call_default"),
                                                                ("ours", "fwd_bwd_call")),
             "backward FLA call / ours kernels": (("fla", "backward_call"), ("ours", "backward_kernels"))}
    return {shape: {name: fair.paired(measured, fla, ours, _ratio) for name, (fla, ours) in pairs.items()}
            for shape, measured in fair.times(rows).items()}


def summary(rows):
    """One line per shape: ours' median times over rounds (ms), then the FLA / ours ratios measured."""
    ratios = comparisons(rows)
    lines = []
    for shape, measured in sorted(fair.summarize(rows).items()):
        ours = [f"{what} {measured[('ours', what)].text()} ms"
                for what in ("fwd_bwd_kernels", "fwd_bwd_call", "backward_kernels") if ("ours", what) in measured]
        named = [f"{name} {spread.text('{:.2f}')}" for name, spread in ratios[shape].items() if spread is not None]
        lines.append(f"B={shape[0]} N={shape[1]} H={shape[2]} D={shape[3]}: ours " + ", ".join(ours)
                     + "".join(f"; {text}" for text in named))
    return lines


def _ratio(a, b):
    return a / b


def open_writer(path):
    """A csv.DictWriter over FIELDS on `path`, header written, every row flushed at once."""
    import csv

    f = open(path, "w", newline="")
    writer = bench.flushing(csv.DictWriter(f, FIELDS), f)
    writer.writeheader()
    return writer, f


# ------------------------------------------------------------------ on the GPU

def configs(B, H, D, num_sms, backward_block_dv=None):
    """(the forward's KernelConfig, the backward's) at this shape on a GPU of num_sms SMs: what a training
    step's forward and backward resolve (both at the backward's chunk, DEFAULT_CHUNK_SIZE), the backward's
    block_dv set by --block-dv if given."""
    from stages.kda.config import DEFAULT_CHUNK_SIZE, resolve

    return (resolve(B, H, D, D, num_sms, chunk_size=DEFAULT_CHUNK_SIZE),
            resolve(B, H, D, D, num_sms, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=backward_block_dv))


def compile_all(shapes, backward_block_dv, num_sms, log):
    """Every kernel of every shape compiled up front, all at once in threads (the forward's two, the
    default call's prepare that flags bad values, forward_and_prepared's prepare, the backward's five
    and its flagged prepare), each by the call the library makes for it; returns {shape: the first
    failure's message} for the shapes that did not compile."""
    import functools

    from stages.common.tilelang_tools import compile_in_threads
    from stages.kda.backward import kernel_arguments
    from stages.kda.compiled import compiled_backward_kernel

    jobs, shape_of = {}, {}
    for B, N, H, D in shapes:
        forward_config, backward_config = configs(B, H, D, num_sms, backward_block_dv)
        compiles = fair.forward_compiles(B, N, H, D, forward_config)
        # the prepare the forward's default call launches: the one that flags bad values
        compiles["flagged prepare"] = fair.forward_compiles(B, N, H, D, forward_config, value_flags=True)["prepare"]
        arguments = kernel_arguments(B, N, H, D, D, backward_config.chunk_size, backward_config.block_dv, DTYPE)
        for name in arguments:
            # as compiled_backward_kernels compiles them; the backward's prepare is the forward's with
            # A_kk and T as outputs too, the one forward_and_prepared launches (fwd_bwd_call_kept): one
            # cache entry for both
            compiles[f"backward {name}" if name == "prepare" else name] = functools.partial(
                compiled_backward_kernel, name, *arguments[name], value_flags=False)
        # and the backward's default call's prepare, which flags bad values too
        compiles["backward flagged prepare"] = functools.partial(compiled_backward_kernel, "prepare",
                                                                 *arguments["prepare"], value_flags=True)
        for name, compile in compiles.items():
            key = f"{name} at B={B} N={N} H={H} D={D}"
            jobs[key], shape_of[key] = compile, (B, N, H, D)
    log(f"compiling {len(jobs)} kernels in threads")
    failures = {}
    for key, result in compile_in_threads(jobs, log).items():
        if isinstance(result, Exception):
            failures.setdefault(shape_of[key], f"{key}: {fair.failure_text(result)}")
    return failures


class Shape:
    """One shape's inputs, callables and captured graphs, kept for all rounds: ours set up first
    (compiled already, by compile_all), FLA's by setup_fla."""

    def __init__(self, B, N, H, D, backward_block_dv, log):
        import torch

        from stages.kda.calls import backward, forward, forward_and_prepared, run_kernels
        from stages.kda.compiled import compiled_backward_kernels
        from stages.kda.config import streaming_multiprocessors

        self.B, self.N, self.H, self.D = B, N, H, D
        self.label = f"B={B} N={N} H={H} D={D}"
        self.errors, self.methods, self.functions = {}, {}, {}
        q, k, v, g, beta = bench.make_inputs(bench.STAGES["s05"], B, N, H, D, torch.bfloat16)
        do = torch.randn(q.shape, device=q.device, generator=torch.Generator(q.device).manual_seed(1)).to(q.dtype)
        self.inputs = (q, k, v, g, beta, do)
        state = torch.zeros(B, H, D, D, dtype=torch.float32, device=q.device)
        self.forward_config, self.backward_config = configs(B, H, D, streaming_multiprocessors(q.device),
                                                            backward_block_dv)
        C = self.backward_config.chunk_size
        if N % C:
            raise ValueError(f"N = {N} must be a multiple of the chunk size {C} here (the kernels take padded inputs)")
        # the forward's two kernels as forward() launches them at this shape, the backward's as backward() does
        forward_prepare, recurrence = (compile() for compile in
                                       fair.forward_compiles(B, N, H, D, self.forward_config).values())
        kernels = compiled_backward_kernels(B, N, H, D, D, C, self.backward_config.block_dv, DTYPE, value_flags=False)
        # the calls take a config only where --block-dv sets one: a caller who passes nothing resolves it
        config = None if backward_block_dv is None else self.backward_config

        def backward_kernels():
            return run_kernels(kernels, q, k, v, g, beta, do, state, state)

        def forward_and_backward_kernels():
            recurrence(*forward_prepare(q, k, v, g, beta), state)
            return backward_kernels()

        def ours_call():
            forward(q, k, v, g, beta, checks="off")
            return backward(q, k, v, g, beta, do, checks="off", config=config)

        def ours_call_default():
            forward(q, k, v, g, beta)
            return backward(q, k, v, g, beta, do, config=config)

        def ours_call_kept():
            _, _, prepared = forward_and_prepared(q, k, v, g, beta, checks="off")
            return backward(q, k, v, g, beta, do, checks="off", config=config, prepared=prepared)

        launches = {"fwd_bwd_kernels": forward_and_backward_kernels, "backward_kernels": backward_kernels,
                    **self._first_calls(kernels, forward_prepare, recurrence, q, k, v, g, beta, do, state, log)}
        # the default calls' prepares that flag bad values (the forward's, the backward's) load here too,
        # and the kept call's forward prepare (cached apart from the backward's, though the same program)
        self._first_call("default_calls", ours_call_default, log)
        self._first_call("kept_call", ours_call_kept, log)
        for what, launch in launches.items():
            started = time.monotonic()
            self._graph_or_events(("ours", what), launch, log)
            log(f"{self.label}: ours {what} captured ({self.methods[('ours', what)]}) in "
                f"{time.monotonic() - started:.1f} s")

        for what, call in (("fwd_bwd_call", ours_call), ("fwd_bwd_call_default", ours_call_default),
                           ("fwd_bwd_call_kept", ours_call_kept)):
            self.functions[("ours", what)], self.methods[("ours", what)] = call, "events"
        self.ours_gradients = backward_kernels()[:5]
        self.rel_l2_vs_fla = None
        torch.cuda.synchronize()

    def setup_fla(self, log):
        """FLA's first forward + backward (Triton compiles and autotunes its kernels: minutes on a fresh
        machine), our gradients against its, then its calls and its CUDA graph."""
        import torch

        started = time.monotonic()
        try:
            fla_forward_backward, fla_backward, fla_kept = _fla_calls(*self.inputs)
            fla_gradients = fla_forward_backward()
            torch.cuda.synchronize()
            log(f"{self.label}: FLA's first forward + backward (compile, autotune) in {time.monotonic() - started:.0f} s")
            self.rel_l2_vs_fla = {name: bench.relative_l2(a, b)
                                  for name, a, b in zip(GRADIENTS, self.ours_gradients, fla_gradients)}
            del fla_gradients
            for what, function in (("fwd_bwd_call", fla_forward_backward), ("backward_call", fla_backward),
                                   ("fwd_bwd_call_kept", fla_kept)):
                self.functions[("fla", what)], self.methods[("fla", what)] = function, "events"
            self.errors[("fla", "fwd_bwd_kernels")] = FLA_GRAPH_NOT_TRIED
        except Exception as failure:  # FLA missing or failing: ours is still measured
            for what in ("fwd_bwd_call", "backward_call", "fwd_bwd_kernels", "fwd_bwd_call_kept"):
                self.errors.setdefault(("fla", what), fair.failure_text(failure))
            log(f"{self.label}: FLA failed: {fair.failure_text(failure)}")
        torch.cuda.synchronize()

    def notes(self):
        """What the meta file keeps of this shape."""
        return {"rel_l2_ours_vs_fla": self.rel_l2_vs_fla, "forward_block_dv": self.forward_config.block_dv,
                "backward_block_dv": self.backward_config.block_dv,
                "methods": {f"{i} {w}": m for (i, w), m in self.methods.items()}}

    def _first_calls(self, kernels, forward_prepare, recurrence, q, k, v, g, beta, do, state, log):
        """{kernel name: a launch of it alone}, each on the outputs of the kernels before it, which each
        kernel's first call computes here: one kernel at a time, waited for and logged with its seconds.
        A compiled kernel's first call still builds and loads its host library (TVM's Executable.jit),
        so no capture pays for that, and a kernel that never returns is named by the log."""
        def first_call(name, launch):
            return self._first_call(name, launch, log)

        forward_prepared = first_call("forward_prepare", lambda: forward_prepare(q, k, v, g, beta))
        first_call("recurrence", lambda: recurrence(*forward_prepared, state))
        prepared = first_call("prepare", lambda: kernels["prepare"](q, k, v, g, beta))  # with A_kk and T
        w, u, q_decayed, k_to_chunk_end, a_qk, chunk_decay, a_kk, inverse = prepared
        states, v_new = first_call("states", lambda: kernels["states"](w, u, k_to_chunk_end, chunk_decay, state))
        d_states, dv_new, _ = first_call("state_gradient", lambda: kernels["state_gradient"](
            q_decayed, k_to_chunk_end, w, a_qk, chunk_decay, do, state))
        products = first_call("state_products", lambda: kernels["state_products"](
            states, d_states, v_new, dv_new, do, chunk_decay))
        first_call("intra", lambda: kernels["intra"](q, k, v, g, beta, a_kk, inverse, do, v_new, dv_new, *products))
        return {
            "prepare": lambda: kernels["prepare"](q, k, v, g, beta),
            "states": lambda: kernels["states"](w, u, k_to_chunk_end, chunk_decay, state),
            "state_gradient": lambda: kernels["state_gradient"](q_decayed, k_to_chunk_end, w, a_qk, chunk_decay, do,
                                                                state),
            "state_products": lambda: kernels["state_products"](states, d_states, v_new, dv_new, do, chunk_decay),
            "intra": lambda: kernels["intra"](q, k, v, g, beta, a_kk, inverse, do, v_new, dv_new, *products),
        }

    def _first_call(self, name, launch, log):
        """launch(), waited for and logged with its seconds; returns its outputs."""
        import torch

        started = time.monotonic()
        outputs = launch()
        torch.cuda.synchronize()
        log(f"{self.label}: first call of {name} in {time.monotonic() - started:.1f} s")
        return outputs

    _graph = fair.Shape._graph
    _graph_or_events = fair.Shape._graph_or_events

    def measure(self, round_number, writer, log, order, timer):
        """Time the measurements of `order` that this shape has (a failed set-up is written as its error)."""
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
                    row["error"] = fair.failure_text(failure)
                    traceback.print_exc()
            else:
                continue
            writer.writerow(row)
            log(f"round {round_number} {self.label} {impl} {what}: {row.get('time_ms', 'failed')} ms "
                f"({row['method']}){' ' + row['error'] if row.get('error') else ''}")


def _fla_calls(q, k, v, g, beta, do):
    """FLA's forward + backward, its backward alone, and its forward + backward with disable_recompute,
    as a training step calls them (autograd), with the course's conventions (no scale); each returns
    (dq, dk, dv, dg, dbeta)."""
    import torch
    from fla.ops import chunk_kda

    leaves = [x.detach().clone().requires_grad_() for x in (q, k, v, g, beta)]

    def forward_backward(disable_recompute=False):
        with torch.enable_grad():
            o = chunk_kda(*leaves, scale=1.0, disable_recompute=disable_recompute)[0]
            return torch.autograd.grad(o, leaves, do)

    with torch.enable_grad():
        kept = chunk_kda(*leaves, scale=1.0)[0]

    def backward_only():
        return torch.autograd.grad(kept, leaves, do, retain_graph=True)

    return forward_backward, backward_only, lambda: forward_backward(disable_recompute=True)


def make_timer(quick):
    """fair's timer, without its torch.no_grad (FLA's backward needs autograd)."""
    from triton.testing import do_bench

    warmup, rep = (10, 40) if quick else (25, 100)
    return lambda function: float(do_bench(function, warmup=warmup, rep=rep, return_mode="median"))


def run(args, log, started):
    """Compile everything, then shape by shape: ours set up and timed (round 1), FLA set up and timed
    (round 1), then rounds 2 on with everything interleaved. Ours' times are in the CSV and the log
    before FLA's first call, which can take minutes on a fresh machine."""
    import torch

    from stages.kda.config import streaming_multiprocessors

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = None if args.deadline is None else started + args.deadline
    timer = make_timer(args.quick)
    notes = {}
    writer, f = open_writer(out / CSV_NAME)
    measurements = [key for key in MEASUREMENTS if key[0] == "ours" or not args.no_fla]
    try:
        failed = compile_all(args.shapes, args.block_dv, streaming_multiprocessors(torch.device("cuda")), log)
        for B, N, H, D in args.shapes:
            bench.check_deadline(deadline)
            label = f"B={B} N={N} H={H} D={D}"
            log(f"{label}: set up ours (capture graphs)")
            try:
                if (B, N, H, D) in failed:
                    raise RuntimeError(failed[(B, N, H, D)])
                shape = Shape(B, N, H, D, args.block_dv, log)
            except Exception as failure:
                traceback.print_exc()
                notes[label] = {"error": fair.failure_text(failure)}
                writer.writerow(dict(round=0, B=B, N=N, H=H, D=D, dtype=DTYPE, impl="ours", what="setup",
                                     error=fair.failure_text(failure)))
                torch.cuda.empty_cache()
                continue
            try:
                notes[label] = shape.notes()
                shape.measure(1, writer, log, [key for key in measurements if key[0] == "ours"], timer)
                if not args.no_fla:
                    bench.check_deadline(deadline)
                    shape.setup_fla(log)
                    notes[label] = shape.notes()
                    log(f"{label}: rel L2 ours vs FLA {shape.rel_l2_vs_fla}")
                    shape.measure(1, writer, log, [key for key in measurements if key[0] == "fla"], timer)
                for round_number in range(2, args.rounds + 1):
                    bench.check_deadline(deadline)
                    order = measurements if round_number % 2 else measurements[::-1]
                    shape.measure(round_number, writer, log, order, timer)
            finally:
                del shape
                gc.collect()
                torch.cuda.empty_cache()
    except bench.Deadline:
        log("deadline reached: no new shape, round or FLA set-up started")
    finally:
        f.close()
    return notes


def main(argv=None):
    args = parse_args(argv)
    if bench.cuda_is_missing("benchmarks.backward"):
        return 2

    started = time.monotonic()
    log = bench.seconds_log(started)

    log(f"shapes {args.shapes}, {args.rounds} rounds, out {args.out}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    meta = run_meta(args, argv)
    write_meta(args.out, meta, started, complete=False)
    meta["shapes"] = run(args, log, started)
    write_meta(args.out, meta, started, complete=True)
    for line in summary(fair.read_rows(Path(args.out) / CSV_NAME)):
        log(line)
    log(f"done: {args.out}/{CSV_NAME}, {META_NAME}")
    return 0


def run_meta(args, argv):
    return dict(bench.run_meta("benchmarks.backward", argv), rounds=args.rounds, quick=args.quick, dtype=DTYPE,
                block_dv=args.block_dv, no_fla=args.no_fla, kernel=kernel_digest())


def kernel_digest():
    """The digest of the builders of every kernel the run times (the forward's and the backward's), as
    bench.py computes it for a stage's kernels."""
    return modules_digest((KERNEL_MODULE,))


def write_meta(out, meta, started, complete):
    meta = dict(meta, seconds=round(time.monotonic() - started), complete=complete)
    (Path(out) / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
