"""Stage 7's decode step with several states a program: does it move the states closer to the copy
bandwidth at B = 64, where one state a program reaches 88% (benchmarks/results/decode_b64_threads.csv)?

    python -m benchmarks.studies.s07_decode_variants [--B 64] [--rounds 3]

A program of the library's kernel reads its slice of one state, reduces over d_k twice (barriers
between), and writes it back: between its loads and its stores the memory system waits on other
programs. The variants walk `heads` states in turn, one after another (`T.serial`) or with the next
state's slice copied into shared memory while this one is updated (`T.Pipelined`, num_stages = 2),
built from the kernel's own source (variant_source), every line of its step the kernel's.
Each variant's outputs (o and the states) are checked against the library kernel's on the same
inputs, then every kernel is timed as a CUDA graph replayed, in interleaved rounds, against the
copy bandwidth measured in the same run. Prints one line per kernel and round, then the medians.
"""

import argparse
import statistics
import sys

from benchmarks.studies import function_source, load_edited
from stages.s07_serving import kernel as serving_kernel

VARIANTS = [(1, None), (2, None), (4, None), (2, 2), (4, 2)]  # (states a program, num_stages or None: serial)
KERNEL_LINE = "with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):"
PER_STATE_LINES = ("b, h = i_bh // H, i_bh % H", "slot_in_pool = ", "slot = ")  # what a state of the walk sets
STATE_LOAD = "T.copy(State_pool[slot, h, :, v0:v0 + block_dv], S_f)"


def _index(lines, text, start=0):
    for index in range(start, len(lines)):
        if lines[index].strip().startswith(text):
            return index
    raise RuntimeError(f"stage 7's decode kernel has no line starting {text!r} any more: update this study")


def variant_source(heads, num_stages):
    """The source of stage 7's build_decode_program with `heads` states a program, every other line the
    kernel's own: the grid takes B * H / heads programs; what the kernel does for its one state (from
    b, h and the slot to the state written back) runs in a loop over the program's states, one after
    another (num_stages None, T.serial) or with the next state's slice copied into shared memory ahead
    (T.Pipelined, its copies cp.async), the buffers allocated once before the loop."""
    lines = function_source(serving_kernel.build_decode_program).splitlines()
    kernel_index = _index(lines, KERNEL_LINE)
    indent = lines[kernel_index + 1][:len(lines[kernel_index + 1]) - len(lines[kernel_index + 1].lstrip())]
    per_state = [lines[_index(lines, text, kernel_index)] for text in PER_STATE_LINES]
    load = _index(lines, STATE_LOAD, kernel_index)
    body_end = next(index for index in range(load, len(lines))  # the macro's end: back to its own indentation
                    if lines[index].strip() and not lines[index].startswith(indent))
    head = [line for line in lines[kernel_index + 1:load] if line not in per_state]
    loop = "T.serial(heads)" if num_stages is None else f"T.Pipelined(heads, num_stages={num_stages})"
    state_load = [STATE_LOAD] if num_stages is None else [
        "T.copy(State_pool[slot, h, :, v0:v0 + block_dv], S_s)", "T.copy(S_s, S_f)"]
    walk = (["i_bh = i_group * heads + i", *(line.strip() for line in per_state), *state_load]
            + [line[len(indent):] for line in lines[load + 1:body_end]])
    edited = (lines[:kernel_index]
              + [lines[kernel_index].replace("B * H, threads", "B * H // heads, threads").replace("i_bh)", "i_group)")]
              + head
              + ([indent + "S_s = T.alloc_shared((d_k, block_dv), accum_dtype)"] if num_stages is not None else [])
              + [indent + f"for i in {loop}:"]
              + [(indent + "    " + line) if line.strip() else "" for line in walk]
              + lines[body_end:])
    return "\n".join(edited).replace("def build_decode_program(", "def build_decode_program(heads, ", 1) + "\n"


def build_variant(B, P, H, d_k, d_v, block_dv, dtype, heads, num_stages, threads=serving_kernel.DEFAULT_THREADS,
                  state_dtype="float32"):
    """Stage 7's decode program (value_flags=True: the same parameters and flags) with `heads` states a
    program (variant_source), heads dividing B * H."""
    if (B * H) % heads:
        raise ValueError(f"heads = {heads} must divide B * H = {B * H}")
    name = f"decode_{heads}_states_" + ("serial" if num_stages is None else f"{num_stages}_stages")
    build = load_edited(variant_source(heads, num_stages), serving_kernel, name).build_decode_program
    return build(heads, B, P, H, d_k, d_v, block_dv, dtype, state_dtype, threads, True)


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
