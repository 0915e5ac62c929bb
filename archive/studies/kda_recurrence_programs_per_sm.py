"""The recurrence's programs an SM at Kimi Linear's shapes (issue 40): the fused call (gate, norms and
sigmoid in the prepare, checks off) with the recurrence at 64 or 32 value columns a program and a launch
bound of one, two or three programs an SM, beside FlashKDA, in one process. The bound is the
configuration's `programs_per_sm` (stages.kda.recurrence: `T.annotate_min_blocks_per_sm(n)`, which nvcc
fits the registers to, and the warp groups' registers moved within that share: the loading group keeps
24 a thread and the computing one takes the rest, config.computing_registers; TileLang's own 24 and 240
would ask for more than n programs leave. Of the two committed H100 runs, the first
(benchmarks/results/kda_recurrence_programs_per_sm_h100/) predates that: its bounded programs moved no
registers (`T.no_set_max_nreg()`), every thread of both groups had the bound's share, 128 or 80; the
second (..._h100_registers/) moved them, and ran the mma_state variants).

    python -m archive.studies.kda_recurrence_programs_per_sm --out DIR [--rounds 3] [--repeats 30]
        [--cases A,B] [--variants X,Y]
    TILELANG_CACHE_DIR=DIR python -m archive.studies.kda_recurrence_programs_per_sm --precompile [...]

Why: TileLang launches the recurrence with 256 threads (the 128 asked and a producer warp group) and
hands the consumers 240 registers, so one program fits an SM whatever its shared memory allows
(stages.common.tilelang_tools.compile_report, on the CPU): at T = 8192 and H = 96 the 192 programs of 64
columns run in two waves on 132 SMs. With two an SM (128 registers, no spills) they run in one; with
32 columns, 384 programs at three an SM (80 registers) fit 396 places.

Each variant's call is captured as one CUDA graph; the times are do_bench's medians (L2 flushed) in
interleaved rounds. Every variant's o and final states are compared with the first variant's (the
committed default): the columns a program holds and the launch bound change no arithmetic of a column,
so they should agree bit for bit; with --repeats, each variant is called again and again (any call
that differs from its first is a race), where its o differs logged, and its error against float64
measured (benchmarks.kimi_call.float64_reference). The recurrence kernel's own time comes from torch's
profiler (one profile a variant). --precompile makes the same calls on CPU zeros with CUDA faked, each
program compiled and not run. The default variants are those the committed results ran; the one-stage
ones ask whether the race that two programs an SM show is the pipeline's, the mma_state ones whether
it is the two kinds of tensor-core GEMM side by side (the o path's mma.sync, the state update's wgmma:
here both mma.sync, TileLang's `tl.disable_wgmma` for the recurrence alone; the second run: it is not),
the plain_o_store ones whether it is o's TMA store (`tl.disable_tma_lower`: the computing threads copy
O_s to o themselves; the loading warp group's loads stay TMA, as lowered here), the no_ws one whether it
is the TMA loads or the loading warp group (`tl.disable_warp_specialized` too: 128 threads, the chunk's
operands by cp.async, no TMA anywhere).

Writes DIR/programs_per_sm.csv (case, round, variant, ms), DIR/programs_per_sm_kernels.json and
DIR/programs_per_sm.log.
"""

import argparse
import csv
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import bench
from benchmarks.kimi_call import CASES, D, float64_reference, kimi_form, make_inputs, relative_l2

STUDY_CASES = ("T8192_H64", "T8192_H96", "packed6_H96", "8x1024_H96", "8x4096_H16")
# TileLang pass options (tilelang.transform.PassConfigKey) a variant compiles its recurrence with
NO_TMA = {"tl.disable_tma_lower": True}  # o's TMA store; the warp-specialized loads stay TMA
NO_WGMMA = {"tl.disable_wgmma": True}


@dataclass(frozen=True)
class Variant:
    """How a variant builds the recurrence: its value columns a program, the launch bound, the chunk
    loop's pipeline stages, TileLang's pass options for it, and whether it builds for one sequence only
    (TileLang 0.1.15 does not generate the packed recurrence without warp specialization, CUDA codegen:
    "Downcast from tirx.Sub to ir.IntImm", the trip count read at run time; found by --precompile on
    the CPU)."""

    block_dv: int
    programs_per_sm: int
    num_stages: int
    pass_configs: dict = field(default_factory=dict)
    one_sequence_only: bool = False


