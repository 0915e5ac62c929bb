"""KDA as Kimi Linear calls it: FLA's chunk_kda, FlashKDA and the course in one process, on the tensors as
FLA's KimiDeltaAttention hands them over.

    python -m benchmarks.kimi_call --out DIR [--rounds 3] [--cases NAME,...] [--deadline SECONDS]

Every peer gets the same raw tensors: q, k, v, the gate projection x and beta's logits in bf16
(B, T, H, 128), A_log (H,) and dt_bias (H, 128) in fp32, an fp32 initial state, the final state asked
for, scale 1/sqrt(128), and the bounded gate lower_bound * sigmoid(exp(A_log) (x + dt_bias)) with
lower_bound = -5 (the one gate FlashKDA takes); each computes the q/k norms, the gate and beta's
sigmoid itself:

- FLA `call`: fla.ops.kda.chunk_kda with use_gate_in_kernel, use_qk_l2norm_in_kernel,
  use_beta_sigmoid_in_kernel, safe_gate and lower_bound, cu_seqlens (int64) for packed batches, its own
  Triton path (FLA_FLASH_KDA=0 is set before FLA is imported, or FLA would hand the call to FlashKDA);
- FlashKDA `call`: flash_kda.fwd, as FLA's FlashKDA backend calls it (states V-first, fp32), when
  `flash_kda` imports (the run says so when it does not);
- course `call`: stages.kda.calls.prefill with the InputForm of those flags (stages.kda.inputs) and
  checks="device", its default; `call_unchecked` with checks="off" (FlashKDA and FLA check nothing);
  course_4_passes `call`: the same with the prepare's score GEMMs in four channel passes at every chunk
  size (KernelConfig.channel_passes; the default takes four at C = 32 only: config.default_channel_passes);
- `kernels`: each peer's call captured as one CUDA graph and replayed (no Python, no host work), if it
  captures.

Cases (DESIGN.md's "as Kimi Linear calls it"): T = 8192 at H = 64 and 96; 8192 tokens in six packed
sequences (1300, 547, 2048, 963, 271, 3063) and in 8 x 1024 at H = 96; T = 16384 and 65536 at H = 32;
8 x 4096 at H = 16 (packed, as a server batches them). Times: medians of triton's do_bench (L2
flushed), in interleaved rounds (each round in the reverse order of the one before). Accuracy: o and
the final state of each peer against a float64 recurrence on the same tensors activated exactly
(stages.kda.inputs.activate), at T = 1024, H = 4 (ACCURACY_CASE).

Writes DIR/kimi_call.csv (one row per case, round, peer and measurement), DIR/kimi_call_meta.json (the
machine, versions, command, errors, what was missing) and DIR/kimi_call_accuracy.csv.
"""

import argparse
import csv
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("FLA_FLASH_KDA", "0")  # FLA's own Triton path, not its FlashKDA backend

from benchmarks import bench  # noqa: E402

CASES = {  # name: (sequence lengths, H); one length: a single sequence (B = 1)
    "T8192_H64": ((8192,), 64),
    "T8192_H96": ((8192,), 96),
    "packed6_H96": ((1300, 547, 2048, 963, 271, 3063), 96),
    "8x1024_H96": ((1024,) * 8, 96),
    "T16384_H32": ((16384,), 32),
    "T65536_H32": ((65536,), 32),
    "8x4096_H16": ((4096,) * 8, 16),
}
ACCURACY_CASE = ((1024,), 4)
D = 128
LOWER_BOUND = -5.0
PEERS = ("fla", "flashkda", "course", "course_4_passes")
MEASUREMENTS = [("fla", "call"), ("flashkda", "call"), ("course", "call"), ("course", "call_unchecked"),
                ("course_4_passes", "call"), ("fla", "kernels"), ("flashkda", "kernels"), ("course", "kernels"),
                ("course_4_passes", "kernels")]
FIELDS = ["case", "round", "impl", "what", "method", "tokens", "sequences", "H", "time_ms", "error"]
CSV_NAME, META_NAME, ACCURACY_NAME = "kimi_call.csv", "kimi_call_meta.json", "kimi_call_accuracy.csv"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kimi_call", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--deadline", type=float, default=None,
                        help="seconds after which no new case or round starts (what was measured is kept)")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the float64 accuracy check")
    args = parser.parse_args(argv)
    args.cases = args.cases.split(",")
    unknown = [name for name in args.cases if name not in CASES]
    if unknown:
        parser.error(f"unknown case {unknown}; choose from {list(CASES)}")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def kimi_form(scale):
    """The InputForm of Kimi Linear's flags with the bounded gate: the course's reading of FLA's call."""
    from stages.kda.inputs import InputForm

    return InputForm(gate="sigmoid", lower_bound=LOWER_BOUND, l2_normalize=True, beta="sigmoid", scale=scale)


