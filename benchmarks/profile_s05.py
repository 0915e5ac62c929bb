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
    """The benchmark's bf16 inputs at one shape, and stage 5's compiled prepare kernel for them."""
    import torch

    from benchmarks.bench import STAGES, make_inputs
    from stages.s05_fast_kda import kernel

    inputs = make_inputs(STAGES["s05"], B, N, H, D, torch.bfloat16)
    return inputs, kernel.compiled_prepare(B, N, H, D, D, kernel.DEFAULT_CHUNK_SIZE, "bfloat16", None)


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

    from stages.s05_fast_kda import kernel

    (q, k, v, g, beta), prepare = _bf16_inputs_and_prepare(B, N, H, D)
    recurrence = kernel.compiled_recurrence(B, N, H, D, D, kernel.DEFAULT_CHUNK_SIZE, kernel.DEFAULT_BLOCK_DV,
                                             "bfloat16", 2, 128)
    prepared = prepare(q, k, v, g, beta)
    initial_state = q.new_zeros((B, H, D, D), dtype=torch.float32)
    for name, run in (("prepare", lambda: prepare(q, k, v, g, beta)),
                      ("recurrence", lambda: recurrence(*prepared, initial_state)),
                      ("forward", lambda: kernel.forward(q, k, v, g, beta))):
        print(f"B={B} N={N} H={H} D={D} bf16 {name}: {do_bench(run, warmup=25, rep=100, return_mode='median'):.4f} ms")


if __name__ == "__main__":
    main()
