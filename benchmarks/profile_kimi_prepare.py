"""The fused prepare as Kimi Linear calls it, for Nsight Compute: one sequence or a packed batch.

    python -m benchmarks.profile_kimi_prepare CASE        CASE: one of benchmarks.kimi_call's CASES

Three of the course's calls of the case as benchmarks.kimi_call makes them (raw q and k, the raw gate
with A_log and dt_bias, beta's logits, the bounded gate, an fp32 state), checks off; NCU_COMMAND (with
the case after it) has Nsight Compute skip two prepare launches and profile the third. Why: at 8 x 1024
tokens and 96 heads the packed prepare took 0.95 ms where the dense one took 0.83 at the same tokens and
heads (on an H100: benchmarks/results/kda_recurrence_programs_per_sm_h100_registers/), and the lowered
CUDA of the two differs by too little to say why (the row predicate, 64-bit addresses, two dependent
index reads). Beside stage 5's profile's sections (benchmarks/profile_s05.py), the memory workload's
tables: the loads' sectors per request and shared memory's bank conflicts. The GPU check's part
`profiles-kimi` runs T8192_H96 and 8x1024_H96, into benchmarks/results/kimi_prepare_ncu/.
"""

import sys

NCU_COMMAND = ("ncu --clock-control none -k regex:kda_prepare -s 2 -c 1 --section SpeedOfLight --section Occupancy "
               "--section WarpStateStats --section SchedulerStats --section LaunchStats "
               "--section MemoryWorkloadAnalysis_Tables --print-details all python -m benchmarks.profile_kimi_prepare")


def main(argv=None):
    import torch

    from benchmarks.bench import cuda_is_missing
    from benchmarks.kimi_call import CASES, make_inputs, peer_calls

    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0] not in CASES:
        print(f"usage: python -m benchmarks.profile_kimi_prepare CASE, CASE one of {', '.join(CASES)}",
              file=sys.stderr)
        return 2
    if cuda_is_missing("benchmarks.profile_kimi_prepare"):
        return 2
    lengths, H = CASES[argv[0]]
    call = peer_calls(make_inputs(lengths, H))[0]["course_unchecked"]
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
