"""Stage 8 over R GPUs, one process each (NCCL): chunk_kda_cp checked against one device and timed,
beside FLA's chunk_kda with its cp_context where FLA is installed.

    python -m benchmarks.context_parallel_gpus --out DIR [--ranks 2] [--tokens 1048576] [--H 32] [--d 128]
                                               [--rounds 3] [--repeats 5] [--check-tokens 2048]
                                               [--device cuda|cpu] [--backend nccl|gloo] [--no-fla]

The command starts the R ranks itself (this module again, with --rank, each on GPU `rank`; they meet
through a file store in DIR) and waits for them, killing them past --limit seconds. Rank 0 writes:

- the check: one sequence of --check-tokens tokens (--check-H heads of --check-d), made in float64
  from one seed on every rank, each rank running its part through chunk_kda_cp in the run's dtype
  (bf16 on CUDA, float64 on the CPU), forward and backward (the loss <do, o>); o and the gradients
  gathered on rank 0 against stages.kda.autograd.chunk_kda on the whole sequence in float64 on the
  CPU (the references): rel L2 of each in the meta file. Every middle rank relays the sequence, so
  the map is checked too. (Packed batches are checked on the CPU: tests/stages/test_s08_distributed.py);
- the timings: one sequence of --tokens tokens, each rank holding T / R of them (random values, its
  own seed), for `ours_pass` (chunk_kda_cp, states passed rank after rank), `ours_gather` (every
  rank's summary all-gathered, FLA's way) and `fla` (fla.ops.kda.chunk_kda with
  fla.ops.cp.build_cp_context): `forward` (no autograd) and `forward_backward` (the forward, then
  o.backward(do)). Each of --repeats calls starts after a barrier and is timed on every rank
  (synchronized wall clock); a row per rank, call and round;
- `message`: one state's bytes (H * d_k * d_v fp32) sent from rank 0 to rank 1 and back, the round
  trip halved: the link's time for one message of the pass.

Writes DIR/context_parallel_gpus.csv and DIR/context_parallel_gpus_meta.json. `--device cpu --backend
gloo` runs the same on the CPU, float64, at small sizes (tests/benchmarks/test_benchmark_context_parallel.py);
`--backend gloo` on CUDA shares one GPU among the ranks, the states staged through the host.
"""

import argparse
import csv
import datetime
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

FIELDS = ["impl", "what", "ranks", "tokens", "H", "D", "dtype", "round", "rank", "time_ms", "error"]
MEASUREMENTS = [("ours_pass", "forward"), ("ours_gather", "forward"), ("fla", "forward"),
                ("ours_pass", "forward_backward"), ("ours_gather", "forward_backward"), ("fla", "forward_backward")]
GATE_RANGE = (0.9, 0.999)
BETA_RANGE = (0.1, 0.9)
CSV_NAME, META_NAME = "context_parallel_gpus.csv", "context_parallel_gpus_meta.json"
REPO_ROOT = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.context_parallel_gpus",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2**20, help="the timed sequence's tokens T")
    parser.add_argument("--H", type=int, default=32)
    parser.add_argument("--d", type=int, default=128, help="d_k = d_v")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each measurement a round")
    parser.add_argument("--check-tokens", type=int, default=2048, help="the checked sequence's tokens")
    parser.add_argument("--check-H", type=int, default=2, help="the checked sequence's heads")
    parser.add_argument("--check-d", type=int, default=32, help="the checked sequence's d_k = d_v")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--limit", type=int, default=540, help="seconds before the ranks are killed")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # set by the launch, one process a rank
    args = parser.parse_args(argv)
    if args.ranks < 2 or args.tokens % args.ranks or args.check_tokens % args.ranks:
        parser.error(f"--ranks must be at least 2 and divide --tokens and --check-tokens (got {args.ranks}, "
                     f"{args.tokens}, {args.check_tokens})")
    if args.device == "cpu" and args.backend == "nccl":
        parser.error("NCCL sends CUDA tensors only: use --backend gloo with --device cpu")
    return args


# ------------------------------------------------------------------------------------------ the launch


def launch(args, argv, log=print):
    """Start the R ranks (this module with --rank) and wait; kill them all past args.limit seconds."""
    args.out.mkdir(parents=True, exist_ok=True)
    store = args.out / "store"
    store.unlink(missing_ok=True)
    command = [sys.executable, "-m", "benchmarks.context_parallel_gpus", *argv]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    ranks = [subprocess.Popen(command + ["--rank", str(rank)], cwd=REPO_ROOT, env=env, start_new_session=True)
             for rank in range(args.ranks)]
    deadline, failed = time.monotonic() + args.limit, []
    try:
        for rank, process in enumerate(ranks):
            try:
                if process.wait(timeout=max(1.0, deadline - time.monotonic())):
                    failed.append(rank)
            except subprocess.TimeoutExpired:
                failed.append(rank)
    finally:
        for process in ranks:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        store.unlink(missing_ok=True)
    if failed:
        raise SystemExit(f"ranks {failed} failed or ran past {args.limit} s")
    log(f"wrote {args.out / CSV_NAME} and {args.out / META_NAME}")


