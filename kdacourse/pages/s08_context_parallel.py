"""Stage 8's generated files: the split of an example batch over ranks, the references against one device,
the identities, what the ranks send each other against what they hold, and the per-rank times of the
committed runs on one GPU (with the link's time for a message where a multi-GPU run is committed)."""

import inspect
import math

import numpy as np

from kdacourse.pages.stage_tables import identities_table
from kdacourse.pages.tables import ROUNDING_NOTE, banner, markdown_table, rounding_level
from stages.common.errors import error_report
from stages.common.inputs import make_backward_inputs

SOURCE = "kdacourse/pages/s08_context_parallel.py"
MIB, GIB = 2**20, 2**30

SPLIT_LENGTHS, SPLIT_RANKS = (13, 40, 5, 0, 39), 4
ERROR_LENGTHS, ERROR_RANKS, ERROR_CHUNK = (13, 40, 5, 0, 39), (1, 2, 4, 7), 16
H_ERRORS, D_K_ERRORS, D_V_ERRORS = 2, 8, 6
# the benchmark's shape: one sequence of about a million tokens, Kimi Linear's KDA heads
LONG_TOKENS, LONG_H, LONG_D = 2**20, 32, 128
COMMUNICATION_RANKS = (1, 2, 4, 8, 16)  # 1: one device


def _offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def write_split_table(path):
    from stages.s08_context_parallel.reference import split_over_ranks

    cu_seqlens = _offsets(SPLIT_LENGTHS)
    rows = []
    for rank, part in enumerate(split_over_ranks(cu_seqlens, SPLIT_RANKS)):
        rows.append((str(rank), f"{part.tokens.start} to {part.tokens.stop - 1}", ", ".join(map(str, part.cu_seqlens)),
                     ", ".join(map(str, part.sequences)), "yes" if part.receives else "no", "yes" if part.sends else "no"))
    path.write_text(
        banner(SOURCE) + f"Lengths {', '.join(map(str, SPLIT_LENGTHS))} (cu_seqlens = "
        f"{', '.join(map(str, cu_seqlens))}) over {SPLIT_RANKS} ranks.\n\n"
        + markdown_table(["rank", "tokens", "its cu_seqlens", "its sequences", "receives a state",
                          "hands a state on"], rows))


def _each_sequence_alone(x, do, cu_seqlens, S0, dS):
    """(o, final states, dq, dk, dv, dg, dbeta, dS_0) with each sequence alone through stage 6's reference A
    (token by token, paper layout): an answer that shares no code with stage 8's references."""
    from stages.s06_backward.reference import recurrent_backward

    o, finals, grads, d_initial = np.zeros(x.v.shape), S0.copy(), [np.zeros(a.shape) for a in
                                                                     (x.q, x.k, x.v, x.g, x.beta)], dS.copy()
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        if end > start:
            rows = slice(start, end)
            alone = recurrent_backward(*(a[:, rows] for a in (x.q, x.k, x.v, x.g, x.beta)), do[:, rows], S0[i:i + 1],
                                       dS[i:i + 1])
            o[:, rows], finals[i], d_initial[i] = alone.o, alone.final_state[0], alone.d_initial_state[0]
            for grad, part in zip(grads, alone[:5]):
                grad[:, rows] = part
    return (o, finals, *grads, d_initial)


def write_error_table(path):
    from stages.s08_context_parallel.reference import chunkwise, chunkwise_backward, recurrent

    cu_seqlens = _offsets(ERROR_LENGTHS)
    x, do, _, _ = make_backward_inputs(1, int(cu_seqlens[-1]), H_ERRORS, D_K_ERRORS, D_V_ERRORS, seed=0)
    rng = np.random.default_rng(1)
    S0, dS = (rng.standard_normal((len(ERROR_LENGTHS), H_ERRORS, D_K_ERRORS, D_V_ERRORS)) for _ in range(2))
    expected = _each_sequence_alone(x, do, cu_seqlens, S0, dS)
    args = (x.q, x.k, x.v, x.g, x.beta)
    rows = []
    for ranks in ERROR_RANKS:
        o_a, states_a = recurrent(*args, cu_seqlens, ranks, S0, output_final_state=True)
        o_b, states_b = chunkwise(*args, cu_seqlens, ranks, ERROR_CHUNK, S0, output_final_state=True)
        gradients = chunkwise_backward(*args, do, cu_seqlens, ranks, ERROR_CHUNK, S0, dS)
        worst = max(error_report(actual, wanted).rel_l2 for actual, wanted in zip(gradients[:6], expected[2:]))
        rows.append((str(ranks), *(rounding_level(error_report(a, b).rel_l2) for a, b in
                                   ((o_a, expected[0]), (states_a, expected[1]), (o_b, expected[0]),
                                    (states_b, expected[1]))), rounding_level(worst)))
    path.write_text(
        banner(SOURCE) + f"One packed batch, lengths {', '.join(map(str, ERROR_LENGTHS))}, H = {H_ERRORS}, d_k = "
        f"{D_K_ERRORS}, d_v = {D_V_ERRORS}, a random initial state per sequence, gates a in [0.5, 1), beta in [0, 1] "
        f"with a quarter of it exactly 0 or 1; reference B in chunks of {ERROR_CHUNK}. Against each sequence alone "
        "through stage 6's reference A; relative L2 errors, the backward's the largest over dq, dk, dv, dg, dbeta "
        "and dS_0.\n\n"
        + markdown_table(["ranks", "A: o", "A: final states", "B: o", "B: final states", "B backward: worst gradient"],
                         rows) + "\n" + ROUNDING_NOTE)


