"""Compile, for the GPU, every program `python -m benchmarks.kimi_call` will build for the course's calls
(every case and the accuracy case; checks "device" and "off"; the prepare in two and four channel
passes), into TileLang's cache, so that the benchmark finds them compiled (CONTRIBUTING.md, "Sparing the
GPU's time"):

    TILELANG_CACHE_DIR=.tlcache python scripts/precompile_kimi_call.py [--cases A,B] [--jobs N]

The calls are made on zeros with CUDA faked and each program compiled and not run
(stages.kda.on_cpu.compiled_only), so they build exactly what they build on the GPU: here ahead of a
device call, or on the GPU machine's own cores as the GPU check's kimi-call parts do before the
benchmark, which builds its programs one at a time. About 10 s a program not yet in the cache, on two
cores; --jobs N compiles N cases side by side, a process each.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kimi_call import ACCURACY_CASE, CASES, D, kimi_form  # noqa: E402
from stages.kda.calls import prefill  # noqa: E402
from stages.kda.config import resolve  # noqa: E402
from stages.kda.on_cpu import calls_on_cpu, compiled_only, each_in_a_process  # noqa: E402

SHAPES = {**CASES, "accuracy": ACCURACY_CASE}


def compile_case(name):
    """The course's calls of case `name` as the benchmark makes them, on zeros: q, k, v, x (1, T, H, D)
    and beta (1, T, H) in bf16, fp32 states (N, H, D, D), A_log (H,) and dt_bias (H * D,)."""
    import torch

    lengths, H = SHAPES[name]
    T, N = sum(lengths), len(lengths)
    q, k, v, x = (torch.zeros(1, T, H, D, dtype=torch.bfloat16) for _ in range(4))
    beta = torch.zeros(1, T, H, dtype=torch.bfloat16)
    cu_seqlens = None if N == 1 else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    for checks, config in (("device", None), ("off", None), ("device", resolve(N, H, D, D, 132, channel_passes=4))):
        prefill(q, k, v, x, beta, cu_seqlens, torch.zeros(N, H, D, D), True, checks, config, kimi_form(D ** -0.5),
                torch.zeros(H), torch.zeros(H * D))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=lambda text: text.split(","), default=list(SHAPES),
                        help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--jobs", type=int, default=1, help="cases compiled side by side, a process each")
    args = parser.parse_args(argv)
    unknown = [name for name in args.cases if name not in SHAPES]
    if unknown:
        parser.error(f"unknown cases {unknown}: choose from {', '.join(SHAPES)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.jobs > 1:
        failed = each_in_a_process(__file__, args.cases, args.jobs)
        sys.exit(f"failed: {', '.join(failed)}" if failed else 0)
    with calls_on_cpu(compiled_only):
        for name in args.cases:
            compile_case(name)
            print(f"{name}: done", flush=True)


if __name__ == "__main__":
    main()
