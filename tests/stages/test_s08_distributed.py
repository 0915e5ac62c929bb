"""Stage 8's torch.distributed implementation over 2 and 4 gloo processes on the CPU, against one device.

Each world size starts its ranks once (tests/stages/s08_ranks.py, one process each, rendezvous through
a file), and every case of s08_ranks.CASES runs there: one sequence whose length does not split evenly,
a packed batch whose sequences cross one or several boundaries (an empty one among them) from initial
states, the same with the states all-gathered instead of passed, and boundaries that fall on sequence
starts. The tests read what the ranks wrote: their outputs laid side by side, their final states and
initial-state gradients summed, against each sequence alone through stage 6's reference A, float64, to
1e-12. A rank that waits for a message that never comes fails after s08_ranks.TIMEOUT_S; the whole run
is killed after LAUNCH_TIMEOUT_S. The arguments' checks, which raise before any message, run here.
"""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from kdacourse import REPO_ROOT
from stages.common.compare import assert_close
from stages.s08_context_parallel.distributed import CPContext, build_cp_context, chunk_kda_cp
from stages.s08_context_parallel.reference import split_over_ranks
from tests.stages.s08_cases import PACKED, make_case, one_device
from tests.stages.s08_ranks import CASES, OUTPUTS

WORLD_SIZES = (2, 4)
LAUNCH_TIMEOUT_S = 120
STATE_AXES = ("sequence", "head", "key channel", "value channel")
SUMMED = ("final_states", "d_initial_state")  # each rank writes the rows of its sequences, zeros elsewhere


@pytest.fixture(scope="module")
def ranks_output(tmp_path_factory):
    """{world size: {case: [the npz each rank wrote]}}: each world size's ranks started once."""
    return {world_size: _launch(world_size, tmp_path_factory.mktemp(f"ranks{world_size}")) for world_size in WORLD_SIZES}


def _launch(world_size, folder):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, "-m", "tests.stages.s08_ranks", "--world-size", str(world_size), "--store",
               str(folder / "store"), "--out", str(folder)]
    ranks = [subprocess.Popen(command + ["--rank", str(rank)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True) for rank in range(world_size)]
    failures = []
    try:
        for rank, process in enumerate(ranks):
            output, _ = process.communicate(timeout=LAUNCH_TIMEOUT_S)
            if process.returncode:
                failures.append(f"rank {rank} of {world_size} exited with {process.returncode}:\n{output[-3000:]}")
    except subprocess.TimeoutExpired:
        failures.append(f"the {world_size} ranks did not finish in {LAUNCH_TIMEOUT_S} s")
    finally:
        for process in ranks:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # the rank's own session: it and what it started
                process.wait()
    if failures:
        pytest.fail("\n".join(failures), pytrace=False)
    return {name: [np.load(folder / f"{name}_rank{rank}.npz") for rank in range(world_size)] for name in CASES}


def _together(name, per_rank):
    """One device's shape: token arrays laid side by side, state arrays summed over the ranks."""
    arrays = [rank[name] for rank in per_rank]
    return sum(arrays) if name in SUMMED else np.concatenate(arrays, axis=1)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", CASES)
def test_ranks_together_equal_one_device(ranks_output, world_size, name):
    lengths, with_initial_state, _ = CASES[name]
    seed = list(CASES).index(name)
    expected = dict(zip(OUTPUTS, one_device(make_case(lengths, seed, initial_state=with_initial_state))))
    per_rank = ranks_output[world_size][name]
    for output in OUTPUTS:
        if output == "d_initial_state" and not with_initial_state:
            continue
        assert_close(_together(output, per_rank), expected[output], rel_l2=1e-12, name=f"{output} over {world_size} ranks",
                     axes=STATE_AXES if output in SUMMED else None)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_states_are_written_where_their_sequences_end_and_begin(ranks_output, world_size):
    """A rank's final-state rows are zero but for the sequences that end on it, its initial-state
    gradient rows zero but for those that begin on it."""
    lengths = CASES["packed"][0]
    parts = split_over_ranks(np.concatenate([[0], np.cumsum(lengths)]), world_size)
    for part, output in zip(parts, ranks_output[world_size]["packed"]):
        ending = set(part.sequences[:-1] if part.sends else part.sequences)
        beginning = set(part.sequences[1:] if part.receives else part.sequences)
        for name, own in (("final_states", ending), ("d_initial_state", beginning)):
            others = [seq for seq in range(len(lengths)) if seq not in own]
            assert not np.any(output[name][others]), f"{name}: a row of another rank's sequence is not zero"


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_inputs_unchanged_and_a_second_call_equal(ranks_output, world_size):
    for name, per_rank in ranks_output[world_size].items():
        for rank, output in enumerate(per_rank):
            assert output["inputs_unchanged"], f"{name}: rank {rank}'s inputs changed during the call"
            for result in OUTPUTS:
                assert np.array_equal(output[result], output["again_" + result]), \
                    f"{name}: rank {rank}'s second call gave another {result}"


# ------------------------------------------------------------------------------------------ the arguments


def _context(rank=1, world_size=2, lengths=PACKED):
    """The context rank `rank` would build, made without a process group (the checks run before any message)."""
    part = split_over_ranks(np.concatenate([[0], np.cumsum(lengths)]), world_size)[rank]
    return CPContext(None, rank, world_size, part, len(lengths))


def _inputs(part, H=2, d_k=8, d_v=6):
    n = part.tokens.stop - part.tokens.start
    return [torch.zeros(1, n, H, d) for d in (d_k, d_k, d_v, d_k)] + [torch.zeros(1, n, H)]


def test_arguments_are_checked_before_any_message():
    context = _context()
    q, k, v, g, beta = _inputs(context.part)
    with pytest.raises(TypeError, match="cp_context must be a CPContext"):
        chunk_kda_cp(q, k, v, g, beta, cp_context=None)
    with pytest.raises(ValueError, match="rank 1 holds tokens 48 to 96"):
        chunk_kda_cp(q[:, 1:], k[:, 1:], v[:, 1:], g[:, 1:], beta[:, 1:], context)
    with pytest.raises(ValueError, match="one packed row"):
        chunk_kda_cp(q.expand(2, -1, -1, -1), k, v, g, beta, context)
    with pytest.raises(ValueError, match="must share"):
        chunk_kda_cp(q, k, v, g, beta[:, :, :1], context)
    with pytest.raises(ValueError, match=r"initial_state must be \(N_seq, H, d_k, d_v\) = \(5, 2, 8, 6\)"):
        chunk_kda_cp(q, k, v, g, beta, context, initial_state=torch.zeros(4, 2, 8, 6))
    with pytest.raises(TypeError, match="beta must be a torch.Tensor"):
        chunk_kda_cp(q, k, v, g, beta.numpy(), context)


def test_context_needs_a_process_group_and_a_known_combine():
    with pytest.raises(ValueError, match="combine must be one of"):
        build_cp_context(torch.tensor([0, 4]), combine="scan")
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            build_cp_context(torch.tensor([0, 4]))
