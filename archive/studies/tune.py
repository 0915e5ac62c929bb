"""Sweep a stage kernel's tile parameters at one shape and print the time of each, fastest first.

    python -m benchmarks.studies.tune s01 --shape 1,16384,32,128

Each configuration is checked against FLA's output before it is timed; one that fails to compile
or disagrees is reported and skipped.
"""

import argparse
import itertools
import sys

from benchmarks.bench import STAGES, fla, make_inputs, ours, relative_l2, time_ms

SPACE = {
    "chunk_size": [64, 128],
    "block_dv": [32, 64, 128],
    "num_stages": [1, 2, 3],
    "threads": [128, 256],
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stage", choices=sorted(STAGES))
    parser.add_argument("--shape", default="1,16384,32,128", help="B,N,H,D")
    parser.add_argument("--space", default=None, help="JSON overriding SPACE, e.g. '{\"chunk_size\": [64]}'")
    args = parser.parse_args(argv)
    import json

    import torch

    stage = STAGES[args.stage]
    space = dict(SPACE, **(json.loads(args.space) if args.space else {}))
    B, N, H, D = map(int, args.shape.split(","))
    inputs = make_inputs(stage, B, N, H, D, torch.bfloat16)
    expected = fla(stage)(*inputs)
    print(f"FLA {stage.fla_name}: {time_ms(fla(stage), inputs):.4f} ms", flush=True)
    forward = ours(stage)
    results = []
    for values in itertools.product(*space.values()):
        config = dict(zip(space, values))
        try:
            error = relative_l2(forward(*inputs, **config), expected)
            if not error < 1e-2:
                print(f"{config}: disagrees with FLA, rel L2 {error:.2e}", flush=True)
                continue
            elapsed = time_ms(lambda *a, config=config: forward(*a, **config), inputs)
        except Exception as failure:
            print(f"{config}: {type(failure).__name__}: {str(failure).splitlines()[0][:160]}", flush=True)
            continue
        results.append((elapsed, config))
        print(f"{config}: {elapsed:.4f} ms (rel L2 vs FLA {error:.1e})", flush=True)
    for elapsed, config in sorted(results, key=lambda item: item[0])[:5]:
        print(f"best: {elapsed:.4f} ms {config}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
