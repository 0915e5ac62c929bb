"""KDA training as Kimi Linear calls it: FLA's chunk_kda and the course's drop-in
(stages.kda.autograd.chunk_kda, FLA's signature) forward and backward, in one process:

    python -m benchmarks.kimi_train --out DIR [--rounds 3] [--cases T4096_H32,...] [--gates bounded,softplus]
                                    [--deadline SECONDS] [--no-accuracy] [--profile CASE]

Both are called as `fla.layers.KimiDeltaAttention` calls chunk_kda in training: raw q, k, the raw gate
projection x, beta's logits, `A_log` (H,) and `dt_bias` (H * K) fp32, `use_qk_l2norm_in_kernel`,
`use_gate_in_kernel` and `use_beta_sigmoid_in_kernel`, FLA's default scale, no initial state, then
torch.autograd.grad of o with a random dLoss/do for all seven inputs (q, k, v, x, beta, A_log,
dt_bias). Two gates (GATES): the layer's default, `-exp(A_log) * softplus(x + dt_bias)`, and the
bounded one, `safe_gate=True, lower_bound=-5`. FlashKDA has no backward and is not a peer here.

Cases: the backward benchmark's single-sequence shapes (benchmarks/backward.py: T = 4096, 16384 and
65536 at H = 32, d = 128), bf16. Times: medians of triton's do_bench (L2 flushed) of one forward +
backward, with CUDA events (autograd does not capture as a CUDA graph), in interleaved rounds (each
round in the reverse order of the one before). FLA's first call compiles and autotunes its Triton
kernels: minutes on a fresh machine. Accuracy: o and each gradient of each peer against float64
autograd through the same activation and a token-by-token recurrence (stages.kda.inputs.activate), at
T = 1024, H = 4 (ACCURACY_CASE).

--profile CASE: instead of all that, torch.profiler over five of the course's steps at CASE (after
three untimed ones), for each gate, the table by CUDA time written to DIR/course_profile_<gate>.txt:
where a step's time goes, kernels and torch's operations around them.

Writes DIR/kimi_train.csv (one row per case, gate, round and peer), DIR/kimi_train_accuracy.csv (per
gate and peer, rel L2 of o and every gradient, and the course's over FLA's) and
DIR/kimi_train_meta.json (machine, versions, command, errors).
"""

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("FLA_FLASH_KDA", "0")  # FLA's own Triton path

from benchmarks import bench  # noqa: E402
from benchmarks.kimi_call import git_commit, relative_l2, summary, token_by_token  # noqa: E402

CASES = {"T4096_H32": (4096, 32), "T16384_H32": (16384, 32), "T65536_H32": (65536, 32)}  # (T, H), B = 1
GATES = {"bounded": dict(safe_gate=True, lower_bound=-5.0), "softplus": dict(safe_gate=False, lower_bound=None)}
ACCURACY_CASE = (1024, 4)
D = 128
PEERS = ("fla", "course")
GRADIENTS = ("q", "k", "v", "x", "beta", "A_log", "dt_bias")  # the inputs autograd differentiates
CSV_NAME, ACCURACY_NAME, META_NAME = "kimi_train.csv", "kimi_train_accuracy.csv", "kimi_train_meta.json"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help=f"folder for {CSV_NAME} and the rest")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--gates", default=",".join(GATES), help=f"comma-separated, of {', '.join(GATES)}")
    parser.add_argument("--deadline", type=float, default=None, help="seconds after which no new round starts")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the float64 comparison")
    parser.add_argument("--profile", default=None, help="profile the course's steps at this case instead")
    args = parser.parse_args(argv)
    if args.profile is not None and args.profile not in CASES:
        parser.error(f"--profile: unknown {args.profile} (known: {', '.join(CASES)})")
    for name, known in (("cases", CASES), ("gates", GATES)):
        chosen = getattr(args, name).split(",")
        unknown = [item for item in chosen if item not in known]
        if unknown:
            parser.error(f"--{name}: unknown {', '.join(unknown)} (known: {', '.join(known)})")
        setattr(args, name, chosen)
    return args


