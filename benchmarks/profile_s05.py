"""Stage 5's prepare kernel at a benchmark shape, for a profiler to watch; the ncu outputs the page shows.

NCU_COMMAND runs this module under Nsight Compute (the GPU check's part `profiles` runs it:
benchmarks/gpu_check.py): three launches at B=1, N=16384, H=32, D=128, bf16; ncu skips two and
profiles the third. time_each_kernel times the prepare kernel, the recurrence kernel and the whole
forward at the same shape (the same part runs it).
benchmarks/results/s05_prepare_ncu.txt is its output on the H200 for the committed kernel; the
benchmarks page's profile table shows it beside the outputs for earlier versions (PROFILES in
kdacourse/pages/benchmarks.py).
"""

NCU_COMMAND = ("ncu --clock-control none -k regex:kda_prepare -s 2 -c 1 --section SpeedOfLight --section Occupancy "
               "--section WarpStateStats --section SchedulerStats --section LaunchStats --print-details all "
               "python -m benchmarks.profile_s05")


def _bf16_inputs_and_prepare(B, N, H, D):
    """The benchmark's bf16 inputs at one shape, and stage 5's compiled prepare kernel for them (checks
    off: no value flags), at the default sizes (KernelConfig())."""
    import torch

    from benchmarks.bench import STAGES, make_inputs
    from stages.kda.compiled import compiled_prepare
    from stages.kda.config import KernelConfig

    config = KernelConfig()
    inputs = make_inputs(STAGES["s05"], B, N, H, D, torch.bfloat16)
    return inputs, compiled_prepare(B, N, H, D, D, config.chunk_size, "bfloat16", config.prepare_threads)


def main(B=1, N=16384, H=32, D=128):
    import torch

    (q, k, v, g, beta), prepare = _bf16_inputs_and_prepare(B, N, H, D)
    for _ in range(3):
        prepare(q, k, v, g, beta)
    torch.cuda.synchronize()


def time_each_kernel(B=1, N=16384, H=32, D=128):
    """Milliseconds of the prepare and the recurrence kernel alone, bf16, at a benchmark shape."""
    import torch
    from triton.testing import do_bench

    from stages.kda.calls import forward
    from stages.kda.compiled import compiled_recurrence
    from stages.kda.config import KernelConfig

    (q, k, v, g, beta), prepare = _bf16_inputs_and_prepare(B, N, H, D)
    config = KernelConfig()  # the default sizes: DEFAULT_BLOCK_DV's 32 value columns at every shape
    recurrence = compiled_recurrence(B, N, H, D, D, config.chunk_size, config.block_dv, "bfloat16", config.num_stages,
                                     config.threads)
    prepared = prepare(q, k, v, g, beta)
    initial_state = q.new_zeros((B, H, D, D), dtype=torch.float32)
    for name, run in (("prepare", lambda: prepare(q, k, v, g, beta)),
                      ("recurrence", lambda: recurrence(*prepared, initial_state)),
                      ("forward", lambda: forward(q, k, v, g, beta))):
        print(f"B={B} N={N} H={H} D={D} bf16 {name}: {do_bench(run, warmup=25, rep=100, return_mode='median'):.4f} ms")


if __name__ == "__main__":
    main()
