"""Time stage 7's prefill of a packed variable-length batch beside FLA's chunk_kda with cu_seqlens.

    python -m benchmarks.varlen --out DIR [--mix prefill,chat] [--rounds 3] [--H 32] [--d 128]

Each mix is a server's batch of sequences of different lengths, packed without padding (FLA's
convention: q, k, v, g, beta of shape (1, T, H, ...), cu_seqlens the offsets), every sequence from
its own initial state, the final states returned:

- `prefill`: 16 prompts, lengths log-uniform in [256, 16384] (long prompts prefilled together);
- `chat`: 64 prompts, lengths log-uniform in [32, 2048] (many short turns).

Measured, each the median of CUDA-event timings after warm-up (triton's do_bench, which flushes the
L2 cache), in `--rounds` interleaved rounds (each round runs the measurements in the reverse order of
the one before):
- ours `call` and `call_unchecked`: stages.kda.calls.prefill with cu_seqlens, initial_state
  and output_final_state, with checks="device" (the default: the varlen prepare flags bad values,
  the index's ops bad offsets) and checks="off"; neither syncs with the host;
- ours `graph`: the default call replayed from a CUDA graph (it captures: nothing is read to the host);
- ours `kernels`: prefill's two kernels alone (the varlen prepare, the varlen recurrence, through
  varlen_forward) with the chunk table already on the device: `call_unchecked` less the host's
  checks and the device ops that build the index;
- ours `one_sequence`: stage 5's forward on the same T tokens as one sequence (no states, no
  sequence boundaries), for scale;
- FLA `call`: fla.ops.chunk_kda with the same arguments (scale=1.0, cu_seqlens as int64), the same
  cu_seqlens tensor every call, so that FLA's cache of its chunk indices (fla.utils.tensor_cache,
  keyed on the tensor) holds and FLA reads nothing to the host after the first call; FLA
  `call_new_cu_seqlens`: a copy of cu_seqlens each call, as a server's next batch is a new tensor (its
  chunk indices read to the host: a sync); FLA `graph`: `call` replayed from a CUDA graph, if it
  captures.
Before timing, ours is checked against FLA (rel L2 of o and of the final states).

Writes DIR/varlen.csv (one row per mix, round and measurement) and DIR/varlen_meta.json (the lengths,
the errors, the command). Needs a CUDA device and FLA.
"""

import argparse
import csv
import json
import statistics
import sys
import traceback
from pathlib import Path

from benchmarks.decode import graph_or_events, relative_l2, spread
from stages.kda.config import DEFAULT_CHUNK_SIZE  # prefill's chunks

MIXES = {  # name: (sequences, shortest, longest), lengths log-uniform between the two
    "prefill": (16, 256, 16384),
    "chat": (64, 32, 2048),
}
MEASUREMENTS = [("fla", "call"), ("ours", "call"), ("ours", "call_unchecked"), ("ours", "kernels"),
                ("ours", "one_sequence"), ("fla", "graph"), ("ours", "graph"), ("fla", "call_new_cu_seqlens")]
FIELDS = ["mix", "round", "impl", "what", "method", "sequences", "tokens", "padded_tokens", "H", "D", "dtype",
          "time_ms", "time_ms_p20", "time_ms_p80", "error"]
GATE_RANGE = (0.9, 0.999)
# ours against FLA, both in bf16 or fp16, agree to about 5e-3 (bf16's rounding); a race in the varlen
# prepare once gave 8e-2 on o while the GPU tests' small batches passed
MAX_REL_L2_VS_FLA = 2e-2
BETA_RANGE = (0.1, 0.9)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.varlen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for varlen.csv and varlen_meta.json")
    parser.add_argument("--mix", default=",".join(MIXES), help=f"comma-separated, of {', '.join(MIXES)}")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--H", type=int, default=32)
    parser.add_argument("--d", type=int, default=128, help="d_k = d_v")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.mix = args.mix.split(",")
    unknown = [name for name in args.mix if name not in MIXES]
    if unknown:
        parser.error(f"unknown mix {unknown}; choose from {list(MIXES)}")
    return args