def make_inputs(lengths, H, seed=0):
    """The raw tensors of one case on the GPU: a packed row (1, T, ...) and cu_seqlens (int64), or B = 1."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lengths)

    def normal(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=generator).to(dtype)

    q, k, v, x = (normal(1, T, H, D) for _ in range(4))
    beta = normal(1, T, H)
    A_log = torch.rand(H, device="cuda", generator=generator)  # exp(A_log) in [1, e]: FlashKDA's own benchmark's
    dt_bias = torch.rand(H, D, device="cuda", generator=generator)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64, device="cuda")
    initial_state = torch.randn(len(lengths), H, D, D, device="cuda", generator=generator) * 0.1  # S^T (K, V)
    return dict(q=q, k=k, v=v, x=x, beta=beta, A_log=A_log, dt_bias=dt_bias, initial_state=initial_state,
                cu_seqlens=offsets if len(lengths) > 1 else None)


def peer_calls(inputs):
    """{peer: a function that makes its call and returns (o, final state S^T (N, H, K, V))}, for the
    peers that import; {peer: why not} for the others."""
    import torch

    calls, missing = {}, {}
    t = inputs
    scale = D ** -0.5
    N_seq = t["initial_state"].shape[0]
    try:
        from fla.ops.kda import chunk_kda

        def fla_call():
            return chunk_kda(t["q"], t["k"], t["v"], t["x"], t["beta"], scale=scale, initial_state=t["initial_state"],
                             output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                             use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=LOWER_BOUND,
                             A_log=t["A_log"], dt_bias=t["dt_bias"].view(-1), cu_seqlens=t["cu_seqlens"])

        calls["fla"] = fla_call
    except ImportError as failure:
        missing["fla"] = f"not importable: {failure}"
    try:
        import flash_kda

        state_v_first = t["initial_state"].transpose(-1, -2).contiguous()  # FlashKDA's states are (N, H, V, K)

        def flashkda_call():
            out = torch.empty_like(t["v"])
            final = torch.empty(N_seq, t["v"].shape[2], D, D, dtype=torch.float32, device="cuda")
            flash_kda.fwd(t["q"], t["k"], t["v"], t["x"], t["beta"], scale, out, A_log=t["A_log"],
                          dt_bias=t["dt_bias"], lower_bound=LOWER_BOUND, initial_state=state_v_first,
                          final_state=final, cu_seqlens=t["cu_seqlens"])
            return out, final.transpose(-1, -2)

        calls["flashkda"] = flashkda_call
    except ImportError as failure:
        missing["flashkda"] = f"not importable: {failure}"
    from stages.kda.calls import prefill
    from stages.kda.config import resolve_for

    form = kimi_form(scale)
    cu_seqlens = None if t["cu_seqlens"] is None else t["cu_seqlens"].to(torch.int32)

    def course_call(checks="device", config=None):
        return prefill(t["q"], t["k"], t["v"], t["x"], t["beta"], cu_seqlens, t["initial_state"], True, checks, config,
                       form, t["A_log"], t["dt_bias"])

    sequences = 1 if cu_seqlens is None else cu_seqlens.numel() - 1
    four_passes = resolve_for(t["q"].device, sequences, t["v"].shape[2], D, D, channel_passes=4)
    calls["course"] = course_call
    calls["course_unchecked"] = lambda: course_call("off")
    calls["course_4_passes"] = lambda: course_call(config=four_passes)
    return calls, missing


def float64_reference(inputs):
    """o and the final states in float64 from the same raw tensors, activated exactly, sequence by
    sequence, the recurrence token by token on the GPU (stages.kda.inputs.activate)."""
    import torch

    from stages.kda.inputs import activate

    t = {name: (x.double() if x is not None and x.is_floating_point() else x) for name, x in inputs.items()}
    q, k, g, beta = activate(kimi_form(D ** -0.5), t["q"], t["k"], t["x"], t["beta"], t["A_log"], t["dt_bias"])
    offsets = [0, q.shape[1]] if t["cu_seqlens"] is None else t["cu_seqlens"].tolist()
    o, states = torch.zeros_like(t["v"]), []
    for i, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        o[0, start:end], S = token_by_token(*(x[0, start:end] for x in (q, k, t["v"], g, beta)),
                                            t["initial_state"][i])
        states.append(S)
    return o, torch.stack(states)


def token_by_token(q, k, v, g, beta, S):
    """One sequence's recurrence a token at a time, in torch (differentiable): q, k, g (T, H, K), v (T, H, V),
    beta (T, H), S^T (H, K, V) the state it starts from -> o (T, H, V) and the final S^T. Per token:
    S^T <- diag(e^g) S^T, then S^T <- S^T + beta k (v - S k)^T, then o = S q."""
    import torch

    outputs = []
    for position in range(q.shape[0]):
        k_t = k[position]
        S = torch.exp(g[position])[..., None] * S
        S = S + beta[position][:, None, None] * k_t[..., None] * (v[position] - (k_t[..., None] * S).sum(-2))[:, None, :]
        outputs.append((q[position][..., None] * S).sum(-2))
    return torch.stack(outputs), S


def relative_l2(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm()).item()


def accuracy(log):
    """[{impl, o_rel_l2, state_rel_l2}] at ACCURACY_CASE, each peer against float64."""
    inputs = make_inputs(*ACCURACY_CASE, seed=1)
    expected_o, expected_state = float64_reference(inputs)
    calls, _ = peer_calls(inputs)
    rows = []
    for impl in PEERS:
        if impl not in calls:
            continue
        o, state = calls[impl]()
        rows.append(dict(impl=impl, o_rel_l2=f"{relative_l2(o, expected_o):.3e}",
                         state_rel_l2=f"{relative_l2(state, expected_state):.3e}"))
        log(f"accuracy {impl}: o {rows[-1]['o_rel_l2']}, final state {rows[-1]['state_rel_l2']}")
    return rows


def run_case(name, args, writer, log, timer, deadline):
    import torch

    from benchmarks.fair import capture

    lengths, H = CASES[name]
    inputs = make_inputs(lengths, H)
    calls, missing = peer_calls(inputs)
    functions, methods, errors = {}, {}, dict(((impl, what), why) for impl, why in missing.items()
                                              for what in ("call", "kernels"))
    reference = calls["course"]()
    for impl in PEERS:
        if impl not in calls:
            continue
        try:
            o, state = calls[impl]()  # compiles, autotunes
            log(f"{name} {impl}: rel L2 vs the course: o {relative_l2(o, reference[0].double()):.2e}, "
                f"state {relative_l2(state, reference[1].double()):.2e}")
        except Exception as failure:
            traceback.print_exc()
            errors[(impl, "call")] = errors[(impl, "kernels")] = f"{type(failure).__name__}: {str(failure)[:200]}"
            continue
        functions[(impl, "call")], methods[(impl, "call")] = calls[impl], "events"
        try:
            functions[(impl, "kernels")], methods[(impl, "kernels")] = capture(calls[impl]).replay, "graph"
        except Exception as failure:
            errors[(impl, "kernels")] = f"no CUDA graph: {type(failure).__name__}: {str(failure)[:150]}"
            torch.cuda.synchronize()
    functions[("course", "call_unchecked")], methods[("course", "call_unchecked")] = calls["course_unchecked"], "events"
    for round_number in range(1, args.rounds + 1):
        if deadline is not None and time.monotonic() > deadline:
            log("deadline: no new round")
            break
        for key in MEASUREMENTS if round_number % 2 else MEASUREMENTS[::-1]:
            row = dict(case=name, round=round_number, impl=key[0], what=key[1], method=methods.get(key, ""),
                       tokens=sum(lengths), sequences=len(lengths), H=H)
            if key in functions:
                row["time_ms"] = f"{timer(functions[key]):.4f}"
            else:
                row["error"] = errors.get(key, "not measured")
            writer.writerow(row)
            log(f"round {round_number} {name} {key[0]} {key[1]}: {row.get('time_ms', row.get('error'))}")
    return {"missing": missing, "errors": {f"{i} {w}": e for (i, w), e in errors.items()}}


def summary(rows):
    """{case: {(impl, what): median ms over rounds}} from the CSV's rows."""
    table = {}
    for row in rows:
        if row.get("time_ms"):
            table.setdefault(row["case"], {}).setdefault((row["impl"], row["what"]), []).append(float(row["time_ms"]))
    return {case: {key: statistics.median(values) for key, values in measured.items()}
            for case, measured in table.items()}


