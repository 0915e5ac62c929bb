"""Time the stage 7 decode kernel beside FLA's fused_recurrent_kda on one CUDA machine.

    python -m benchmarks.decode --out DIR [--B 64] [--H 32] [--d 128] [--pool 256] [--block-dv 16,32,64]

One decode step (one token per sequence) at B=64, H=32, d_k=d_v=128 by default: bf16 q, k, v, fp32
g and beta, an fp32 pool of 256 states in the kernel layout S^T (P, H, d_k, d_v), `slots` a random
choice of B of them. The step reads and writes each sequence's state once, B * H * d_k * d_v * 4
bytes each way (128 MiB at the default shape), against a few hundred KiB of q, k, v, g, beta and o:
the kernel is bound by memory, so its measure is the bytes it moves per second as a fraction of what
a device-to-device copy reaches on the same machine (benchmarks/roofs.py, measured in this run).

Measured, each as the median of repeats with the 20th and 80th percentiles (triton's do_bench):
- ours `kernel`: the compiled kernel alone, replayed from a CUDA graph, one row per block_dv;
- ours `call`: the whole default `decode(...)` (values checked on the device, no sync), timed eagerly;
  `call_graph`: the same call captured in a CUDA graph (a server's decode loop); `call_host_checks`:
  with checks="host" (the values read to the host first, two syncs); `call_unchecked_graph`: the
  call with checks="off" (the kernel without the flags) captured as `call_graph` is, what the
  default's flags cost;
- FLA `call`: `fla.ops.kda.fused_recurrent_kda` with q, k, v of shape (B, 1, H, D), scale=1.0 and
  the B states gathered from the pool into initial_state (B, H, d_k, d_v) fp32, FLA's convention
  (the same S^T layout), output_final_state=True: the same bytes read and written; and FLA `kernel`,
  the same call replayed from a CUDA graph.
Before timing, both are checked against a float64 plain-torch step (rel L2 of o and of the states).

Writes DIR/decode.csv. Needs a CUDA device; FLA is optional (its rows then carry the import error).
"""

import argparse
import csv
import math
import sys
import traceback
from pathlib import Path

FIELDS = ("impl", "what", "block_dv", "threads", "method", "B", "H", "d_k", "d_v", "pool", "dtype", "time_ms", "time_ms_p20",
          "time_ms_p80", "bytes", "state_bytes", "bytes_per_s", "copy_bytes_per_s", "fraction_of_copy",
          "rel_l2_o", "rel_l2_state", "error")
