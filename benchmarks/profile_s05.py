"""Run stage 5's prepare kernel at a benchmark shape, for a profiler to watch.

    ncu --clock-control none -k regex:kda_prepare -s 2 -c 1 --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats --section SchedulerStats --section LaunchStats --print-details all \\
        python -m benchmarks.profile_s05

Three launches at B=1, N=16384, H=32, D=128, bf16; ncu skips two and profiles the third.
benchmarks/results/s05_prepare_ncu.txt is that command's output on the H200.
"""

import torch

from benchmarks.bench import STAGES, make_inputs
from stages.s05_fast_kda import kernel


def main(B=1, N=16384, H=32, D=128):
    q, k, v, g, beta = make_inputs(STAGES["s05"], B, N, H, D, torch.bfloat16)
    prepare = kernel._compiled_prepare(B, N, H, D, D, kernel.DEFAULT_CHUNK_SIZE, "bfloat16", None)
    for _ in range(3):
        prepare(q, k, v, g, beta)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