def make_inputs(T, H, seed=0, device="cuda"):
    """The raw tensors of one case, the seven that take gradients as leaves, and dLoss/do."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)

    def normal(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device=device, generator=generator).to(dtype).requires_grad_()

    q, k, v, x = (normal(1, T, H, D) for _ in range(4))
    beta = normal(1, T, H)
    A_log = torch.rand(H, device=device, generator=generator).requires_grad_()
    dt_bias = torch.rand(H * D, device=device, generator=generator).requires_grad_()
    do = torch.randn(1, T, H, D, device=device, generator=generator).to(torch.bfloat16)
    return dict(q=q, k=k, v=v, x=x, beta=beta, A_log=A_log, dt_bias=dt_bias, do=do)


def peer_steps(inputs, gate):
    """{peer: a function that runs one forward and backward and returns (o, the seven gradients)}, for
    the peers that import; {peer: why not} for the others."""
    import torch

    from stages.kda.autograd import chunk_kda as course_chunk_kda

    steps, missing = {}, {}
    t = inputs
    leaves = [t[name] for name in GRADIENTS]

    def step_through(chunk_kda):
        def step():
            o, _ = chunk_kda(t["q"], t["k"], t["v"], t["x"], t["beta"], A_log=t["A_log"], dt_bias=t["dt_bias"],
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                             **GATES[gate])
            return o, torch.autograd.grad(o, leaves, t["do"])

        return step

    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        steps["fla"] = step_through(fla_chunk_kda)
    except ImportError as failure:
        missing["fla"] = f"not importable: {failure}"
    steps["course"] = step_through(course_chunk_kda)
    return steps, missing


def float64_step(inputs, gate):
    """o and the seven gradients in float64: the raw tensors activated exactly (stages.kda.inputs.activate)
    and the recurrence token by token, differentiated by autograd."""
    import torch

    from stages.kda.inputs import InputForm, activate

    t = {name: inputs[name].detach().double().requires_grad_() for name in GRADIENTS}
    bound = GATES[gate]["lower_bound"]
    form = InputForm(gate="softplus" if bound is None else "sigmoid", lower_bound=bound, l2_normalize=True,
                     beta="sigmoid", scale=D ** -0.5)
    q, k, g, beta = activate(form, t["q"], t["k"], t["x"], t["beta"], t["A_log"], t["dt_bias"])
    no_state = torch.zeros(q.shape[2], D, D, dtype=torch.float64, device=q.device)  # S^T (H, K, V)
    o = token_by_token(q[0], k[0], t["v"][0], g[0], beta[0], no_state)[0][None]
    return o, torch.autograd.grad(o, [t[name] for name in GRADIENTS], inputs["do"].double())


def accuracy(gates, log):
    """Rows {gate, impl, o, <gradient>...: rel L2 against float64} at ACCURACY_CASE, then a row of the
    course's errors over FLA's."""
    rows = []
    for gate in gates:
        inputs = make_inputs(*ACCURACY_CASE, seed=1)
        expected_o, expected_grads = float64_step(inputs, gate)
        steps, _ = peer_steps(inputs, gate)
        errors = {}
        for impl, step in steps.items():
            o, grads = step()
            errors[impl] = dict(o=relative_l2(o, expected_o), **{name: relative_l2(grad, expected)
                                                                 for name, grad, expected in
                                                                 zip(GRADIENTS, grads, expected_grads)})
            rows.append(dict(gate=gate, impl=impl, **{key: f"{value:.3e}" for key, value in errors[impl].items()}))
            log(f"accuracy {gate} {impl}: " + ", ".join(f"{key} {value}" for key, value in rows[-1].items()
                                                         if key not in ("gate", "impl")))
        if set(PEERS) <= set(errors):
            rows.append(dict(gate=gate, impl="course/fla", **{key: f"{errors['course'][key] / errors['fla'][key]:.3f}"
                                                              for key in errors["course"]}))
            log(f"accuracy {gate} course/fla: " + ", ".join(f"{key} {value}" for key, value in rows[-1].items()
                                                            if key not in ("gate", "impl")))
    return rows


def profile_course(name, gate, path):
    """torch.profiler's table (by CUDA time) of five of the course's steps at case `name`, into `path`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    step = peer_steps(make_inputs(*CASES[name]), gate)[0]["course"]
    for _ in range(3):  # compiles, then warm
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(5):
            step()
        torch.cuda.synchronize()
    path.write_text(profiler.key_averages().table(sort_by="cuda_time_total", row_limit=30,
                                                  max_name_column_width=70) + "\n")


