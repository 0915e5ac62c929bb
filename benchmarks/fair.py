"""Stage 5 against FLA 0.6.0's chunk_kda, measured fairly: kernels alone and whole calls apart, in
interleaved rounds, with the spread over the rounds.

    python -m benchmarks.fair --out DIR [--quick] [--rounds 3] [--deadline SECONDS]

At each shape (bench.SHAPES and B=4, N=8192, H=32; bf16, d_k = d_v = 128, the benchmark's inputs)
it first compiles, autotunes, captures and checks (ours against FLA), then times, in each round:

- ours `kernels`: the prepare and the recurrence kernel alone, on preallocated inputs, as one CUDA
  graph replayed (no Python, no checks, no allocation of the inputs); `prepare` and `recurrence`
  each alone the same way (the roofline's points); if a graph does not capture, CUDA events around
  the launches instead (the row's `method` says which);
- ours `call`: stage 5's forward as a caller runs it, checks="device" (the default: the prepare
  kernel flags bad values, no host sync), and `call_unchecked` with checks="off" (the kernel
  without the flags); `value_check`: the check checks="host" adds, alone
  (stages.common.torch_checks.check_gate_values: one pass and a sync; no range check, any gate runs);
- ours `prepare_flagged`: the prepare kernel forward's default call launches (it flags bad values as
  it loads g and beta), alone as a CUDA graph: what the flags cost the kernels;
- FLA `call`: chunk_kda as a caller runs it, once per shape and round, and FLA `kernels`: the same
  call captured as a CUDA graph, if it captures.

The kernels are built as forward builds them at each shape, with the KernelConfig that
stages.kda.config.resolve_for gives that shape on this GPU.

The inputs are the benchmark's (bench.make_inputs: gates a = e^g uniform in bench.GATE_RANGE), or with
--gate-range LOW,HIGH gates a uniform in [LOW, HIGH]: 0.000001,0.0001 makes every diagonal sub-block's
gates span more than the anchored operands hold (8 tokens at -9 to -14 each), the any-gate branch's
worst case.

Every time is the median of CUDA-event timings after warm-up (triton.testing.do_bench, which flushes
the L2 cache before each repeat); each round runs the measurements in the reverse order of the one before, and
the page reports the median over rounds and the min-max. All rounds of a shape run right after its
set-up, and the shape is released before the next one is set up; a deadline stops new rounds and
shapes, so every started shape is timed at least once. The rows of the prepare and recurrence kernels carry their FLOPs and bytes, counted from
their TileLang programs (stages.common.program_cost).

Writes DIR/fair.csv (one row per round and measurement) and DIR/fair_meta.json (machine, versions,
command, kernel digest, this machine's roofs from benchmarks/roofs.py, per shape the config and
rel L2 of ours vs FLA; written first, with the roofs, and completed at the end: a run stopped from outside keeps
"complete": false); named apart from bench.py's files so both can share one DIR. Commit them as
benchmarks/results/fair.csv and fair_meta.json; `course regenerate` turns them into the fair
timings and the roofline of the benchmarks page (kdacourse/pages/fair.py).
"""

import argparse
import csv
import dataclasses
import functools
import gc
import json
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from benchmarks import bench, roofs

SHAPES = [*bench.SHAPES, (4, 8192, 32, 128)]  # B, N, H, D
QUICK_SHAPES = [(1, 4096, 32, 128), (4, 8192, 32, 128)]
ROUNDS = 3
QUICK_ROUNDS = 2
DTYPE = "bfloat16"
# (impl, what) in the order of an odd round; even rounds run it backwards
MEASUREMENTS = [("fla", "call"), ("ours", "call"), ("ours", "call_unchecked"), ("ours", "value_check"),
                ("fla", "kernels"), ("ours", "kernels"), ("ours", "prepare"), ("ours", "recurrence"),
                ("ours", "prepare_flagged")]
KERNEL_PARTS = ("prepare", "recurrence")
FIELDS = ["round", "B", "N", "H", "D", "dtype", "impl", "what", "method", "time_ms", "gemm_flops",
          "elementwise_flops", "bytes_read", "bytes_written", "error"]
