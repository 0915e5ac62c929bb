"""Compile on this machine, for the GPU, every program `python -m benchmarks.kimi_train` builds for the
course's training step (forward and backward through stages.kda.autograd.chunk_kda, as Kimi Linear's
layer calls it) at every case and the accuracy case, for the gates asked for, into TileLang's cache,
so that the GPU check's kimi-train parts find them compiled (CONTRIBUTING.md, "Sparing the GPU's time"):

    TILELANG_CACHE_DIR=.tlcache python scripts/precompile_kimi_train.py [--gates bounded,softplus]
        [--cases T4096_H32,...]

The benchmark's own step (benchmarks.kimi_train.peer_steps) runs on CPU zeros of the case's shapes with
CUDA faked, each program compiled and not run (stages.kda.on_cpu.compiled_only), so it builds exactly
what the GPU run builds. T 65536 holds about 6 GB of zeros on the CPU.
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kimi_train import ACCURACY_CASE, CASES, GATES, make_inputs, peer_steps  # noqa: E402
from stages.kda.on_cpu import calls_on_cpu, compiled_only  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gates", default=",".join(GATES), help=f"comma-separated, of {', '.join(GATES)}")
    parser.add_argument("--cases", default=",".join([*CASES, "accuracy"]),
                        help=f"comma-separated, of {', '.join(CASES)} and accuracy")
    args = parser.parse_args(argv)
    shapes = {**CASES, "accuracy": ACCURACY_CASE}
    gates, cases = args.gates.split(","), args.cases.split(",")
    unknown = [name for name in gates if name not in GATES] + [name for name in cases if name not in shapes]
    if unknown:
        parser.error(f"unknown {unknown}: gates are {', '.join(GATES)}, cases {', '.join(shapes)}")
    with calls_on_cpu(compiled_only):
        for name in cases:
            inputs = make_inputs(*shapes[name], device="cpu")
            for gate in gates:
                peer_steps(inputs, gate)[0]["course"]()
                print(f"{name} {gate}: done", flush=True)


if __name__ == "__main__":
    main()
