"""Run stage 5's prepare kernel at a benchmark shape, for a profiler to watch; and read what ncu said.

NCU_COMMAND runs this module under Nsight Compute (benchmarks/gpu_session.sh runs it, or print it with
`python -c "from benchmarks.profile_s05 import NCU_COMMAND; print(NCU_COMMAND)"`): three launches at
B=1, N=16384, H=32, D=128, bf16; ncu skips two and profiles the third.
benchmarks/results/s05_prepare_ncu.txt is its output on the H200 for the committed kernel; PROFILES
lists it with the outputs for the earlier versions, which `course regenerate` turns into the stage 5
page's profile table.
"""

import re

from kdacourse import REPO_ROOT
from kdacourse.generated import markdown_table

RESULTS = REPO_ROOT / "benchmarks" / "results"
NCU_COMMAND = ("ncu --clock-control none -k regex:kda_prepare -s 2 -c 1 --section SpeedOfLight --section Occupancy "
               "--section WarpStateStats --section SchedulerStats --section LaunchStats --print-details all "
               "python -m benchmarks.profile_s05")
PROFILES = [  # (version, ncu output), oldest first
    ("first version", "s05_prepare_ncu_before.txt"),
    ("scalar merges", "s05_prepare_ncu_scalar_merges.txt"),
    ("merges as TF32 GEMMs (this version)", "s05_prepare_ncu.txt"),
]


def main(B=1, N=16384, H=32, D=128):
    import torch

    from benchmarks.bench import STAGES, make_inputs
    from stages.s05_fast_kda import kernel

    q, k, v, g, beta = make_inputs(STAGES["s05"], B, N, H, D, torch.bfloat16)
    prepare = kernel._compiled_prepare(B, N, H, D, D, kernel.DEFAULT_CHUNK_SIZE, "bfloat16", None)
    for _ in range(3):
        prepare(q, k, v, g, beta)
    torch.cuda.synchronize()


def read_ncu(path):
    """{(metric name, unit): value} from `ncu --print-details all` text, the first value of each metric.

    A metric line is "name  unit  value" or "name  value" (no unit), columns two or more spaces apart.
    """
    metrics = {}
    for line in path.read_text().splitlines():
        columns = re.split(r"\s{2,}", line.strip())
        if len(columns) not in (2, 3) or not re.fullmatch(r"[\d,]+(\.\d+)?", columns[-1]):
            continue
        name, unit = columns[0], columns[1] if len(columns) == 3 else ""
        metrics.setdefault((name, unit), float(columns[-1].replace(",", "")))
    return metrics


def profile_rows(profiles):
    """The table's rows: one per quantity, one column per profile ({(name, unit): value} each)."""
    def value(metrics, name, unit, form):
        return form(metrics[(name, unit)]) if (name, unit) in metrics else "–"

    def blocks_per_sm(metrics):
        return int(min(v for (name, _), v in metrics.items() if name.startswith("Block Limit ")))

    def lsu_busy_cycles(metrics):  # the shared-memory pipe's busy cycles: its share of the kernel's cycles
        share = metrics.get(("L1: Data Pipe Lsu Wavefronts", "%"))
        return "–" if share is None else f"{share / 100 * metrics[('Elapsed Cycles', 'cycle')] / 1e6:.2f} M"

    def cell(name, unit, form):
        return lambda metrics: value(metrics, name, unit, form)

    quantities = [
        ("threads per block", cell("Block Size", "", lambda v: f"{v:.0f}")),
        ("registers per thread", cell("Registers Per Thread", "register/thread", lambda v: f"{v:.0f}")),
        ("shared memory per block", cell("Dynamic Shared Memory Per Block", "Kbyte/block",
                                         lambda v: f"{v * 1000 / 1024:.0f} KiB")),
        ("blocks per SM", blocks_per_sm),
        ("active warps per scheduler", cell("Active Warps Per Scheduler", "warp", lambda v: f"{v:.2f}")),
        ("instructions issued per scheduler and cycle", cell("Issued Warp Per Scheduler", "", lambda v: f"{v:.2f}")),
        ("duration", cell("Duration", "ms", lambda v: f"{v:.2f} ms")),
        ("cycles", cell("Elapsed Cycles", "cycle", lambda v: f"{v / 1e6:.2f} M")),
        ("busiest memory unit (of its peak)", cell("Memory Throughput", "%", lambda v: f"{v:.1f} %")),
        ("shared-memory pipe (L1 LSU wavefronts)", cell("L1: Data Pipe Lsu Wavefronts", "%", lambda v: f"{v:.1f} %")),
        ("shared-memory pipe busy", lsu_busy_cycles),
        ("DRAM throughput", cell("DRAM Throughput", "%", lambda v: f"{v:.1f} %")),
    ]
    return [(label, *(quantity(metrics) for metrics in profiles)) for label, quantity in quantities]


def write_profile_table(path):
    profiles = [read_ncu(RESULTS / name) for _, name in PROFILES]
    path.write_text(markdown_table(["", *(version for version, _ in PROFILES)], profile_rows(profiles)))


if __name__ == "__main__":
    main()