CSV_NAME, META_NAME = "fair.csv", "fair_meta.json"


# ------------------------------------------------------------------ arguments (no GPU)

def parse_shapes(text):
    """'1,4096,32,128;8,4096,16,128' -> [(1, 4096, 32, 128), (8, 4096, 16, 128)]."""
    shapes = []
    for part in text.split(";"):
        values = tuple(int(x) for x in part.split(","))
        if len(values) != 4 or min(values) < 1:
            raise argparse.ArgumentTypeError(f"a shape is four positive integers B,N,H,D; got {part!r}")
        shapes.append(values)
    return shapes


def parse_gate_range(text):
    """'0.000001,0.0001' -> (1e-06, 0.0001): 0 < LOW < HIGH <= 1."""
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a gate range is LOW,HIGH; got {text!r}") from None
    if not 0 < low < high <= 1:
        raise argparse.ArgumentTypeError(f"a gate range needs 0 < LOW < HIGH <= 1; got {text!r}")
    return low, high


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for fair.csv and fair_meta.json")
    parser.add_argument("--quick", action="store_true",
                        help=f"{len(QUICK_SHAPES)} shapes, {QUICK_ROUNDS} rounds, shorter timings")
    parser.add_argument("--rounds", type=int, default=None, help=f"rounds (default {ROUNDS}, quick {QUICK_ROUNDS})")
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="B,N,H,D;B,N,H,D;... instead of the benchmark shapes")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which no new shape or round is started (what was measured is kept)")
    parser.add_argument("--gate-range", type=parse_gate_range, default=bench.GATE_RANGE,
                        help=f"LOW,HIGH: gates a = e^g uniform in [LOW, HIGH] (default {bench.GATE_RANGE})")
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.shapes = args.shapes or (QUICK_SHAPES if args.quick else SHAPES)
    args.rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    return args


# ------------------------------------------------------------------ statistics (no GPU)

@dataclass(frozen=True)
class Spread:
    """The median of values over rounds, their min and max, and how many there were."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values):
        values = [v for v in values if v is not None]
        if not values:
            return None
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, form="{:.3f}"):
        if self.count == 1:
            return form.format(self.median)
        return f"{form.format(self.median)} ({form.format(self.low)} to {form.format(self.high)})"


def read_rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def times(rows):
    """{(B, N, H, D): {(impl, what): {round: ms}}} from the CSV's rows (rows without a time left out)."""
    table = {}
    for row in rows:
        if not row.get("time_ms"):
            continue
        shape = tuple(int(row[key]) for key in ("B", "N", "H", "D"))
        table.setdefault(shape, {}).setdefault((row["impl"], row["what"]), {})[int(row["round"])] = float(row["time_ms"])
    return table


def summarize(rows):
    """{shape: {(impl, what): Spread of the time over rounds}}."""
    return {shape: {key: Spread.of(by_round.values()) for key, by_round in measured.items()}
            for shape, measured in times(rows).items()}


def paired(measured, numerator, denominator, combine):
    """Spread over rounds of combine(numerator's time, denominator's time), taken round by round (both
    measured in the same round, minutes apart at most); None if no round has both."""
    top, bottom = measured.get(numerator, {}), measured.get(denominator, {})
    return Spread.of([combine(top[r], bottom[r]) for r in sorted(set(top) & set(bottom))])


def comparisons(rows):
    """{shape: {name: Spread}}: FLA / ours for the kernels alone and for the whole call (checks off and
    on), and what the value check costs (call minus call_unchecked, and the check timed alone)."""
    ratio, difference = (lambda a, b: a / b), (lambda a, b: a - b)
    result = {}
    for shape, measured in times(rows).items():
        result[shape] = {
            "kernels FLA / ours": paired(measured, ("fla", "kernels"), ("ours", "kernels"), ratio),
            "call FLA / ours unchecked": paired(measured, ("fla", "call"), ("ours", "call_unchecked"), ratio),
            "call FLA / ours checked": paired(measured, ("fla", "call"), ("ours", "call"), ratio),
            "check cost (call - unchecked)": paired(measured, ("ours", "call"), ("ours", "call_unchecked"), difference),
            "check alone": Spread.of(measured.get(("ours", "value_check"), {}).values()),
            "call, checks on / off": paired(measured, ("ours", "call"), ("ours", "call_unchecked"), ratio),
            "flags in the prepare (% of the kernels)": share_of_kernels(measured, "prepare_flagged", "prepare"),
            # the runs in benchmarks/results/fair_checks/ and fair_any_gate_worst/ also timed a prepare
            # built without the any-gate branch (prepare_bounded_gate), which the kernels no longer build
            "any-gate branch (% of the kernels)": share_of_kernels(measured, "prepare", "prepare_bounded_gate"),
        }
    return result


