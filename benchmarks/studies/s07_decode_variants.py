"""Stage 7's decode step with several states a program: does it move the states closer to the copy
bandwidth at B = 64, where one state a program reaches 88% (benchmarks/results/decode_b64_threads.csv)?

    python -m benchmarks.studies.s07_decode_variants [--B 64] [--rounds 3]

A program of the library's kernel reads its slice of one state, reduces over d_k twice (barriers
between), and writes it back: between its loads and its stores the memory system waits on other
programs. The variants walk `heads` states in turn, one after another (`T.serial`) or with the next
state's slice copied into shared memory while this one is updated (`T.Pipelined`, num_stages = 2).
Each variant's outputs (o and the states) are checked against the library kernel's on the same
inputs, then every kernel is timed as a CUDA graph replayed, in interleaved rounds, against the
copy bandwidth measured in the same run. Prints one line per kernel and round, then the medians.
"""

import argparse
import statistics
import sys

from stages.common.device_checks import BAD_BETA, BAD_GATE, BAD_SLOT, FLAG_COUNT, bad_beta, bad_gate
from stages.common.tilelang_tools import LOG2_E

VARIANTS = [(1, None), (2, None), (4, None), (2, 2), (4, 2)]  # (states a program, num_stages or None: serial)


def build_variant(B, P, H, d_k, d_v, block_dv, dtype, heads, num_stages, threads=128, state_dtype="float32"):
    """The library's decode program (stages.s07_serving.kernel.build_decode_program, value_flags=True: the
    same parameters, the same flags) with `heads` states a program, B * H divisible by heads: one after
    another (num_stages=None) or pipelined (num_stages: the slices' copies into shared memory ahead)."""
    import tilelang.language as T

    if (B * H) % heads:
        raise ValueError(f"heads = {heads} must divide B * H = {B * H}")
    accum_dtype = state_dtype

    @T.prim_func
    def kda_decode_variant(
        Q: T.Tensor((B, H, d_k), dtype),
        K: T.Tensor((B, H, d_k), dtype),
        V: T.Tensor((B, H, d_v), dtype),
        G: T.Tensor((B, H, d_k), accum_dtype),
        Beta: T.Tensor((B, H), accum_dtype),
        Slots: T.Tensor((B,), "int32"),
        State_pool: T.Tensor((P, H, d_k, d_v), accum_dtype),
        Flags: T.Tensor((FLAG_COUNT,), "int32"),
        O: T.Tensor((B, H, d_v), dtype),
    ):
        with T.Kernel(d_v // block_dv, B * H // heads, threads=threads) as (i_v, i_group):
            v0 = i_v * block_dv
            q_s = T.alloc_shared((d_k,), accum_dtype)
            k_s = T.alloc_shared((d_k,), accum_dtype)
            decay_s = T.alloc_shared((d_k,), accum_dtype)
            v_s = T.alloc_shared((block_dv,), accum_dtype)
            S_s = T.alloc_shared((d_k, block_dv), accum_dtype)  # the pipelined variants' landing place
            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)
            product_f = T.alloc_fragment((d_k, block_dv), accum_dtype)
            recalled_f = T.alloc_fragment((block_dv,), accum_dtype)
            u_f = T.alloc_fragment((block_dv,), accum_dtype)
            o_f = T.alloc_fragment((block_dv,), accum_dtype)

            for i in T.serial(heads) if num_stages is None else T.Pipelined(heads, num_stages=num_stages):
                i_bh = i_group * heads + i
                b, h = i_bh // H, i_bh % H
                slot_in_pool = T.And(Slots[b] >= 0, Slots[b] < P)
                slot = T.if_then_else(slot_in_pool, Slots[b], 0)
                if num_stages is None:
                    T.copy(State_pool[slot, h, :, v0:v0 + block_dv], S_f)
                else:
                    T.copy(State_pool[slot, h, :, v0:v0 + block_dv], S_s)
                    T.copy(S_s, S_f)
                T.copy(Q[b, h, :], q_s)
                T.copy(K[b, h, :], k_s)
                T.copy(V[b, h, v0:v0 + block_dv], v_s)
                for d in T.Parallel(d_k):
                    decay_s[d] = T.exp2(G[b, h, d] * LOG2_E)
                    if bad_gate(G[b, h, d], accum_dtype):
                        Flags[BAD_GATE] = 1
                if bad_beta(Beta[b, h]):
                    Flags[BAD_BETA] = 1
                if T.Not(slot_in_pool):
                    Flags[BAD_SLOT] = 1
                for d, j in T.Parallel(d_k, block_dv):
                    S_f[d, j] *= decay_s[d]
                    product_f[d, j] = k_s[d] * S_f[d, j]
                T.reduce_sum(product_f, recalled_f, dim=0)
                for j in T.Parallel(block_dv):
                    u_f[j] = Beta[b, h] * (v_s[j] - recalled_f[j])
                for d, j in T.Parallel(d_k, block_dv):
                    S_f[d, j] += k_s[d] * u_f[j]
                    product_f[d, j] = q_s[d] * S_f[d, j]
                T.reduce_sum(product_f, o_f, dim=0)
                T.copy(o_f, O[b, h, v0:v0 + block_dv])
                for d, j in T.Parallel(d_k, block_dv):
                    if slot_in_pool:
                        State_pool[slot, h, d, v0 + j] = S_f[d, j]

    return kda_decode_variant


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--B", type=int, default=64)
    parser.add_argument("--H", type=int, default=32)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--pool", type=int, default=256)
    parser.add_argument("--block-dv", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    return parser.parse_args(argv)


def main(argv=None):
    import tilelang
    import torch

    from benchmarks import roofs
    from benchmarks.decode import bytes_moved, graph_or_events, make_inputs, spread
    from stages.common.device_checks import flags_for
    from stages.s07_serving import kernel as decode_kernel

    args = parse_args(argv)
    B, H, d, P, block_dv = args.B, args.H, args.d, args.pool, args.block_dv
    q, k, v, g, beta, pool, slots = make_inputs(B, H, d, P, torch.bfloat16, seed=0)
    flags = flags_for(q.device)
    total_bytes, _ = bytes_moved(B, H, d, d, 2)
    copy_bandwidth = roofs.measure_or_error().get("bandwidth_bytes_per_s", roofs.DESIGN_COPY_BANDWIDTH)
    print(f"B={B} H={H} d={d} block_dv={block_dv}: {total_bytes / 2**20:.1f} MiB a step, copy bandwidth "
          f"{copy_bandwidth / 1e12:.2f} TB/s", flush=True)

    library = decode_kernel.compiled_decode(B, P, H, d, d, block_dv, "bfloat16", decode_kernel.DEFAULT_THREADS, True)
    expected_pool = pool.clone()
    expected_o = library(q, k, v, g, beta, slots, expected_pool, flags)
    kernels = {"library (one state a program)": library}
    for heads, num_stages in VARIANTS:
        name = f"{heads} states a program, " + ("serial" if num_stages is None else f"pipelined ({num_stages} stages)")
        try:
            # TileLang 0.1.15 warp-specializes a pipelined loop on Hopper (producer warps added, 256 threads,
            # 255 registers and spills): off, the copies are cp.async issued by the same 128 threads
            compiled = tilelang.compile(build_variant(B, P, H, d, d, block_dv, "bfloat16", heads, num_stages),
                                        out_idx=[8], target="cuda",
                                        pass_configs={"tl.disable_warp_specialized": True})
            work = pool.clone()
            o = compiled(q, k, v, g, beta, slots, work, flags)
            print(f"{name}: o equal to the library's: {torch.equal(o, expected_o)}, states equal: "
                  f"{torch.equal(work, expected_pool)}", flush=True)
            kernels[name] = compiled
        except Exception as failure:  # noqa: BLE001 - a variant that fails leaves the others measured
            print(f"{name}: failed: {type(failure).__name__}: {str(failure)[:300]}", flush=True)

    work = pool.clone()
    graphs = {}
    for name, compiled in kernels.items():
        graphs[name] = graph_or_events(lambda compiled=compiled: compiled(q, k, v, g, beta, slots, work, flags))[0]
    times = {name: [] for name in graphs}
    for round_number in range(1, args.rounds + 1):
        order = list(graphs) if round_number % 2 else list(reversed(graphs))
        for name in order:
            median, _, _ = spread(graphs[name])
            times[name].append(median)
            print(f"round {round_number}: {name}: {median * 1e3:.1f} us, "
                  f"{total_bytes / (median * 1e-3) / copy_bandwidth:.1%} of the copy bandwidth", flush=True)
    print("\nmedians over rounds:")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median * 1e3:.1f} us | {total_bytes / (median * 1e-3) / copy_bandwidth:.1%} |")


if __name__ == "__main__":
    main(sys.argv[1:])
