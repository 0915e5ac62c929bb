"""Time stage 8's per-rank work on one GPU: a sequence of 1M tokens split over R = 2, 4 and 8 ranks.

    python -m benchmarks.context_parallel --out DIR [--direction forward|backward] [--tokens 1048576]
                                          [--ranks 2,4,8] [--H 32] [--d 128] [--rounds 3]

One device plays each rank in turn: what a rank runs depends only on its share of the tokens, T / R,
and on where it sits in the chain, so one middle rank's part (T / R tokens of bf16 q, k, v, fp32 g and
beta; gates a in [0.9, 0.999], beta in [0.1, 0.9], q and k L2-normalized) is timed, piece by piece, as
stage 8's chunk_kda_cp runs them (stages.kda.calls with checks="off", one sequence, B = 1):

    forward_from_zero     the rank's forward from a zero state: its final state Z (step 1); the first
                          rank's whole forward
    forward_map           the same tokens with v = 0 (d_k value columns) from the identity: its map A (step 1)
    pass_step             A S_in + Z for H heads in fp32 (reference.pass_states, step 2), without the message
    forward_from_state    the forward from S_in: outputs and final state (step 3); one device's work on
                          these tokens, and the last rank's whole forward
    recurrence_from_state step 3 had the rank kept its prepare kernel's outputs from step 1: the
                          recurrence kernel alone from S_in (what chunk_kda_cp does not do yet)
    backward_alone        the backward from S_in with no gradient on the state handed on: the gradient of
                          S_in through the rank's outputs (step 1 backwards)
    pass_step_backward    A^T dS_out + dS_in (reference.pass_state_gradients, step 2 backwards)
    backward_with_state   the backward with both gradients (step 3 backwards); one device's backward here

each the median of triton's do_bench in `--rounds` interleaved rounds, the forward's pieces or the
backward's (`--direction`: two runs, since each number of ranks compiles its own kernels, about a
minute of TileLang's compiles each way). The one-device time for the whole
sequence is R x forward_from_state (the forward's work is linear in the tokens) and, where it fits in
memory, the forward over all T tokens in one call (`one_device_forward`). A message is one state, H * d_k
* d_v fp32 numbers: the meta file records its bytes; the time it takes on a link is the multi-GPU run's
(benchmarks/context_parallel_gpus.py).

Before timing, the pieces are checked against each other on the GPU: A S_in + Z against the final state
of the forward from S_in (the map is right), rel L2 in the meta file; past MAX_REL_L2 the run stops. The
check runs on MAP_CHECK_TOKENS tokens whose gates keep their memory (MAP_CHECK_GATES), not on a rank's
part: over 131,072 tokens and more, gates in GATE_RANGE forget S_in entirely (A rounds to 0 in fp32), and
A S_in + Z would equal the pass from S_in whatever A were.

Writes DIR/context_parallel_<direction>.csv (one row per ranks, round and piece) and
DIR/context_parallel_<direction>_meta.json.
Needs a CUDA device.
"""

import argparse
import csv
import json
import platform
import sys
import time
import traceback
from pathlib import Path

from benchmarks.decode import relative_l2, spread

FIELDS = ["ranks", "tokens", "tokens_per_rank", "H", "D", "dtype", "round", "what", "time_ms", "time_ms_p20",
          "time_ms_p80", "error"]
PIECES = {"forward": ["forward_from_zero", "forward_map", "pass_step", "forward_from_state", "recurrence_from_state"],
          "backward": ["backward_alone", "pass_step_backward", "backward_with_state"]}
GATE_RANGE = (0.9, 0.999)
# the map's check: a part short enough, and gates near enough 1, that A S_in is most of the final state
MAP_CHECK_TOKENS = 256
MAP_CHECK_GATES = (0.999, 1.0)
BETA_RANGE = (0.1, 0.9)
# A S_in + Z against the pass from S_in in fp32 states and bf16 operands: a rounding apart (about 1e-2 at
# most); a wrong map is several tenths off
MAX_REL_L2 = 5e-2
KERNEL_MODULE = "stages.s06_backward.kernel"  # names the forward's and the backward's builders


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.context_parallel", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for the CSV file and its meta file")
    parser.add_argument("--direction", choices=tuple(PIECES), default="forward", help="whose pieces to time")
    parser.add_argument("--tokens", type=int, default=2**20, help="the whole sequence's tokens T")
    parser.add_argument("--ranks", default="2,4,8", help="comma-separated numbers of ranks R")
    parser.add_argument("--H", type=int, default=32)
    parser.add_argument("--d", type=int, default=128, help="d_k = d_v")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    try:
        args.ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        parser.error(f"--ranks must be comma-separated integers, got {args.ranks!r}")
    if any(r < 2 for r in args.ranks) or any(args.tokens % r for r in args.ranks):
        parser.error(f"every number of ranks must be at least 2 and divide --tokens {args.tokens}, got {args.ranks}")
    return args


