"""One rank of stage 8's distributed tests, started by tests/stages/test_s08_distributed.py:

    python -m tests.stages.s08_ranks --rank R --world-size N --store FILE --out DIR

Joins a gloo group through a file store (no port to find free; every collective times out after
TIMEOUT_S, so a rank that waits for a message that never comes fails instead of hanging), then runs
every case of CASES on its part of the batch, float64 on the CPU: chunk_kda_cp forward, the loss
<do, o> + <d_final_state, final states> backward, twice, and writes DIR/<case>_rank<R>.npz with its
outputs, its gradients, the second call's, and whether its inputs came back unchanged.
"""

import argparse
import datetime
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from stages.s08_context_parallel.distributed import build_cp_context, chunk_kda_cp
from tests.stages.s08_cases import AT_STARTS, PACKED, make_case

TIMEOUT_S = 30
# name: (lengths, with initial states, combine)
CASES = {
    "one_sequence_uneven": ((101,), False, "pass"),
    "packed": (PACKED, True, "pass"),
    "packed_gathered": (PACKED, True, "gather"),
    "boundaries_at_starts": (AT_STARTS, True, "pass"),
}
OUTPUTS = ("o", "final_states", "dq", "dk", "dv", "dg", "dbeta", "d_initial_state")


def run_case(lengths, with_initial_state, combine, seed):
    """{name: array} of one call and its backward on this rank's part; the second call's under "again_"."""
    case = make_case(lengths, seed, initial_state=with_initial_state)
    context = build_cp_context(torch.tensor(case.cu_seqlens), combine=combine)
    tokens = context.part.tokens
    inputs = [torch.tensor(x[:, tokens]) for x in case.inputs]
    initial_state = None if case.initial_state is None else torch.tensor(case.initial_state)
    before = [x.clone() for x in inputs] + ([] if initial_state is None else [initial_state.clone()])
    results = {}
    for prefix in ("", "again_"):
        leaves = [x.clone().requires_grad_() for x in inputs]
        state = None if initial_state is None else initial_state.clone().requires_grad_()
        o, final_states = chunk_kda_cp(*leaves, context, initial_state=state, output_final_state=True)
        loss = (torch.tensor(case.do[:, tokens]) * o).sum() + (torch.tensor(case.d_final_state) * final_states).sum()
        loss.backward()
        gradients = [x.grad for x in leaves] + [torch.zeros(0) if state is None else state.grad]
        for name, value in zip(OUTPUTS, [o, final_states, *gradients]):
            results[prefix + name] = value.detach().numpy()
    after = inputs + ([] if initial_state is None else [initial_state])
    results["inputs_unchanged"] = np.array(all(torch.equal(a, b) for a, b in zip(before, after)))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tests.stages.s08_ranks")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--store", type=Path, required=True, help="a file the ranks rendezvous through")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo", init_method=f"file://{args.store}", rank=args.rank, world_size=args.world_size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        for seed, (name, (lengths, with_initial_state, combine)) in enumerate(CASES.items()):
            np.savez(args.out / f"{name}_rank{args.rank}.npz", **run_case(lengths, with_initial_state, combine, seed))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