GATE_RANGE = (0.9, 0.999)
BETA_RANGE = (0.1, 0.9)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for decode.csv")
    parser.add_argument("--B", type=_positive, default=64, help="sequences decoded at once (default 64)")
    parser.add_argument("--H", type=_positive, default=32, help="heads (default 32)")
    parser.add_argument("--d", type=_positive, default=128, help="d_k = d_v (default 128)")
    parser.add_argument("--pool", type=_positive, default=256, help="states in the pool, at least B (default 256)")
    parser.add_argument("--block-dv", type=_block_sizes, default=(16, 32, 64),
                        help="value columns per program, comma-separated, each dividing d (default 16,32,64)")
    parser.add_argument("--threads", type=_positive, default=None,
                        help="threads per program (default: decode's, KernelConfig().threads)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.threads is None:
        from stages.kda.config import KernelConfig

        args.threads = KernelConfig().threads
    if args.pool < args.B:
        parser.error(f"--pool must be at least --B = {args.B} (one state per sequence), got {args.pool}")
    for block_dv in args.block_dv:
        if args.d % block_dv:
            parser.error(f"--block-dv {block_dv} does not divide --d = {args.d}")
    return args


def _positive(text):
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _block_sizes(text):
    return tuple(_positive(part) for part in text.split(","))


def bytes_moved(B, H, d_k, d_v, dtype_bytes):
    """(all bytes, state bytes) one decode step must move: each state read and written once in fp32;
    q, k, v read and o written in the input dtype; g (fp32), beta (fp32) and the slots (int32) read."""
    state = 2 * B * H * d_k * d_v * 4
    vectors = B * H * (2 * d_k + 2 * d_v) * dtype_bytes + B * H * d_k * 4 + B * H * 4 + B * 4
    return state + vectors, state


def torch_decode_step(q, k, v, g, beta, states):
    """The decode step in plain torch on float64 copies: states (B, H, d_k, d_v), S^T per sequence.
    Returns (o (B, H, d_v), the new states)."""
    q, k, v, g, beta, S_T = (x.double() for x in (q, k, v, g, beta, states))
    S_T = S_T * g.exp()[..., None]
    u = beta[..., None] * (v - (S_T * k[..., None]).sum(dim=2))
    S_T = S_T + k[..., None] * u[..., None, :]
    return (S_T * q[..., None]).sum(dim=2), S_T


def relative_l2(actual, expected):
    difference = (actual.double() - expected.double()).norm().item()
    return difference / max(expected.double().norm().item(), 1e-300)


def make_inputs(B, H, d, P, dtype, seed):
    """q, k (L2-normalized), v, g, beta, the pool and the slots, on the GPU."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)

    def uniform(shape, low, high):
        return low + (high - low) * torch.rand(shape, generator=generator, device="cuda")

    q, k = (torch.nn.functional.normalize(torch.randn(B, H, d, generator=generator, device="cuda"), dim=-1)
            for _ in range(2))
    v = torch.randn(B, H, d, generator=generator, device="cuda")
    g = uniform((B, H, d), *GATE_RANGE).log()
    beta = uniform((B, H), *BETA_RANGE)
    pool = 0.1 * torch.randn(P, H, d, d, generator=generator, device="cuda")
    slots = torch.randperm(P, generator=generator, device="cuda")[:B].to(torch.int32)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta, pool, slots


def spread(function):
    """(median, 20th, 80th percentile) milliseconds of one call."""
    import torch
    from triton.testing import do_bench

    with torch.no_grad():
        p20, median, p80 = do_bench(function, warmup=25, rep=200, quantiles=[0.2, 0.5, 0.8])
    return median, p20, p80


def graph_or_events(launch):
    """(a callable to time, "graph") if one call captures into a CUDA graph, else (launch, "events")."""
    from benchmarks.fair import capture

    try:
        return capture(launch).replay, "graph"
    except Exception:  # noqa: BLE001 - timed with events instead, the method column says so
        traceback.print_exc()
        import torch

        torch.cuda.synchronize()
        return launch, "events"


def fla_decode():
    """FLA's fused_recurrent_kda as one decode step: (B, H, D) tensors in, o (B, H, d_v) and the new
    states (B, H, d_k, d_v) out; no scale, beta and g as given (the course's conventions)."""
    from fla.ops.kda import fused_recurrent_kda

    def step(q, k, v, g, beta, states):
        o, final_state = fused_recurrent_kda(q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1), g.unsqueeze(1),
                                             beta.unsqueeze(1), scale=1.0, initial_state=states,
                                             output_final_state=True)
        return o.squeeze(1), final_state

    return step


def run(args, log=print):
    import torch

    from benchmarks import roofs

    B, H, d, P = args.B, args.H, args.d, args.pool
    dtype = getattr(torch, args.dtype)
    q, k, v, g, beta, pool, slots = make_inputs(B, H, d, P, dtype, args.seed)
    expected_o, expected_states = torch_decode_step(q, k, v, g, beta, pool[slots.long()])
    total_bytes, state_bytes = bytes_moved(B, H, d, d, torch.finfo(dtype).bits // 8)
    copy = roofs.measure_or_error()
    copy_bandwidth = copy.get("bandwidth_bytes_per_s", roofs.DESIGN_COPY_BANDWIDTH)
    if "error" in copy:
        log(f"copy bandwidth not measured ({copy['error']}): using {copy_bandwidth / 1e12:.2f} TB/s")
    else:
        log(f"copy bandwidth measured here: {copy_bandwidth / 1e12:.2f} TB/s")
    base = dict(B=B, H=H, d_k=d, d_v=d, pool=P, dtype=args.dtype, threads=args.threads, bytes=total_bytes, state_bytes=state_bytes,
                copy_bytes_per_s=f"{copy_bandwidth:.4g}")
    rows = []

    def record(impl, what, function, method, block_dv="", errors=None):
        row = dict(base, impl=impl, what=what, method=method, block_dv=block_dv, **(errors or {}))
        try:
            median, p20, p80 = spread(function)
            row.update(time_ms=f"{median:.5f}", time_ms_p20=f"{p20:.5f}", time_ms_p80=f"{p80:.5f}",
                       bytes_per_s=f"{total_bytes / (median * 1e-3):.4g}",
                       fraction_of_copy=f"{total_bytes / (median * 1e-3) / copy_bandwidth:.3f}")
        except Exception as failure:  # noqa: BLE001 - recorded, the run goes on
            row["error"] = f"{type(failure).__name__}: {str(failure)[:200]}"
        rows.append(row)
        log(f"{impl:4} {what:15} block_dv={block_dv!s:3} {row.get('time_ms', 'failed'):>9} ms  "
            f"{row.get('fraction_of_copy', '-')} of the copy bandwidth  ({method}) {row.get('error', '')}")

    work = pool.clone()  # every timed call advances these states in place (they stay bounded: a <= 1, beta <= 1)
    for block_dv in args.block_dv:
        try:
            _measure_ours(block_dv, (q, k, v, g, beta, work, slots), pool, expected_o, expected_states, record, args)
        except Exception as failure:  # noqa: BLE001 - one block size failing leaves the others measured
            traceback.print_exc()
            rows.append(dict(base, impl="ours", what="kernel", block_dv=block_dv,
                             error=f"{type(failure).__name__}: {str(failure)[:200]}"))

    try:
        step = fla_decode()
        states = pool[slots.long()].contiguous()  # FLA's initial_state: (N, H, d_k, d_v) fp32, one per sequence
        o, final_state = step(q, k, v, g, beta, states)
        errors = dict(rel_l2_o=f"{relative_l2(o, expected_o):.3e}",
                      rel_l2_state=f"{relative_l2(final_state, expected_states):.3e}")
        record("fla", "call", lambda: step(q, k, v, g, beta, states), "events", errors=errors)
        function, method = graph_or_events(lambda: step(q, k, v, g, beta, states))
        record("fla", "kernel", function, method, errors=errors)
    except Exception as failure:  # noqa: BLE001 - FLA missing or failing: ours is still measured
        rows.append(dict(base, impl="fla", what="call", error=f"{type(failure).__name__}: {str(failure)[:200]}"))
        log(f"FLA not measured: {rows[-1]['error']}")

    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "decode.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    _summary(rows, log)
    return rows


def _measure_ours(block_dv, inputs, pool, expected_o, expected_states, record, args):
    """Check the kernel at block_dv against the float64 step (from the original pool), then time it."""
    from stages.common.device_checks import flags_for, raise_if_flagged
    from stages.kda.calls import decode
    from stages.kda.compiled import compiled_decode
    from stages.kda.config import KernelConfig, decode_block_dv

    q, k, v, g, beta, work, slots = inputs
    config = KernelConfig(block_dv=block_dv, threads=args.threads)
    work.copy_(pool)
    o, _ = decode(q, k, v, g, beta, work, slots, config=config)
    raise_if_flagged(q.device)  # the benchmark's inputs are good: a flag is a kernel bug
    errors = dict(rel_l2_o=f"{relative_l2(o, expected_o):.3e}",
                  rel_l2_state=f"{relative_l2(work[slots.long()], expected_states):.3e}")
    B, H, d = q.shape
    compiled = compiled_decode(B, pool.shape[0], H, d, d, block_dv, args.dtype, args.threads, True)
    flags = flags_for(q.device)
    function, method = graph_or_events(lambda: compiled(q, k, v, g, beta, slots, work, flags))
    record("ours", "kernel", function, method, block_dv, errors)
    if block_dv == decode_block_dv(d):  # the default call's block
        record("ours", "call", lambda: decode(q, k, v, g, beta, work, slots, config=config), "events", block_dv)
        record("ours", "call_host_checks", lambda: decode(q, k, v, g, beta, work, slots, checks="host", config=config),
               "events", block_dv)
        function, method = graph_or_events(lambda: decode(q, k, v, g, beta, work, slots, config=config))
        record("ours", "call_graph", function, method, block_dv)
        function, method = graph_or_events(lambda: decode(q, k, v, g, beta, work, slots, checks="off", config=config))
        record("ours", "call_unchecked_graph", function, method, block_dv)


def _summary(rows, log):
    kernels = [row for row in rows if row.get("what") == "kernel" and row.get("time_ms")]
    ours = [row for row in kernels if row["impl"] == "ours"]
    fla = [row for row in kernels if row["impl"] == "fla"]
    if ours:
        best = min(ours, key=lambda row: float(row["time_ms"]))
        log(f"best ours: block_dv={best['block_dv']} {float(best['time_ms']) * 1e3:.1f} us, "
            f"{best['fraction_of_copy']} of the copy bandwidth; o rel L2 {best['rel_l2_o']}")
        if fla:
            ratio = float(fla[0]["time_ms"]) / float(best["time_ms"])
            log(f"FLA fused_recurrent_kda: {float(fla[0]['time_ms']) * 1e3:.1f} us, FLA / ours = {ratio:.2f}"
                if math.isfinite(ratio) else "FLA: no time")


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.decode times a kernel on a GPU: torch sees no CUDA device here "
                         "(the kernel's CPU checks are in tests/kernels/test_s07_decode.py)")
    run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