# ------------------------------------------------------------------------------------------ one rank


def rank_main(args):
    import torch
    import torch.distributed as dist

    dist.init_process_group(args.backend, init_method=f"file://{args.out / 'store'}", rank=args.rank,
                            world_size=args.ranks, timeout=datetime.timedelta(seconds=args.limit))
    if args.device == "cuda":
        if args.backend == "nccl" and torch.cuda.device_count() < args.ranks:
            raise SystemExit(f"NCCL needs a GPU a rank: {args.ranks} ranks, {torch.cuda.device_count()} GPUs")
        device = torch.device("cuda", args.rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float64
    try:
        meta = dict(command="python -m benchmarks.context_parallel_gpus " + " ".join(_launch_argv()),
                    device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                    backend=args.backend, ranks=args.ranks, tokens=args.tokens, H=args.H, D=args.d,
                    dtype=str(dtype).split(".")[1], torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                    check=check(args, device, dtype), message_ms=message_ms(args, device))
        rows, meta["fla"] = timings(args, device, dtype)
        if args.rank == 0:
            with open(args.out / CSV_NAME, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=FIELDS)
                writer.writeheader()
                writer.writerows(rows)
            (args.out / META_NAME).write_text(json.dumps(meta, indent=1) + "\n")
    finally:
        dist.destroy_process_group()


def _launch_argv():
    argv = sys.argv[1:]
    return argv[:argv.index("--rank")] if "--rank" in argv else argv


def make_batch(lengths, H, d, seed, device, dtype):
    """A packed batch (1, T, ...) drawn on `device` from one seed: q, k L2-normalized, v and do in dtype;
    g = log a and beta in fp32 on CUDA (the kernels' gate dtype), in dtype on the CPU; and cu_seqlens."""
    import torch

    generator = torch.Generator(device=device).manual_seed(seed)
    T = sum(lengths)
    drawn = torch.float32 if device.type == "cuda" else torch.float64  # what the draws are made in

    def normal(*shape):
        return torch.randn(*shape, generator=generator, device=device, dtype=drawn)

    def uniform(shape, low, high):
        return low + (high - low) * torch.rand(shape, generator=generator, device=device, dtype=drawn)

    q, k = (torch.nn.functional.normalize(normal(1, T, H, d), dim=-1).to(dtype) for _ in range(2))
    v, do = (normal(1, T, H, d).to(dtype) for _ in range(2))
    gate_dtype = torch.float32 if device.type == "cuda" else dtype
    g, beta = uniform((1, T, H, d), *GATE_RANGE).log().to(gate_dtype), uniform((1, T, H), *BETA_RANGE).to(gate_dtype)
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    return [q, k, v, g, beta], do, cu_seqlens


def check(args, device, dtype):
    """{what: rel L2 of the ranks' result against the float64 truth} on the check batch (module docstring)."""
    import torch

    from stages.kda.autograd import chunk_kda
    from stages.s08_context_parallel.distributed import build_cp_context, chunk_kda_cp

    T = args.check_tokens
    inputs, do, cu_seqlens = make_batch([T], args.check_H, args.check_d, args.seed, torch.device("cpu"), torch.float64)
    context = build_cp_context(cu_seqlens)
    rows = context.part.tokens
    gate_dtype = torch.float32 if device.type == "cuda" else dtype
    leaves = [x[:, rows].to(device, dtype if i < 3 else gate_dtype).requires_grad_() for i, x in enumerate(inputs)]
    o, _ = chunk_kda_cp(*leaves, context)
    o.backward(do[:, rows].to(device, dtype))
    ours = [_gathered(x.to(torch.float64), context) for x in (o.detach(), *(leaf.grad for leaf in leaves))]
    if args.rank != 0:
        return None
    whole = [x.clone().requires_grad_() for x in inputs]  # one device, float64 on the CPU: the references
    expected_o, _ = chunk_kda(*whole, scale=1.0)
    expected_o.backward(do)
    expected = [expected_o.detach(), *(x.grad for x in whole)]
    return {name: _relative_l2(a.cpu(), b) for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), ours, expected)}