def share_of_kernels(measured, with_it, without_it):
    """Spread over rounds of (with_it - without_it) / the kernels' time, in percent: what one prepare
    kernel's addition costs the forward's kernels."""
    kernels = measured.get(("ours", "kernels"), {})
    top, bottom = measured.get(("ours", with_it), {}), measured.get(("ours", without_it), {})
    return Spread.of([100 * (top[r] - bottom[r]) / kernels[r] for r in sorted(set(top) & set(bottom) & set(kernels))])


def open_writer(path):
    """A csv.DictWriter over FIELDS on `path`, header written, every row flushed at once (a run stopped
    from outside keeps its rows); returns (writer, file)."""
    f = open(path, "w", newline="")
    writer = bench.flushing(csv.DictWriter(f, FIELDS), f)
    writer.writeheader()
    return writer, f


# ------------------------------------------------------------------ on the GPU

def program_costs(B, N, H, D, num_sms):
    """{kernel: Cost} of stage 5's two programs at this shape, as forward builds them on a GPU of
    num_sms SMs."""
    from stages.common.program_cost import program_cost
    from stages.kda.config import resolve
    from stages.kda.prepare import build_prepare_program
    from stages.kda.recurrence import build_recurrence_program

    config = resolve(B, H, D, D, num_sms)
    return {"prepare": program_cost(build_prepare_program(B, N, H, D, D, config.chunk_size, DTYPE,
                                                          config.prepare_threads)),
            "recurrence": program_cost(build_recurrence_program(B, N, H, D, D, config.chunk_size, config.block_dv,
                                                                DTYPE, config.num_stages, config.threads))}


def forward_compiles(B, N, H, D, config, value_flags=False, keep_prepared=False):
    """{"prepare": ..., "recurrence": ...}: functions that compile forward's two kernels for this shape
    and config (value_flags: the prepare of the default call, checks="device"; keep_prepared: the one
    of forward_and_prepared, with A_kk and T as outputs too), with the arguments written as forward
    writes them: functools.cache keys on them as written, so forward's calls find these compiled."""
    from stages.kda.compiled import compiled_prepare, compiled_recurrence

    C = config.chunk_size
    return {"prepare": functools.partial(compiled_prepare, B, N, H, D, D, C, DTYPE, config.prepare_threads,
                                         value_flags, solve_outputs=keep_prepared),
            "recurrence": functools.partial(compiled_recurrence, B, N, H, D, D, C, config.block_dv, DTYPE,
                                            config.num_stages, config.threads, config.programs_per_sm)}


