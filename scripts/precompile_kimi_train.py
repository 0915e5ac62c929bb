"""Compile on this machine, for the GPU, every program `python -m benchmarks.kimi_train` builds for the
course's training step (forward and backward through stages.kda.autograd.chunk_kda, as Kimi Linear's
layer calls it) at every case and the accuracy case, for the gates asked for, into TileLang's cache,
so that the GPU check's kimi-train parts find them compiled (CONTRIBUTING.md, "Sparing the GPU's time"):

    TILELANG_CACHE_DIR=.tlcache python scripts/precompile_kimi_train.py [--gates bounded,softplus]
        [--cases T4096_H32,...] [--jobs N]

The benchmark's own step (benchmarks.kimi_train.peer_steps) runs on CPU zeros of the case's shapes with
CUDA faked, each program compiled and not run (stages.kda.on_cpu.compiled_only), so it builds exactly
what the GPU run builds: here ahead of a device call, or on the GPU machine's own cores as the GPU
check's kimi-train parts do before the benchmark, which builds its programs one at a time. About 90 s
a case and gate on one core with nothing in the cache; --jobs N compiles N cases side by side, a
process each. At T 65536 (H 32, d 128, bf16) the four inputs of (T, H, d) and their gradients alone
are 4.3 GB of the CPU's memory.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kimi_train import ACCURACY_CASE, CASES, GATES, make_inputs, peer_steps  # noqa: E402
from stages.kda.on_cpu import calls_on_cpu, compiled_only, each_in_a_process  # noqa: E402


SHAPES = {**CASES, "accuracy": ACCURACY_CASE}  # name: (T, H), B = 1


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gates", type=lambda text: text.split(","), default=list(GATES),
                        help=f"comma-separated, of {', '.join(GATES)}")
    parser.add_argument("--cases", type=lambda text: text.split(","), default=list(SHAPES),
                        help=f"comma-separated, of {', '.join(SHAPES)}")
    parser.add_argument("--jobs", type=int, default=1, help="cases compiled side by side, a process each")
    args = parser.parse_args(argv)
    unknown = [name for name in args.gates if name not in GATES] + [name for name in args.cases if name not in SHAPES]
    if unknown:
        parser.error(f"unknown {unknown}: gates are {', '.join(GATES)}, cases {', '.join(SHAPES)}")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.jobs > 1:
        failed = each_in_a_process(__file__, args.cases, args.jobs, ("--gates", ",".join(args.gates)))
        sys.exit(f"failed: {', '.join(failed)}" if failed else 0)
    with calls_on_cpu(compiled_only):
        for name in args.cases:
            inputs = make_inputs(*SHAPES[name], device="cpu")
            for gate in args.gates:
                peer_steps(inputs, gate)[0]["course"]()
                print(f"{name} {gate}: done", flush=True)


if __name__ == "__main__":
    main()