def message_bytes(H: int, d_k: int, d_v: int) -> int:
    """One state, or its gradient, as a message: H * d_k * d_v fp32 numbers."""
    return H * d_k * d_v * 4


def make_part(tokens, H, d, seed, gradients=False, gate_range=GATE_RANGE):
    """One rank's inputs on the GPU: q, k (L2-normalized), v bf16; g (gates a drawn from gate_range), beta
    fp32; do bf16 with `gradients`, else None; S_in and the gradient of the state handed on (0.1 * standard
    normal, fp32)."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape):
        return torch.randn(*shape, generator=generator, device="cuda")

    def uniform(shape, low, high):
        return low + (high - low) * torch.rand(shape, generator=generator, device="cuda")

    q, k = (torch.nn.functional.normalize(normal(1, tokens, H, d), dim=-1).bfloat16() for _ in range(2))
    v = normal(1, tokens, H, d).bfloat16()
    g, beta = uniform((1, tokens, H, d), *gate_range).log(), uniform((1, tokens, H), *BETA_RANGE)
    do = normal(1, tokens, H, d).bfloat16() if gradients else None
    return (q, k, v, g, beta), do, 0.1 * normal(1, H, d, d), 0.1 * normal(1, H, d, d)


def pieces(inputs, do, incoming, d_outgoing, direction):
    """{piece: a callable that runs it} of the direction's pieces on one rank's inputs (module docstring),
    the rank's map A and its zero-start state Z."""
    import torch

    from stages.kda.calls import backward as kernels_backward
    from stages.kda.calls import forward
    from stages.s08_context_parallel.reference import pass_state_gradients, pass_states

    q, k, v, g, beta = inputs
    H, d = q.shape[2], q.shape[3]
    no_values = torch.zeros_like(q)
    identity = torch.eye(d, device="cuda").expand(1, H, d, d).contiguous()
    transition = forward(q, k, no_values, g, beta, identity, True, checks="off")[1][0]
    zero_state = forward(*inputs, None, True, checks="off")[1][0]
    if direction == "forward":
        recurrence, prepared = _recurrence_alone(inputs)
        table = {
            "forward_from_zero": lambda: forward(*inputs, None, True, checks="off"),
            "forward_map": lambda: forward(q, k, no_values, g, beta, identity, True, checks="off"),
            "pass_step": lambda: pass_states([transition], [zero_state], incoming[0]),
            "forward_from_state": lambda: forward(*inputs, incoming, True, checks="off"),
            "recurrence_from_state": lambda: recurrence(*prepared[:6], incoming),
        }
    else:
        zero_gradient = torch.zeros_like(d_outgoing)
        table = {
            "backward_alone": lambda: kernels_backward(*inputs, do, incoming, zero_gradient, checks="off"),
            # the gradient through the rank's own outputs: any (H, d_k, d_v) stands in for it
            "pass_step_backward": lambda: pass_state_gradients([transition], [incoming[0]], d_outgoing[0]),
            "backward_with_state": lambda: kernels_backward(*inputs, do, incoming, d_outgoing, checks="off"),
        }
    return table, transition, zero_state


def _recurrence_alone(inputs):
    """(the compiled recurrence kernel, the prepare kernel's outputs) for these inputs, as stage 5's
    forward_and_prepared runs and keeps them: the recurrence reads the first six."""
    from stages.common.checks import padded_length
    from stages.common.torch_checks import dtype_name
    from stages.kda.calls import forward_and_prepared
    from stages.kda.compiled import compiled_recurrence
    from stages.kda.config import resolve_for

    q, v = inputs[0], inputs[2]
    B, N, H, d_k = q.shape
    config = resolve_for(q.device, B, H, d_k, v.shape[3])
    _, _, prepared = forward_and_prepared(*inputs, None, "off", config, keep_prepared=True)
    recurrence = compiled_recurrence(B, padded_length(N, config.chunk_size), H, d_k, v.shape[3], config.chunk_size,
                                     config.block_dv, dtype_name(q), config.num_stages, config.threads,
                                     config.programs_per_sm)
    return recurrence, prepared


def map_error(H, d, seed):
    """rel L2 of A S_in + Z against the final state of the forward from S_in, on MAP_CHECK_TOKENS tokens
    with gates in MAP_CHECK_GATES (the map and the zero-start state made as `pieces` makes them)."""
    import torch

    from stages.kda.calls import forward

    inputs, _, incoming, _ = make_part(MAP_CHECK_TOKENS, H, d, seed, gate_range=MAP_CHECK_GATES)
    q, k, _, g, beta = inputs
    identity = torch.eye(d, device="cuda").expand(1, H, d, d).contiguous()
    transition = forward(q, k, torch.zeros_like(q), g, beta, identity, True, checks="off")[1][0]
    zero_state = forward(*inputs, None, True, checks="off")[1][0]
    return relative_l2(transition @ incoming[0] + zero_state, forward(*inputs, incoming, True, checks="off")[1][0])