def capture(function):
    """A CUDA graph of one call of `function` (warmed up on a side stream first, as torch asks)."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            function()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        function()
    torch.cuda.synchronize()
    return graph


class Shape:
    """One shape's inputs, callables and captured graphs, kept for all rounds."""

    def __init__(self, B, N, H, D, log, gate_range=bench.GATE_RANGE):
        import torch

        from stages.common.device_checks import flags_for
        from stages.common.torch_checks import check_gate_values
        from stages.kda.calls import forward
        from stages.kda.config import resolve_for, streaming_multiprocessors

        self.B, self.N, self.H, self.D = B, N, H, D
        self.label = f"B={B} N={N} H={H} D={D}"
        self.errors, self.methods, self.functions = {}, {}, {}
        q, k, v, g, beta = bench.make_inputs(bench.STAGES["s05"], B, N, H, D, torch.bfloat16, gate_range)
        self.config = resolve_for(q.device, B, H, D, D)  # what forward resolves at this shape
        prepare, recurrence = (compile() for compile in forward_compiles(B, N, H, D, self.config).values())
        state = torch.zeros(B, H, D, D, dtype=torch.float32, device=q.device)
        prepared = prepare(q, k, v, g, beta)
        self.costs = program_costs(B, N, H, D, streaming_multiprocessors(q.device))
        flagged = forward_compiles(B, N, H, D, self.config, value_flags=True)["prepare"]()
        flags = flags_for(q.device)
        launches = {"kernels": lambda: recurrence(*prepare(q, k, v, g, beta), state),
                    "prepare": lambda: prepare(q, k, v, g, beta),
                    "recurrence": lambda: recurrence(*prepared, state),
                    "prepare_flagged": lambda: flagged(q, k, v, g, beta, flags)}
        for what, launch in launches.items():
            self._graph_or_events(("ours", what), launch, log)
        self.functions[("ours", "call")] = lambda: forward(q, k, v, g, beta)
        self.functions[("ours", "call_unchecked")] = lambda: forward(q, k, v, g, beta, checks="off")
        # the check forward(checks="host") makes (it takes any gate: no range check)
        self.functions[("ours", "value_check")] = lambda: check_gate_values(g, beta)
        for key in (("ours", "call"), ("ours", "call_unchecked"), ("ours", "value_check")):
            self.methods[key] = "events"
        ours_output, _ = forward(q, k, v, g, beta, checks="off")
        self.rel_l2_vs_fla = None
        try:
            fla_call = bench.fla(bench.STAGES["s05"])
            fla_output = fla_call(q, k, v, g, beta)  # compiles and autotunes FLA's kernels for this shape
            self.rel_l2_vs_fla = bench.relative_l2(ours_output, fla_output)
            del fla_output
            self.functions[("fla", "call")], self.methods[("fla", "call")] = (lambda: fla_call(q, k, v, g, beta)), "events"
            self._graph(("fla", "kernels"), lambda: fla_call(q, k, v, g, beta), log)
        except Exception as failure:  # FLA missing or failing: ours is still measured
            self.errors.setdefault(("fla", "call"), failure_text(failure))
            self.errors.setdefault(("fla", "kernels"), failure_text(failure))
            log(f"{self.label}: FLA failed: {failure_text(failure)}")
        del ours_output
        torch.cuda.synchronize()

    def _graph(self, key, launch, log):
        try:
            graph = capture(launch)
        except Exception as failure:
            self.errors[key] = f"no CUDA graph: {failure_text(failure)}"
            log(f"{self.label}: {key[0]} {key[1]} did not capture: {failure_text(failure)}")
            _recover()
            return False
        self.functions[key], self.methods[key] = graph.replay, "graph"
        return True

    def _graph_or_events(self, key, launch, log):
        if not self._graph(key, launch, log):  # CUDA events around the launches themselves instead
            self.errors.pop(key)
            self.functions[key], self.methods[key] = launch, "events"

    def measure(self, round_number, writer, log, order, timer):
        for key in order:
            impl, what = key
            row = dict(round=round_number, B=self.B, N=self.N, H=self.H, D=self.D, dtype=DTYPE, impl=impl,
                       what=what, method=self.methods.get(key, ""))
            if impl == "ours" and what in KERNEL_PARTS:
                row.update(self.costs[what].as_row())
            if key in self.errors:
                row["error"] = self.errors[key]
            elif key in self.functions:
                try:
                    row["time_ms"] = f"{timer(self.functions[key]):.4f}"
                except Exception as failure:  # recorded, the run goes on
                    row["error"] = failure_text(failure)
                    traceback.print_exc()
            else:
                continue
            writer.writerow(row)
            log(f"round {round_number} {self.label} {impl} {what}: {row.get('time_ms', 'failed')} ms "
                f"({row['method']}){' ' + row['error'] if row.get('error') else ''}")


def failure_text(failure):
    """An exception as one short line for a CSV row or a log: its type and the first 200 characters."""
    return f"{type(failure).__name__}: {str(failure)[:200]}"


