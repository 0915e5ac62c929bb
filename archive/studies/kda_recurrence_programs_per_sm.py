"""The recurrence's programs an SM at Kimi Linear's shapes (issue 40): the fused call (gate, norms and
sigmoid in the prepare, checks off) with the recurrence at 64 or 32 value columns a program and a launch
bound of one, two or three programs an SM (KernelConfig.programs_per_sm), beside FlashKDA, in one process.

    python -m archive.studies.kda_recurrence_programs_per_sm --out DIR [--rounds 3] [--cases A,B]
    TILELANG_CACHE_DIR=DIR python -m archive.studies.kda_recurrence_programs_per_sm --precompile [--cases A,B]

Why: TileLang launches the recurrence with 256 threads (the 128 asked and a producer warp group) and
hands the consumers 240 registers, so one program fits an SM whatever its shared memory allows
(stages.common.tilelang_tools.compile_report, on the CPU): at T = 8192 and H = 96 the 192 programs of 64
columns run in two waves on 132 SMs. With two an SM (128 registers, no spills) they run in one; with
32 columns, 384 programs at three an SM (80 registers) fit 396 places.

Each variant's call is captured as one CUDA graph; the times are do_bench's medians (L2 flushed) in
interleaved rounds. Every variant's o and final states are compared with the first variant's (the
committed default): the columns a program holds change no arithmetic of a column, so they should agree
bit for bit. The recurrence kernel's own time comes from torch's profiler (one profile a variant).
--precompile makes the same calls on CPU zeros with CUDA faked, each program compiled and not run.

Writes DIR/programs_per_sm.csv (case, round, variant, ms), DIR/programs_per_sm_kernels.json and
DIR/programs_per_sm.log.
"""

import argparse
import csv
import dataclasses
import json
import statistics
import time
from pathlib import Path

from benchmarks import bench
from benchmarks.kimi_call import CASES, D, kimi_form, make_inputs

STUDY_CASES = ("T8192_H64", "T8192_H96", "packed6_H96", "8x1024_H96", "8x4096_H16")
VARIANTS = {  # name: (block_dv, programs_per_sm); the first is the committed default at these shapes
    "dv64": (64, 1),
    "dv64_pp2": (64, 2),
    "dv32": (32, 1),
    "dv32_pp2": (32, 2),
    "dv32_pp3": (32, 3),
}


def variant_config(sequences, H, num_sms, block_dv, programs_per_sm):
    """The default configuration of the shape with the recurrence's columns and launch bound replaced."""
    from stages.kda.config import resolve

    return dataclasses.replace(resolve(sequences, H, D, D, num_sms, block_dv=block_dv),
                               programs_per_sm=programs_per_sm)


def course_call(inputs, config):
    """The fused call as benchmarks.kimi_call's course_unchecked makes it, at `config`."""
    import torch

    from stages.kda.calls import prefill

    t = inputs
    cu_seqlens = None if t["cu_seqlens"] is None else t["cu_seqlens"].to(torch.int32)
    return lambda: prefill(t["q"], t["k"], t["v"], t["x"], t["beta"], cu_seqlens, t["initial_state"], True, "off",
                           config, kimi_form(D ** -0.5), t["A_log"], t["dt_bias"])


def precompile(cases):
    import torch

    from stages.kda.on_cpu import calls_on_cpu, compiled_only

    with calls_on_cpu(compiled_only):
        for name in cases:
            lengths, H = CASES[name]
            T, N = sum(lengths), len(lengths)
            zeros = {n: torch.zeros(1, T, H, D, dtype=torch.bfloat16) for n in "qkvx"}
            inputs = dict(zeros, beta=torch.zeros(1, T, H, dtype=torch.bfloat16), A_log=torch.zeros(H),
                          dt_bias=torch.zeros(H, D), initial_state=torch.zeros(N, H, D, D),
                          cu_seqlens=None if N == 1 else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()]))
            for variant, sizes in VARIANTS.items():
                course_call(inputs, variant_config(N, H, 132, *sizes))()
                print(f"{name} {variant}: compiled", flush=True)


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


def run(args):
    import torch
    from triton.testing import do_bench

    from benchmarks.fair import capture
    from stages.kda.config import streaming_multiprocessors

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
        writer = csv.DictWriter(f, ["case", "round", "variant", "block_dv", "programs_per_sm", "time_ms"])
        writer.writeheader()
        for name in args.cases:
            lengths, H = CASES[name]
            inputs = make_inputs(lengths, H)
            graphs, first = {}, None
            for variant, sizes in VARIANTS.items():
                call = course_call(inputs, variant_config(len(lengths), H, num_sms, *sizes))
                o, state = call()
                if first is None:
                    first = (o.clone(), state.clone())
                difference = max((o.float() - first[0].float()).abs().max().item(),
                                 (state - first[1]).abs().max().item())
                log(f"{name} {variant}: largest difference from {next(iter(VARIANTS))}: {difference:.3e}")
                graphs[variant] = capture(call)
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
                    block_dv, programs = VARIANTS.get(variant, ("", ""))
                    writer.writerow(dict(case=name, round=round_number, variant=variant, block_dv=block_dv,
                                         programs_per_sm=programs, time_ms=f"{ms:.4f}"))
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
    parser.add_argument("--precompile", action="store_true", help="compile the programs on this CPU, run nothing")
    args = parser.parse_args(argv)
    if args.precompile:
        return precompile(args.cases)
    if args.out is None:
        parser.error("--out is required on the GPU")
    if bench.cuda_is_missing("archive.studies.kda_recurrence_programs_per_sm"):
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