def mix_lengths(name, seed):
    """The mix's sequence lengths: log-uniform between its bounds, from a seeded generator."""
    import numpy as np

    count, shortest, longest = MIXES[name]
    rng = np.random.default_rng(seed)
    return [int(n) for n in np.exp(rng.uniform(np.log(shortest), np.log(longest), count)).round()]


def make_inputs(lengths, H, d, dtype, seed):
    """The packed batch on the GPU: q, k (L2-normalized), v in dtype, g, beta fp32, cu_seqlens int64,
    initial states (N_seq, H, d, d) fp32."""
    import torch

    T = sum(lengths)
    generator = torch.Generator(device="cuda").manual_seed(seed)

    def uniform(shape, low, high):
        return low + (high - low) * torch.rand(shape, generator=generator, device="cuda")

    q, k = (torch.nn.functional.normalize(torch.randn(1, T, H, d, generator=generator, device="cuda"), dim=-1)
            for _ in range(2))
    v = torch.randn(1, T, H, d, generator=generator, device="cuda")
    g = uniform((1, T, H, d), *GATE_RANGE).log()
    beta = uniform((1, T, H), *BETA_RANGE)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device="cuda")
    initial_state = 0.1 * torch.randn(len(lengths), H, d, d, generator=generator, device="cuda")
    return (q.to(dtype), k.to(dtype), v.to(dtype), g, beta), cu_seqlens, initial_state


def prefill_kernels(inputs, cu_seqlens, initial_state):
    """A function that runs prefill's two kernels alone (stages.kda.calls.varlen_forward, with the
    KernelConfig prefill resolves for the batch's sequences) on the packed inputs, the index built on
    the device once here."""
    from stages.kda.calls import varlen_forward, varlen_index
    from stages.kda.compiled import compiled_prefill_kernels
    from stages.kda.config import resolve_for

    q, v = inputs[0], inputs[2]
    N_seq = len(cu_seqlens) - 1
    config = resolve_for(q.device, N_seq, q.shape[2], q.shape[3], v.shape[3])
    index = varlen_index(cu_seqlens, q.shape[1], config.chunk_size)
    kernels = compiled_prefill_kernels(q.shape[2], q.shape[3], v.shape[3], config.chunk_size, config.block_dv,
                                       str(q.dtype).split(".")[1], config.num_stages, False, config.programs_per_sm)
    return lambda: varlen_forward(*inputs, index, initial_state, config.chunk_size, kernels)


def measurements(inputs, cu_seqlens, initial_state):
    """{(impl, what): (callable, method)} for one mix; FLA's graph only if it captures."""
    from fla.ops import chunk_kda

    from stages.kda.calls import forward, prefill

    def ours(checks="device"):
        return prefill(*inputs, cu_seqlens=cu_seqlens, initial_state=initial_state, output_final_state=True,
                       checks=checks)

    def fla(offsets=cu_seqlens):
        return chunk_kda(*inputs, scale=1.0, initial_state=initial_state, output_final_state=True,
                         cu_seqlens=offsets)

    table = {("ours", "call"): (ours, "events"), ("ours", "call_unchecked"): (lambda: ours("off"), "events"),
             ("ours", "kernels"): (prefill_kernels(inputs, cu_seqlens, initial_state), "events"),
             ("ours", "one_sequence"): (lambda: forward(*inputs, checks="off"), "events"),
             ("fla", "call"): (fla, "events"),
             ("fla", "call_new_cu_seqlens"): (lambda: fla(cu_seqlens.clone()), "events")}
    for impl, function in (("fla", fla), ("ours", ours)):
        replay, method = graph_or_events(function)
        if method == "graph":
            table[(impl, "graph")] = (replay, method)
    return table