def _gathered(x, context):
    """The ranks' equal parts of a (1, n, ...) tensor laid side by side on every rank."""
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(context.world_size)]
    dist.all_gather(parts, x.contiguous(), group=context.group)
    return torch.cat(parts, dim=1)


def _relative_l2(actual, expected):
    return ((actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-300)).item()


def message_ms(args, device):
    """Median ms of one state sent from rank 0 to rank 1, half a round trip, over --repeats trips."""
    import torch
    import torch.distributed as dist

    state = torch.zeros(args.H, args.d, args.d, device=device if args.backend == "nccl" else "cpu")
    times = []
    for _ in range(args.repeats + 2):  # the first two warm the connection up
        dist.barrier()
        started = time.perf_counter()
        if args.rank == 0:
            dist.send(state, dst=1)
            dist.recv(state, src=1)
        elif args.rank == 1:
            dist.recv(state, src=0)
            dist.send(state, dst=0)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - started) * 1e3 / 2)
    return statistics.median(times[2:]) if args.rank == 0 else None


def _callables(args, device, dtype):
    """{(impl, what): a callable}, FLA's where it imports, and FLA's import error or None."""
    import torch
    import torch.distributed as dist

    from stages.s08_context_parallel.distributed import build_cp_context, chunk_kda_cp

    inputs, do, _ = make_batch([args.tokens // args.ranks], args.H, args.d, args.seed + 1 + args.rank, device, dtype)
    cu_seqlens = torch.tensor([0, args.tokens])
    runs = {}
    for impl, combine in (("ours_pass", "pass"), ("ours_gather", "gather")):
        context = build_cp_context(cu_seqlens, combine=combine)
        runs[impl] = lambda context=context, **_: chunk_kda_cp(*inputs, context)[0]
    fla_error = None
    if args.no_fla or device.type != "cuda":
        fla_error = "not run (--no-fla or the CPU)"
    else:
        try:
            from fla.ops.cp import build_cp_context as fla_context
            from fla.ops.kda import chunk_kda as fla_chunk_kda

            context = fla_context(cu_seqlens.to(device), group=dist.group.WORLD)
            runs["fla"] = lambda **_: fla_chunk_kda(*inputs, scale=1.0, cp_context=context)[0]
        except Exception as error:  # noqa: BLE001 - recorded in the meta file, ours is timed anyway
            fla_error = f"{type(error).__name__}: {str(error)[:200]}"
    table = {}
    for impl, forward in runs.items():
        table[(impl, "forward")] = lambda forward=forward: _no_grad(forward)
        table[(impl, "forward_backward")] = lambda forward=forward: _with_backward(forward, inputs, do)
    return table, fla_error


def _no_grad(forward):
    import torch

    with torch.no_grad():
        return forward()


def _with_backward(forward, inputs, do):
    for x in inputs:
        x.requires_grad_(True)
        x.grad = None
    forward().backward(do)
    for x in inputs:
        x.requires_grad_(False)


def timings(args, device, dtype):
    """(rows of every rank's times, gathered on rank 0; FLA's import error or None)."""
    import torch
    import torch.distributed as dist

    table, fla_error = _callables(args, device, dtype)
    rows = []
    base = dict(ranks=args.ranks, tokens=args.tokens, H=args.H, D=args.d, dtype=str(dtype).split(".")[1])
    for round_number in range(1, args.rounds + 1):
        order = MEASUREMENTS if round_number % 2 else MEASUREMENTS[::-1]
        for key in (key for key in order if key in table):
            mine = []
            try:
                table[key]()  # warm-up (and TileLang's compiles, FLA's autotuning)
                for _ in range(args.repeats):
                    dist.barrier()
                    started = time.perf_counter()
                    table[key]()
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    mine.append(f"{(time.perf_counter() - started) * 1e3:.5f}")
                error = ""
            except Exception as failure:  # noqa: BLE001 - recorded, the run goes on
                traceback.print_exc()
                error = f"{type(failure).__name__}: {str(failure)[:200]}"
            everyone = [None] * args.ranks
            dist.all_gather_object(everyone, (mine, error))
            for rank, (times, rank_error) in enumerate(everyone):
                rows += [dict(base, impl=key[0], what=key[1], round=round_number, rank=rank, time_ms=t) for t in times]
                if rank_error:
                    rows.append(dict(base, impl=key[0], what=key[1], round=round_number, rank=rank, error=rank_error))
    return rows, fla_error


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("benchmarks.context_parallel_gpus --device cuda needs CUDA: torch sees no device here "
                             "(--device cpu --backend gloo runs it on the CPU)")
    launch(args, argv)


if __name__ == "__main__":
    main()