VARIANTS = {  # the first is the committed default here
    "dv64": Variant(64, 1, 2),
    "dv64_pp2": Variant(64, 2, 2),
    "dv32": Variant(32, 1, 2),
    "dv32_pp2": Variant(32, 2, 2),
    "dv32_pp3": Variant(32, 3, 2),
    # one stage: the chunk loop's loads not ahead of its use (is the race the pipeline's?)
    "dv64_pp2_one_stage": Variant(64, 2, 1),
    "dv32_pp3_one_stage": Variant(32, 3, 1),
    # the state update's GEMM on mma.sync, as the o path's are, not wgmma (is the race the two kinds of
    # tensor-core GEMM of programs that share an SM?)
    "dv32_pp3_mma_state": Variant(32, 3, 2, NO_WGMMA),
    "dv64_pp2_mma_state": Variant(64, 2, 2, NO_WGMMA),
    # o stored by the threads, not by a TMA store (is the race the store's?), and with no loading warp
    # group either (every thread loads by cp.async, then computes: is it the TMA loads'?)
    "dv64_plain_o_store": Variant(64, 1, 2, NO_TMA),
    "dv64_pp2_plain_o_store": Variant(64, 2, 2, NO_TMA),
    "dv32_pp3_plain_o_store": Variant(32, 3, 2, NO_TMA),
    "dv32_pp3_no_ws": Variant(32, 3, 2, {**NO_TMA, "tl.disable_warp_specialized": True}, one_sequence_only=True),
}
STUDY_VARIANTS = ("dv64", "dv64_pp2", "dv32", "dv32_pp2", "dv32_pp3")  # what both committed runs ran


KEPT = []  # every kernel compiled here, held: a captured graph launches them after the compile caches are emptied


def keep_compiled_kernels():
    """tilelang.compile wrapped so that every kernel it returns stays referenced (KEPT), and the
    recurrence compiled with the pass options of the variant being built (in_variant)."""
    import tilelang

    compile_ = tilelang.compile

    def compile_and_keep(program, *arguments, **options):
        if PASS_CONFIGS and program.attrs["global_symbol"] == "kda_recurrence":
            options["pass_configs"] = {**options.get("pass_configs", {}), **PASS_CONFIGS}
        KEPT.append(compile_(program, *arguments, **options))
        return KEPT[-1]

    tilelang.compile = compile_and_keep


PASS_CONFIGS = {}  # the recurrence's pass options while a variant's programs are built


def in_variant(variant):
    """Set the recurrence's pass options to `variant`'s, and empty the fast path's compile caches where
    they change (a program is cached by its shape and configuration, not by its pass options)."""
    from stages.kda import compiled

    options = VARIANTS[variant].pass_configs
    if options != PASS_CONFIGS:
        PASS_CONFIGS.clear()
        PASS_CONFIGS.update(options)
        for cached in (compiled.compiled_recurrence, compiled.compiled_packed_recurrence,
                       compiled.compiled_prefill_kernels):
            cached.cache_clear()


def variant_config(sequences, H, num_sms, variant: Variant):
    """The default configuration of the shape with the recurrence's columns, stages and bound replaced
    by the variant's."""
    from stages.kda.config import resolve

    return resolve(sequences, H, D, D, num_sms, block_dv=variant.block_dv, num_stages=variant.num_stages,
                   programs_per_sm=variant.programs_per_sm)


def course_call(inputs, config):
    """The fused call as benchmarks.kimi_call's course_unchecked makes it, at `config`."""
    import torch

    from stages.kda.calls import prefill

    t = inputs
    cu_seqlens = None if t["cu_seqlens"] is None else t["cu_seqlens"].to(torch.int32)
    return lambda: prefill(t["q"], t["k"], t["v"], t["x"], t["beta"], cu_seqlens, t["initial_state"], True, "off",
                           config, kimi_form(D ** -0.5), t["A_log"], t["dt_bias"])