def run(args, log=print):
    import numpy as np
    import torch

    from stages.s07_serving.reference import chunk_aligned_rows

    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python -m benchmarks.varlen " + " ".join(sys.argv[1:]), "device": torch.cuda.get_device_name(),
            "mixes": {}}
    rows = []
    for mix_index, name in enumerate(args.mix):
        lengths = mix_lengths(name, args.seed + mix_index)
        chunks = int(chunk_aligned_rows(np.concatenate([[0], np.cumsum(lengths)]), DEFAULT_CHUNK_SIZE)[1][-1])
        padded = chunks * DEFAULT_CHUNK_SIZE
        base = dict(mix=name, sequences=len(lengths), tokens=sum(lengths), padded_tokens=padded, H=args.H, D=args.d,
                    dtype=args.dtype)
        inputs, cu_seqlens, initial_state = make_inputs(lengths, args.H, args.d, getattr(torch, args.dtype), args.seed)
        table = measurements(inputs, cu_seqlens, initial_state)
        ours_o, ours_state = table[("ours", "call")][0]()
        fla_o, fla_state = table[("fla", "call")][0]()
        meta["mixes"][name] = dict(lengths=lengths, tokens=sum(lengths), padded_tokens=padded,
                                   rel_l2_o_ours_vs_fla=relative_l2(ours_o, fla_o),
                                   rel_l2_state_ours_vs_fla=relative_l2(ours_state, fla_state))
        log(f"{name}: {len(lengths)} sequences, {sum(lengths)} tokens ({padded} rows chunk-aligned); ours vs FLA "
            f"rel L2 o {meta['mixes'][name]['rel_l2_o_ours_vs_fla']:.2e}, "
            f"states {meta['mixes'][name]['rel_l2_state_ours_vs_fla']:.2e}")
        disagreement = max(meta["mixes"][name]["rel_l2_o_ours_vs_fla"], meta["mixes"][name]["rel_l2_state_ours_vs_fla"])
        if disagreement > MAX_REL_L2_VS_FLA:
            raise SystemExit(f"{name}: ours and FLA disagree (rel L2 {disagreement:.2e} > {MAX_REL_L2_VS_FLA:.0e}): "
                             f"a wrong kernel is not timed")
        for round_number in range(1, args.rounds + 1):
            order = MEASUREMENTS if round_number % 2 else MEASUREMENTS[::-1]
            for key in order:
                if key not in table:
                    continue
                function, method = table[key]
                row = dict(base, round=round_number, impl=key[0], what=key[1], method=method)
                try:
                    median, p20, p80 = spread(function)
                    row.update(time_ms=f"{median:.5f}", time_ms_p20=f"{p20:.5f}", time_ms_p80=f"{p80:.5f}")
                except Exception as failure:  # noqa: BLE001 - recorded, the run goes on
                    traceback.print_exc()
                    row["error"] = f"{type(failure).__name__}: {str(failure)[:200]}"
                rows.append(row)
                log(f"  round {round_number} {key[0]:4} {key[1]:15} {row.get('time_ms', 'failed'):>10} ms ({method})")
        del inputs, table
        torch.cuda.empty_cache()
    with open(args.out / "varlen.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (args.out / "varlen_meta.json").write_text(json.dumps(meta, indent=1))
    for line in summary(rows):
        log(line)
    return rows


def summary(rows):
    """One line per mix: the median over rounds of each measurement, and FLA / ours for the calls."""
    lines = []
    for name in dict.fromkeys(row["mix"] for row in rows):
        medians = {}
        for row in rows:
            if row["mix"] == name and row.get("time_ms"):
                medians.setdefault((row["impl"], row["what"]), []).append(float(row["time_ms"]))
        medians = {key: statistics.median(times) for key, times in medians.items()}
        text = ", ".join(f"{impl} {what} {time:.3f} ms" for (impl, what), time in medians.items())
        if ("fla", "call") in medians and ("ours", "call") in medians:
            text += f"; FLA / ours (calls) {medians[('fla', 'call')] / medians[('ours', 'call')]:.2f}"
        lines.append(f"{name}: {text}")
    return lines


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.varlen times kernels on a GPU: torch sees no CUDA device here "
                         "(prefill's CPU checks are in tests/kernels/test_s07_prefill.py)")
    run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