def git_commit():
    """The commit the run's tree was checked out at (its kernels), or None outside a git checkout."""
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).resolve().parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def main(argv=None):
    args = parse_args(argv)
    if bench.cuda_is_missing("benchmarks.kimi_call"):
        return 2
    import torch

    from triton.testing import do_bench
    started = time.monotonic()
    deadline = None if args.deadline is None else started + args.deadline
    log = bench.seconds_log(started)

    def timer(function):
        with torch.no_grad():
            return float(do_bench(function, warmup=10, rep=60, return_mode="median"))

    args.out.mkdir(parents=True, exist_ok=True)
    meta = dict(bench.run_meta("benchmarks.kimi_call", argv, ("fla", "flash_kda", "tilelang", "triton")),
                lower_bound=LOWER_BOUND, rounds=args.rounds, cases={}, commit=git_commit())
    if not args.no_accuracy:
        rows = accuracy(log)
        with open(args.out / ACCURACY_NAME, "w", newline="") as f:
            writer = csv.DictWriter(f, ["impl", "o_rel_l2", "state_rel_l2"])
            writer.writeheader()
            writer.writerows(rows)
    with open(args.out / CSV_NAME, "w", newline="") as f:
        writer = csv.DictWriter(f, FIELDS)
        writer.writeheader()
        for name in args.cases:
            if deadline is not None and time.monotonic() > deadline:
                log(f"deadline: {name} not started")
                break
            try:
                meta["cases"][name] = run_case(name, args, writer, log, timer, deadline)
            except Exception as failure:
                traceback.print_exc()
                meta["cases"][name] = {"error": f"{type(failure).__name__}: {str(failure)[:200]}"}
            f.flush()
            torch.cuda.empty_cache()
    meta["seconds"] = round(time.monotonic() - started)
    (args.out / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    with open(args.out / CSV_NAME, newline="") as f:
        for case, measured in summary(list(csv.DictReader(f))).items():
            log(case + ": " + ", ".join(f"{i} {w} {ms:.3f}" for (i, w), ms in sorted(measured.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
