"""Stage 6's intra kernel at a benchmark shape, for a profiler to watch.

NCU_COMMAND runs this module under Nsight Compute (the GPU check's part `profiles` runs it):
the backward's kernels once at B=1, N=16384, H=32, D=128, bf16, to give the intra kernel the inputs a
backward gives it, then the intra kernel three times; ncu skips two and profiles the third.
benchmarks/results/s06_intra_ncu.txt is its output on the H200 before the padded rows,
s06_intra_ncu_registers.txt after them and the decays kept in registers (the kernel now).
"""

NCU_COMMAND = ("ncu --clock-control none -k regex:kda_intra -s 2 -c 1 --section SpeedOfLight --section Occupancy "
               "--section WarpStateStats --section SchedulerStats --section LaunchStats "
               "--section MemoryWorkloadAnalysis_Tables --section ComputeWorkloadAnalysis --section InstructionStats "
               "--print-details all python -m benchmarks.profile_s06_intra")


def main(B=1, N=16384, H=32, D=128):
    import torch

    from benchmarks.bench import STAGES, make_inputs
    from stages.kda.compiled import compiled_backward_kernels
    from stages.kda.config import DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE

    q, k, v, g, beta = make_inputs(STAGES["s05"], B, N, H, D, torch.bfloat16)
    do = torch.randn(q.shape, device=q.device, generator=torch.Generator(q.device).manual_seed(1)).to(q.dtype)
    state = torch.zeros(B, H, D, D, dtype=torch.float32, device=q.device)
    kernels = compiled_backward_kernels(B, N, H, D, D, DEFAULT_CHUNK_SIZE, DEFAULT_BLOCK_DV, "bfloat16")
    w, u, q_decayed, k_to_chunk_end, a_qk, chunk_decay, a_kk, inverse = kernels["prepare"](q, k, v, g, beta)
    states, v_new = kernels["states"](w, u, k_to_chunk_end, chunk_decay, state)
    d_states, dv_new, _ = kernels["state_gradient"](q_decayed, k_to_chunk_end, w, a_qk, chunk_decay, do, state)
    products = kernels["state_products"](states, d_states, v_new, dv_new, do, chunk_decay)
    for _ in range(3):
        kernels["intra"](q, k, v, g, beta, a_kk, inverse, do, v_new, dv_new, *products)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