def write_identities_table(path):
    from stages.common.symbolic import counterexample
    from stages.s08_context_parallel.identities import IDENTITIES, REFUTED

    refuted = []
    for build in REFUTED:
        identity = build()
        where = build.__doc__.split(". ")[-1].rstrip(".") if inspect.signature(build).parameters else "nowhere"
        there = "proved" if inspect.signature(build).parameters and build(True).holds() else "-"
        refuted.append((f"`{build.__name__}`", identity.name, identity.statement,
                        "refuted at one rational point" if counterexample(identity) else "**not refuted**", where, there))
    path.write_text(identities_table(IDENTITIES, SOURCE) + "\n" + markdown_table(
        ["function", "not an identity", "statement", "SymPy", "where it hides", "SymPy there"], refuted))


# --8<-- [start:communication]
def message_bytes(H: int, d_k: int, d_v: int) -> int:
    """One state, or its gradient: H heads of a d_k x d_v fp32 matrix. The pass sends one a boundary, each way."""
    return H * d_k * d_v * 4


def summary_bytes(H: int, d_k: int, d_v: int) -> int:
    """A rank's map and state together, (A, Z): what a scan's round or an all-gather sends a rank."""
    return H * d_k * (d_k + d_v) * 4


def input_bytes(tokens: int, H: int, d_k: int, d_v: int) -> int:
    """What a rank holds of the batch before any work: q, k (bf16, d_k), v (bf16, d_v), g (fp32, d_k) and
    beta (fp32) of its tokens."""
    return tokens * H * (2 * 2 * d_k + 2 * d_v + 4 * d_k + 4)
# --8<-- [end:communication]


def write_communication_table(path):
    H, d = LONG_H, LONG_D
    message, summary = message_bytes(H, d, d), summary_bytes(H, d, d)
    rows = []
    for ranks in COMMUNICATION_RANKS:
        rows.append((str(ranks), f"{input_bytes(LONG_TOKENS // ranks, H, d, d) / GIB:.1f} GiB",
                     str(ranks - 1), str(math.ceil(math.log2(ranks))), f"{(ranks - 1) * summary / MIB:.0f} MiB"))
    path.write_text(
        banner(SOURCE) + f"One sequence of {LONG_TOKENS} tokens, H = {H}, d_k = d_v = {d}. A message of the pass is "
        f"one fp32 state, {message / MIB:.0f} MiB, whatever the tokens; a rank's map and state together, "
        f"{summary / MIB:.0f} MiB. The pass's messages follow one another along the chain (each waits for the one "
        "before); a scan's rounds each send every rank one summary; FLA's all-gather sends each rank every "
        "other rank's summary at once.\n\n"
        + markdown_table(["ranks R", "inputs a rank holds", "pass: messages in a row", "scan: rounds",
                          "all-gather: received a rank"], rows))


# the forward's and the backward's pieces, as benchmarks/context_parallel.py names them
FORWARD = ("forward_from_zero", "forward_map", "pass_step", "forward_from_state", "recurrence_from_state")
BACKWARD = ("backward_alone", "pass_step_backward", "backward_with_state")


def _medians(rows):
    from kdacourse.results import Spread, context_parallel_times

    return {ranks: {piece: Spread.of(by_round.values()).median for piece, by_round in pieces.items()}
            for ranks, pieces in context_parallel_times(rows).items()}


def _untimed(rows, pieces):
    """{ranks: the first error recorded} for the rank counts with a piece not timed in any round (a part
    past the GPU's memory, say)."""
    from kdacourse.results import context_parallel_times

    timed = context_parallel_times(rows)
    missing = {int(row["ranks"]) for row in rows} - {ranks for ranks, measured in timed.items()
                                                      if all(piece in measured for piece in pieces)}
    errors = [(int(row["ranks"]), row["error"].split(". ")[0]) for row in rows if row.get("error")]
    return {ranks: next((error for r, error in errors if r == ranks), "a piece was not timed") for ranks in missing}