def precompile(cases, variants):
    import torch

    from stages.kda.on_cpu import calls_on_cpu, compiled_only

    with calls_on_cpu(compiled_only):
        keep_compiled_kernels()  # around the stand-in: the variants' pass options reach it
        for name in cases:
            lengths, H = CASES[name]
            T, N = sum(lengths), len(lengths)
            zeros = {n: torch.zeros(1, T, H, D, dtype=torch.bfloat16) for n in "qkvx"}
            inputs = dict(zeros, beta=torch.zeros(1, T, H, dtype=torch.bfloat16), A_log=torch.zeros(H),
                          dt_bias=torch.zeros(H, D), initial_state=torch.zeros(N, H, D, D),
                          cu_seqlens=None if N == 1 else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]))
            for variant in variants:
                if N > 1 and VARIANTS[variant].one_sequence_only:
                    print(f"{name} {variant}: not built (one sequence only)", flush=True)
                    continue
                in_variant(variant)
                course_call(inputs, variant_config(N, H, 132, VARIANTS[variant]))()
                print(f"{name} {variant}: compiled", flush=True)


def largest_difference(a, b):
    return (a.float() - b.float()).abs().max().item()


def kernel_times(function, iterations=10):
    """{kernel name: its device time a call in ms} from torch's profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    function()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        for _ in range(iterations):
            function()
        torch.cuda.synchronize()
    return {event.key[:48]: round(event.self_device_time_total / iterations / 1000, 4)
            for event in profiled.key_averages() if event.self_device_time_total > 0}


def check_and_capture(name, variant, call, first, expected, repeats, log, cu_seqlens=None):
    """A variant's call checked against the first variant's (o, final states) `first`, with repeats
    against float64 (`expected`) and against itself, then captured as a CUDA graph; cu_seqlens: a packed
    batch's offsets, for where the calls differ."""
    from benchmarks.fair import capture

    o, state = (x.clone() for x in call())
    log(f"{name} {variant}: largest difference from the first variant's: o "
        f"{largest_difference(o, first[0]):.3e}, state {largest_difference(state, first[1]):.3e}")
    if repeats:
        log(f"{name} {variant}: against float64: o {relative_l2(o, expected[0]):.4e}, "
            f"state {relative_l2(state, expected[1]):.4e}")
        outputs = [call() for _ in range(repeats)]
        differ = [i for i, again in enumerate(outputs)
                  if any(largest_difference(a, b) > 0 for a, b in zip(again, (o, state)))]
        log(f"{name} {variant}: {len(differ)} of {repeats} calls differ from its first"
            + (f" (calls {differ[:10]}); {where_they_differ(outputs[differ[0]][0], o, cu_seqlens)}" if differ else ""))
    return capture(call)


def where_they_differ(o, first_o, cu_seqlens=None, chunk_size=32):
    """Where two o (1 or B, T, H, d_v) differ: how many elements, at which rows of a sequence's chunk and
    which of 64 columns, in how many heads and chunks, and how far before its sequence's end (tokens).
    cu_seqlens: a packed batch's offsets (its sequences start at chunk boundaries of their own)."""
    import torch

    at = (o.float() != first_o.float()).nonzero()
    tokens, heads, columns = at[:, 1], at[:, 2], at[:, 3] % 64
    if cu_seqlens is None:
        starts = torch.zeros_like(tokens)
        ends = torch.full_like(tokens, o.shape[1])
    else:
        offsets = cu_seqlens.to(tokens.device, torch.int64)
        sequence = torch.searchsorted(offsets, tokens, right=True) - 1
        starts, ends = offsets[sequence], offsets[sequence + 1]
    rows, chunks = (tokens - starts) % chunk_size, (tokens - starts) // chunk_size
    before_end = ends - 1 - tokens
    return (f"{len(at)} elements differ, at rows {sorted(set(rows.tolist()))} of a chunk and columns "
            f"{sorted(set(columns.tolist()))} of 64, in {len(torch.unique(heads))} heads and "
            f"{torch.unique(torch.stack([starts, chunks]), dim=1).shape[1]} chunks, {before_end.min().item()} to "
            f"{before_end.max().item()} tokens before their sequence's end")