def _recover():
    """After a failed capture: let the device finish what it can, so the next measurement starts clean."""
    import torch

    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - a sticky error shows in the next measurement's row
        pass


def make_timer(quick):
    import torch
    from triton.testing import do_bench

    warmup, rep = (10, 40) if quick else (25, 100)

    def timer(function):
        with torch.no_grad():
            return float(do_bench(function, warmup=warmup, rep=rep, return_mode="median"))

    return timer


def print_summary(rows, log):
    for shape, named in sorted(comparisons(rows).items()):
        parts = [f"{name} {spread.text('{:.2f}' if 'FLA' in name else '{:.4f} ms')}"
                 for name, spread in named.items() if spread is not None]
        log(f"B={shape[0]} N={shape[1]} H={shape[2]} D={shape[3]}: " + "; ".join(parts))


def run(args, log, started):
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = None if args.deadline is None else started + args.deadline
    timer = make_timer(args.quick)
    setup_notes = {}
    writer, f = open_writer(out / CSV_NAME)
    try:
        # every round of a shape runs before the next shape is set up, and the shape is then released:
        # a first version set all shapes up before rounds 2 and 3 and met an illegal memory access on
        # returning to an earlier shape's graphs (H200, 2026-11-30), which this order never asks of them
        for B, N, H, D in args.shapes:
            bench.check_deadline(deadline)
            log(f"B={B} N={N} H={H} D={D}: compile, autotune, capture, check")
            try:
                shape = Shape(B, N, H, D, log, args.gate_range)
            except Exception as failure:
                traceback.print_exc()
                setup_notes[f"B={B} N={N} H={H} D={D}"] = {"error": failure_text(failure)}
                writer.writerow(dict(round=0, B=B, N=N, H=H, D=D, dtype=DTYPE, impl="ours", what="setup",
                                     error=failure_text(failure)))
                torch.cuda.empty_cache()
                continue
            setup_notes[shape.label] = {"rel_l2_ours_vs_fla": shape.rel_l2_vs_fla,
                                        "config": dataclasses.asdict(shape.config),
                                        "methods": {f"{i} {w}": m for (i, w), m in shape.methods.items()}}
            log(f"{shape.label}: rel L2 ours vs FLA {shape.rel_l2_vs_fla}")
            try:
                for round_number in range(1, args.rounds + 1):
                    if round_number > 1:
                        bench.check_deadline(deadline)
                    order = MEASUREMENTS if round_number % 2 else MEASUREMENTS[::-1]
                    shape.measure(round_number, writer, log, order, timer)
            finally:
                del shape  # its graphs and tensors, before the next shape allocates its own
                gc.collect()
                torch.cuda.empty_cache()
    except bench.Deadline:
        log("deadline reached: no new shape or round started")
    finally:
        f.close()
    return setup_notes


def main(argv=None):
    args = parse_args(argv)
    if bench.cuda_is_missing("benchmarks.fair"):
        return 2

    started = time.monotonic()
    log = bench.seconds_log(started)

    log(f"shapes {args.shapes}, {args.rounds} rounds, out {args.out}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    log("measuring the roofs (benchmarks/roofs.py)")
    meta = run_meta(args, argv)
    meta["roofs"] = roofs.measure_or_error()
    log(f"roofs {json.dumps(meta['roofs'])}")  # the log alone then holds every figure of the run
    write_meta(args.out, meta, started, complete=False)  # kept if the run is stopped from outside
    meta["shapes"] = run(args, log, started)
    write_meta(args.out, meta, started, complete=True)
    print_summary(read_rows(Path(args.out) / CSV_NAME), log)
    log(f"done: {args.out}/{CSV_NAME}, {META_NAME}")
    return 0


def run_meta(args, argv):
    """What fair_meta.json records besides the roofs and the shapes' notes."""
    return dict(bench.run_meta("benchmarks.fair", argv), rounds=args.rounds, quick=args.quick, dtype=DTYPE,
                gate_range=list(args.gate_range), kernel=bench.STAGES["s05"].kernel_digest())


def write_meta(out, meta, started, complete):
    meta = dict(meta, seconds=round(time.monotonic() - started), complete=complete)
    (Path(out) / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