def _message_ms():
    """The link's time for one message, from the committed multi-GPU run, or None."""
    from kdacourse.results import committed_run

    _, meta = committed_run("context_parallel_gpus.csv", "context_parallel_gpus_meta.json")
    return None if meta is None else meta.get("message_ms")


# --8<-- [start:critical_path]
def critical_path_ms(ranks: int, alone: float, again: float, pass_step: float, message: float,
                     summary: float = 0.0, last: float | None = None) -> float:
    """The time of R ranks on one sequence, until the end of the chain is done. The rank at the chain's
    start runs its part whole (`again`: from a state it knows) and hands its state on; each middle rank
    takes its step of the pass once both its own summary (`alone` + `summary`, run meanwhile) and the
    message before it have come; the rank at the chain's end then runs its step 3 (`last`, by default
    `again`: its part once more, from the state it received). The forward's chain runs from rank 0, the
    backward's from rank R - 1."""
    handed_on = again
    for _ in range(ranks - 2):
        handed_on = max(handed_on + message, alone + summary) + pass_step
    return handed_on + message + (again if last is None else last)
# --8<-- [end:critical_path]


def write_rank_times(path):
    from kdacourse.results import committed_run, shown_command

    runs = {direction: committed_run(f"context_parallel_{direction}.csv", f"context_parallel_{direction}_meta.json")
            for direction in ("forward", "backward")}
    if all(rows is None for rows, _ in runs.values()):
        path.write_text(banner(SOURCE) + "No run committed (`python -m benchmarks.context_parallel --direction forward "
                        "--out DIR`, then `--direction backward`).\n")
        return
    message = _message_ms()
    text = banner(SOURCE)
    for direction, (rows, meta) in runs.items():
        if rows is None:
            text += f"\nNo {direction} run committed.\n"
            continue
        pieces = FORWARD if direction == "forward" else BACKWARD
        table, untimed = [], _untimed(rows, pieces)
        for ranks, measured in sorted(_medians(rows).items()):
            if ranks in untimed:
                continue
            message_ms = message or 0.0
            one_device = ranks * measured[pieces[-2] if direction == "forward" else pieces[-1]]
            if direction == "forward":
                zero, map_, step, whole, recurrence = (measured[p] for p in FORWARD)
                paths = [critical_path_ms(ranks, zero, whole, step, message_ms, summary=map_),
                         # the prepare's outputs kept from step 1: the map and step 3 are recurrences alone
                         critical_path_ms(ranks, zero, whole, step, message_ms, summary=recurrence, last=recurrence)]
            else:
                alone, step, whole = (measured[p] for p in BACKWARD)
                paths = [critical_path_ms(ranks, alone, whole, step, message_ms)]
            table.append((str(ranks), f"{meta['tokens'] // ranks}", *(f"{measured[p]:.3f}" for p in pieces),
                          *(f"{path:.2f} ({one_device / path:.2f}x)" for path in paths), f"{one_device:.2f}",
                          "-" if message is None else f"{(ranks - 1) * message / paths[0]:.2%}"))
        paths_header = (["R ranks (speed-up)", "R ranks, prepare kept (speed-up)"] if direction == "forward"
                        else ["R ranks (speed-up)"])
        one_device_piece = "forward_from_state" if direction == "forward" else pieces[-1]
        text += (f"\n**{direction.capitalize()}**, the committed `{shown_command(meta['command'])}` ({meta['device']}, "
                 f"H = {meta['H']}, d = {meta['D']}, {meta['dtype']}): medians over rounds, ms; the critical paths "
                 "and one device computed from them (critical_path_ms).\n\n"
                 + markdown_table(["R", "tokens a rank", *pieces, *paths_header,
                                   f"one device (R x {one_device_piece})", "messages' share"], table))
        for ranks, error in sorted(untimed.items()):
            text += f"\nR = {ranks} ({meta['tokens'] // ranks} tokens a rank) was not timed on this GPU: {error}.\n"
        if direction == "forward" and isinstance(meta.get("one_device_forward_ms"), dict):
            text += (f"\nOne device's forward over all {meta['tokens']} tokens in one call: "
                     f"{meta['one_device_forward_ms']['median']:.2f} ms.\n")
    if message is None:
        text += ("\nThe messages' time is left out: it is the multi-GPU run's (`python -m benchmarks.context_parallel_gpus"
                 " --out DIR --ranks R`), and none is committed.\n")
    path.write_text(text)


def generated_files():
    return {
        "docs/generated/s08_split.md": write_split_table,
        "docs/generated/s08_errors.md": write_error_table,
        "docs/generated/s08_identities.md": write_identities_table,
        "docs/generated/s08_communication.md": write_communication_table,
        "docs/generated/s08_rank_times.md": write_rank_times,
    }