def run(args):
    import torch
    from triton.testing import do_bench

    from benchmarks.fair import capture
    from stages.kda.config import streaming_multiprocessors

    keep_compiled_kernels()

    started = time.monotonic()
    log_file = open(args.out / "programs_per_sm.log", "a")
    say = bench.seconds_log(started)

    def log(message):
        say(message)
        print(message, file=log_file, flush=True)

    meta = bench.run_meta("archive.studies.kda_recurrence_programs_per_sm", None, ("flash_kda", "tilelang"))
    log(json.dumps(meta))
    num_sms = streaming_multiprocessors(torch.device("cuda"))
    kernels = {}
    with open(args.out / "programs_per_sm.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, ["case", "round", "variant", "block_dv", "programs_per_sm", "num_stages", "time_ms"])
        writer.writeheader()
        for name in args.cases:
            lengths, H = CASES[name]
            inputs = make_inputs(lengths, H)
            graphs, first = {}, None  # first: the first variant's (o, final states)
            expected = float64_reference(inputs) if args.repeats else None
            for variant in args.variants:
                if len(lengths) > 1 and VARIANTS[variant].one_sequence_only:
                    log(f"{name} {variant}: not built (one sequence only)")
                    continue
                in_variant(variant)
                call = course_call(inputs, variant_config(len(lengths), H, num_sms, VARIANTS[variant]))
                if first is None:
                    first = call()
                graphs[variant] = check_and_capture(name, variant, call, first, expected, args.repeats, log,
                                                    inputs["cu_seqlens"])
                kernels[f"{name} {variant}"] = kernel_times(call)
            try:
                import flash_kda  # noqa: F401

                from benchmarks.kimi_call import peer_calls

                graphs["flashkda"] = capture(peer_calls(inputs)[0]["flashkda"])
            except ImportError:
                log("flash_kda does not import: FlashKDA not timed")
            for round_number in range(1, args.rounds + 1):
                order = list(graphs) if round_number % 2 else list(graphs)[::-1]
                for variant in order:
                    ms = do_bench(graphs[variant].replay, warmup=10, rep=60, return_mode="median")
                    built = VARIANTS.get(variant)  # None: FlashKDA
                    writer.writerow(dict(case=name, round=round_number, variant=variant,
                                         block_dv=built.block_dv if built else "",
                                         programs_per_sm=built.programs_per_sm if built else "",
                                         num_stages=built.num_stages if built else "", time_ms=f"{ms:.4f}"))
                f.flush()
            with open(args.out / "programs_per_sm.csv") as read:
                rows = [row for row in csv.DictReader(read) if row["case"] == name]
            medians = {v: statistics.median(float(r["time_ms"]) for r in rows if r["variant"] == v) for v in graphs}
            log(f"{name}: " + ", ".join(f"{v} {ms:.3f} ms" for v, ms in medians.items()))
            del graphs
            torch.cuda.empty_cache()
    (args.out / "programs_per_sm_kernels.json").write_text(json.dumps(kernels, indent=1) + "\n")
    log(f"done in {time.monotonic() - started:.0f} s")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", type=lambda text: text.split(","), default=list(STUDY_CASES))
    parser.add_argument("--variants", type=lambda text: text.split(","), default=list(STUDY_VARIANTS),
                        help=f"comma-separated, of {', '.join(VARIANTS)}")
    parser.add_argument("--repeats", type=int, default=0,
                        help="call each variant this many times more, count calls that differ from its first, and "
                             "measure its first call's error against float64")
    parser.add_argument("--precompile", action="store_true", help="compile the programs on this CPU, run nothing")
    args = parser.parse_args(argv)
    unknown = [variant for variant in args.variants if variant not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}: choose from {', '.join(VARIANTS)}")
    if args.precompile:
        return precompile(args.cases, args.variants)
    if args.out is None:
        parser.error("--out is required on the GPU")
    if bench.cuda_is_missing("archive.studies.kda_recurrence_programs_per_sm"):
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