def run_case(name, gate, args, writer, log, timer, deadline):
    """One case and gate: each peer's first step (compiles, autotunes) compared with the course's, then
    the timed rounds. Returns {peer: why it was not timed}."""
    import torch

    T, H = CASES[name]
    steps, errors = peer_steps(make_inputs(T, H), gate)
    reference_o, reference_grads = steps["course"]()
    for impl in [peer for peer in PEERS if peer in steps]:
        try:
            o, grads = steps[impl]()
            log(f"{name} {gate} {impl}: rel L2 vs the course: o {relative_l2(o, reference_o.double()):.2e}, "
                + ", ".join(f"d{n} {relative_l2(a, b.double()):.2e}" for n, a, b in zip(GRADIENTS, grads,
                                                                                      reference_grads)))
        except Exception as failure:  # a peer that fails is reported, the others still timed
            errors[impl] = f"{type(failure).__name__}: {str(failure)[:200]}"
            steps.pop(impl)
            torch.cuda.synchronize()
    for round_number in range(1, args.rounds + 1):
        if deadline is not None and time.monotonic() > deadline:
            log("deadline: no new round")
            break
        for impl in PEERS if round_number % 2 else PEERS[::-1]:
            row = dict(case=name, gate=gate, round=round_number, impl=impl, what="fwd_bwd_call", method="events",
                       tokens=T, H=H)
            if impl in steps:
                row["time_ms"] = f"{timer(steps[impl]):.4f}"
            else:
                row["error"] = errors.get(impl, "not measured")
            writer.writerow(row)
            log(f"round {round_number} {name} {gate} {impl}: {row.get('time_ms', row.get('error'))}")
    return errors


def main(argv=None):
    args = parse_args(argv)
    if bench.cuda_is_missing("benchmarks.kimi_train"):
        return 2

    from triton.testing import do_bench

    started = time.monotonic()
    deadline = None if args.deadline is None else started + args.deadline
    log = bench.seconds_log(started)

    def timer(step):
        return float(do_bench(step, warmup=5, rep=60, return_mode="median"))

    args.out.mkdir(parents=True, exist_ok=True)
    if args.profile is not None:
        for gate in args.gates:
            profile_course(args.profile, gate, args.out / f"course_profile_{gate}.txt")
            log(f"profiled {args.profile} {gate}: {args.out / f'course_profile_{gate}.txt'}")
        return 0
    meta = dict(bench.run_meta("benchmarks.kimi_train", argv), commit=git_commit(), rounds=args.rounds, cases={})
    if not args.no_accuracy:
        with open(args.out / ACCURACY_NAME, "w", newline="") as handle:
            rows = accuracy(args.gates, log)
            writer = csv.DictWriter(handle, fieldnames=["gate", "impl", "o", *GRADIENTS])
            writer.writeheader()
            writer.writerows(rows)
    fields = ["case", "gate", "round", "impl", "what", "method", "tokens", "H", "time_ms", "error"]
    with open(args.out / CSV_NAME, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        for gate in args.gates:
            for name in args.cases:
                if deadline is not None and time.monotonic() > deadline:
                    log(f"deadline: {name} {gate} not run")
                    continue
                meta["cases"][f"{name} {gate}"] = run_case(name, gate, args, writer, log, timer, deadline)
                handle.flush()
    rows = list(csv.DictReader(open(args.out / CSV_NAME)))
    for gate in args.gates:
        table = summary([row for row in rows if row["gate"] == gate])
        for name, measured in table.items():
            course, fla = measured.get(("course", "fwd_bwd_call")), measured.get(("fla", "fwd_bwd_call"))
            if course and fla:
                log(f"{name} {gate}: course {course:.3f} ms, FLA {fla:.3f} ms: {fla / course:.2f}x FLA")
    (args.out / META_NAME).write_text(json.dumps(meta, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