def one_device_forward(tokens, H, d, seed):
    """(median, p20, p80) ms of the forward over all the tokens in one call, or the error that stopped it."""
    import torch

    from stages.kda.calls import forward

    try:
        inputs, *_ = make_part(tokens, H, d, seed)
        return spread(lambda: forward(*inputs, None, True, checks="off"))
    except (torch.cuda.OutOfMemoryError, MemoryError) as error:  # MemoryError: an output TileLang allocates
        return f"{type(error).__name__}: {str(error)[:160]}"
    finally:
        torch.cuda.empty_cache()


def run(args, log=print):
    import torch

    from stages.common.program_digest import modules_digest

    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    meta = dict(command="python -m benchmarks.context_parallel " + " ".join(sys.argv[1:]), direction=args.direction,
                device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                date=time.strftime("%Y-%m-%d"), tokens=args.tokens, H=args.H, D=args.d, dtype="bfloat16",
                message_bytes=message_bytes(args.H, args.d, args.d), kernel=modules_digest((KERNEL_MODULE,)),
                ranks={})
    error = map_error(args.H, args.d, args.seed)
    meta["map_check"] = dict(tokens=MAP_CHECK_TOKENS, gates=MAP_CHECK_GATES, rel_l2=error)
    log(f"A S_in + Z against the pass from S_in ({MAP_CHECK_TOKENS} tokens, gates in {MAP_CHECK_GATES}): "
        f"rel L2 {error:.2e}")
    if error > MAX_REL_L2:
        raise SystemExit(f"the map disagrees with the pass from S_in (rel L2 {error:.2e} > {MAX_REL_L2:.0e}): "
                         "a wrong map is not timed")
    rows = []
    for ranks in args.ranks:
        part = args.tokens // ranks
        base = dict(ranks=ranks, tokens=args.tokens, tokens_per_rank=part, H=args.H, D=args.d, dtype="bfloat16")
        try:
            inputs, do, incoming, d_outgoing = make_part(part, args.H, args.d, args.seed + ranks,
                                                         gradients=args.direction == "backward")
            table, transition, zero_state = pieces(inputs, do, incoming, d_outgoing, args.direction)
        # a rank's part past this GPU's memory (MemoryError: an output TileLang allocates): said, not timed
        except (torch.cuda.OutOfMemoryError, MemoryError) as error:
            meta["ranks"][str(ranks)] = dict(tokens_per_rank=part, skipped=f"{type(error).__name__}: {str(error)[:160]}")
            log(f"R = {ranks}: {part} tokens a rank do not fit this GPU's memory; not timed")
            inputs = do = table = transition = zero_state = None
            torch.cuda.empty_cache()
            continue
        meta["ranks"][str(ranks)] = dict(tokens_per_rank=part)
        log(f"R = {ranks}: {part} tokens a rank")
        for round_number in range(1, args.rounds + 1):
            order = PIECES[args.direction] if round_number % 2 else PIECES[args.direction][::-1]
            for what in order:
                row = dict(base, round=round_number, what=what)
                try:
                    median, p20, p80 = spread(table[what])
                    row.update(time_ms=f"{median:.5f}", time_ms_p20=f"{p20:.5f}", time_ms_p80=f"{p80:.5f}")
                except Exception as failure:  # noqa: BLE001 - recorded, the run goes on
                    traceback.print_exc()
                    row["error"] = f"{type(failure).__name__}: {str(failure)[:200]}"
                rows.append(row)
                log(f"  round {round_number} {what:20} {row.get('time_ms', 'failed'):>10} ms")
        del inputs, do, table, transition, zero_state
        torch.cuda.empty_cache()
        save(args, rows, meta, started)  # after every R: a run cut short keeps the ranks it timed
    if args.direction == "forward":
        whole = one_device_forward(args.tokens, args.H, args.d, args.seed)
        meta["one_device_forward_ms"] = whole if isinstance(whole, str) else dict(zip(("median", "p20", "p80"), whole))
        log(f"one device, all {args.tokens} tokens in one forward: {meta['one_device_forward_ms']}")
    save(args, rows, meta, started)
    return rows


def save(args, rows, meta, started):
    """The CSV file and the meta file as they stand."""
    with open(args.out / f"context_parallel_{args.direction}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    meta["seconds"] = round(time.monotonic() - started)
    (args.out / f"context_parallel_{args.direction}_meta.json").write_text(json.dumps(meta, indent=1) + "\n")


def main(argv=None):
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.context_parallel times kernels on a GPU: torch sees no CUDA device here "
                         "(stage 8's CPU checks are in tests/stages/test_s08_*.py)")
    run(args)


if __name__ == "__main__":
    main(sys.argv[1:])
