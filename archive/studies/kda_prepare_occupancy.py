"""How many prepare programs an SM holds at once (issue 40: the prepare is most of the forward's time
and latency-bound), from the compiled program alone: registers and shared memory of the prepare as
Kimi Linear calls it (bf16, d = 128, the bounded gate, the norms and beta's sigmoid in the kernel), by
chunk size and channel passes, lowered and compiled for sm_90a without a GPU, and the blocks an SM can
hold by each limit of an H100 / H200 (SM 9.0: 228 KiB of shared memory an SM with 1 KiB reserved per
block, 64 K registers allocated per warp in units of 256, 64 warps, 32 blocks).

    python archive/studies/kda_prepare_occupancy.py > benchmarks/results/kda_prepare_occupancy.txt

and the same for the recurrence, by chunk, value block and pipeline stages.

The blocks are counted at the threads the lowered kernel launches (CompileReport.threads): where
TileLang pipelines a kernel's loads with a producer warp group of its own (the recurrence), that is more
than the program asked for (256 for 128). FlashKDA's first kernel, for comparison, is built for 8 blocks
of 256 threads an SM (its deep dive: `__launch_bounds__(256, 8)`), 64 warps. Ran on the course machine
(no GPU): first at 2026-12-06's main counting the threads asked for, again at 2026-12-07's counting
those launched.
"""

from stages.common.tilelang_tools import compile_report
from stages.kda.inputs import InputForm
from stages.kda.prepare import build_prepare_program
from stages.kda.recurrence import build_recurrence_program

SHARED_PER_SM, RESERVED_PER_BLOCK = 228 * 1024, 1024
REGISTERS_PER_SM, WARPS_PER_SM, BLOCKS_PER_SM = 65536, 64, 32
KIMI = InputForm(gate="sigmoid", lower_bound=-5.0, l2_normalize=True, beta="sigmoid", scale=128 ** -0.5)


def blocks_per_sm(threads, registers, shared):
    """(by shared memory, by registers, by warps): blocks of `threads` an SM can hold."""
    warps = threads // 32
    registers_per_warp = -(-registers * 32 // 256) * 256
    return (SHARED_PER_SM // (shared + RESERVED_PER_BLOCK), REGISTERS_PER_SM // (registers_per_warp * warps),
            min(WARPS_PER_SM // warps, BLOCKS_PER_SM))


def main():
    print("| chunk | threads asked, launched | channel passes | registers | shared bytes | blocks an SM by shared, "
          "registers, warps | blocks | warps an SM |")
    print("|---|---|---|---|---|---|---|---|")
    for chunk, threads in ((64, 256), (32, 128)):
        for passes in (2, 4):
            report = compile_report(build_prepare_program(1, 8192, 96, 128, 128, chunk, "bfloat16", threads,
                                                          channel_passes=passes, form=KIMI, gate_dtype="bfloat16",
                                                          beta_dtype="bfloat16", tokens=8192))
            limits = blocks_per_sm(report.threads, report.registers, report.dynamic_shared)
            print(f"| {chunk} | {threads}, {report.threads} | {passes} | {report.registers} | {report.dynamic_shared} | "
                  f"{', '.join(map(str, limits))} | {min(limits)} | {min(limits) * report.threads // 32} |", flush=True)
    # the recurrence beside it: one program per (sequence-head, value block), 128 threads asked, N / C
    # chunks in a row; at H = 96 and block_dv 64, 192 programs for 132 SMs
    print("\n| recurrence: chunk | block_dv | pipeline stages | threads launched | registers | shared bytes | "
          "blocks an SM by shared, registers, warps | blocks | programs at H = 96 in one wave |")
    print("|---|---|---|---|---|---|---|---|---|")
    for chunk in (64, 32):
        for block_dv in (64, 32):
            for stages in (2, 1):
                report = compile_report(build_recurrence_program(1, 8192, 96, 128, 128, chunk, block_dv, "bfloat16",
                                                                 stages, 128))
                limits = blocks_per_sm(report.threads, report.registers, report.dynamic_shared)
                programs = 96 * 128 // block_dv
                print(f"| {chunk} | {block_dv} | {stages} | {report.threads} | {report.registers} | {report.dynamic_shared} | "
                      f"{', '.join(map(str, limits))} | {min(limits)} | "
                      f"{'yes' if programs <= 132 * min(limits) else 'no'} ({programs}) |", flush=True)


if __name__ == "__main__":
    main()
