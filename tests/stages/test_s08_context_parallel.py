"""Stage 8's references and identities: a packed batch split over ranks equals one device's pass.

References A and B (forward) and B's backward against each sequence run alone through stage 6's
reference A, for every split from 1 to 7 ranks; the pieces of B each against their definition (the
map as a product of the tokens' factors, the correction as the difference of two passes, the scan as
the pass, the pass backwards as torch's autograd of the pass); the identities proved and the mistakes
refuted where they do not hide. The processes of torch.distributed: tests/stages/test_s08_distributed.py.
"""

import inspect

import numpy as np
import pytest
import torch

from stages.common.compare import assert_close
from tests.stages.identity_checks import identity_tests
from stages.s05_fast_kda.reference import prepare, recurrence
from stages.s08_context_parallel import identities
from stages.s08_context_parallel.reference import (RankPart, chunkwise, chunkwise_backward, pass_state_gradients,
                                                   pass_states, rank_boundaries, recurrent, scan_states,
                                                   split_over_ranks, state_correction, transition_map)
from tests.stages.s08_cases import AT_STARTS, CHUNK_SIZE, D_K, D_V, H, PACKED, make_case, one_device

STATE_AXES = ("sequence", "head", "key channel", "value channel")
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state")


# ------------------------------------------------------------------------------------------ the split


def test_split_of_a_packed_batch():
    """PACKED over 4 ranks, worked out by hand: boundaries 0, 24, 48, 72, 97."""
    cu_seqlens = np.concatenate([[0], np.cumsum(PACKED)])  # 0, 13, 53, 58, 58, 97
    parts = split_over_ranks(cu_seqlens, 4)
    expected = [(slice(0, 24), [0, 13, 24], range(0, 2), False, True),  # sequence 1 goes on
                (slice(24, 48), [0, 24], range(1, 2), True, True),  # inside sequence 1
                (slice(48, 72), [0, 5, 10, 10, 24], range(1, 5), True, True),  # 1 ends, 2, empty 3, 4 begins
                (slice(72, 97), [0, 25], range(4, 5), True, False)]
    for part, (tokens, offsets, sequences, receives, sends) in zip(parts, expected, strict=True):
        assert part == RankPart(tokens, part.cu_seqlens, sequences, receives, sends), part
        assert part.cu_seqlens.tolist() == offsets


@pytest.mark.parametrize("lengths, ranks, receives, sends", [
    (AT_STARTS, 2, [False, False], [False, False]),  # the boundary at 30 starts sequence 2
    (AT_STARTS, 4, [False, False, False, True], [False, False, True, False]),  # 45 lies inside sequence 2
    ((5, 0, 5), 2, [False, False], [False, False]),  # an empty sequence on the boundary: rank 1's
    ((10, 0), 2, [False, True], [True, False])])  # an empty sequence at the end: the last rank's
def test_boundaries_at_sequence_starts_pass_nothing(lengths, ranks, receives, sends):
    parts = split_over_ranks(np.concatenate([[0], np.cumsum(lengths)]), ranks)
    assert [p.receives for p in parts] == receives and [p.sends for p in parts] == sends
    owners = [seq for part in parts for seq in part.sequences if not (seq == part.sequences[0] and part.receives)]
    assert owners == list(range(len(lengths))), "every sequence begins on exactly one rank"


def test_parts_cover_the_batch_once():
    """Over 1 to 9 ranks: the parts tile the tokens, their offsets cover their tokens, and a rank
    receives exactly when the rank before it sends."""
    cu_seqlens = np.concatenate([[0], np.cumsum(PACKED)])
    for ranks in range(1, 10):
        parts = split_over_ranks(cu_seqlens, ranks)
        assert [p.tokens.start for p in parts] + [parts[-1].tokens.stop] == rank_boundaries(97, ranks).tolist()
        assert all(p.cu_seqlens[0] == 0 and p.cu_seqlens[-1] == p.tokens.stop - p.tokens.start for p in parts)
        assert [p.sends for p in parts[:-1]] == [p.receives for p in parts[1:]]
        assert not parts[0].receives and not parts[-1].sends


def test_bad_splits_are_refused():
    with pytest.raises(ValueError, match="cannot be split over 5 ranks"):
        split_over_ranks(np.array([0, 4]), 5)
    with pytest.raises(ValueError, match="ranks must be a positive integer"):
        split_over_ranks(np.array([0, 4]), 0)
    with pytest.raises(ValueError, match="start at 0, never decrease"):
        split_over_ranks(np.array([0, 6, 4]), 2)
    with pytest.raises(TypeError, match="cu_seqlens must be a numpy.ndarray"):
        split_over_ranks([0, 4], 2)


# ------------------------------------------------------------------------------------------ the pieces


def _tensors(case, rows):
    return prepare(*(x[:, rows] for x in case.inputs), CHUNK_SIZE, sub_block=1)


def _token_product(case, rows):
    """F_t ... F_1 over the rows, per head, straight from the definition."""
    A = np.tile(np.eye(D_K), (H, 1, 1))
    for t in range(rows.start, rows.stop):
        for h in range(H):
            k = case.k[0, t, h]
            A[h] = (np.eye(D_K) - case.beta[0, t, h] * np.outer(k, k)) @ np.diag(np.exp(case.g[0, t, h])) @ A[h]
    return A


@pytest.mark.parametrize("rows", [slice(0, 5), slice(0, 16), slice(3, 40)], ids=["short", "one chunk", "three chunks"])
def test_transition_map_is_the_product_of_the_tokens_factors(rows):
    """Strong gates included (a whole chunk at -50 in one channel: that row of A is zero)."""
    case = make_case(PACKED, seed=3)
    assert_close(transition_map(_tensors(case, rows)), _token_product(case, rows), rel_l2=1e-12,
                 name="the map", axes=("head", "d_k", "d_k"))


def test_correction_is_what_the_incoming_state_adds():
    """Over 40 tokens (three chunks, the last short): the pass from S_in equals the pass from zero plus
    the correction, and the correction's final state is A S_in."""
    case = make_case(PACKED, seed=4)
    rows = slice(3, 43)
    S_in = np.random.default_rng(4).standard_normal((1, H, D_K, D_V))
    tensors = _tensors(case, rows)
    o_from_state, final_from_state = recurrence(tensors, D_V, initial_state=S_in)
    o_from_zero, final_from_zero = recurrence(tensors, D_V)
    o_correction, carried = state_correction(tensors, S_in)
    assert_close(o_from_zero + o_correction, o_from_state, rel_l2=1e-12)
    assert_close(carried[0], _token_product(case, rows) @ S_in[0], rel_l2=1e-12, name="the carried state",
                 axes=STATE_AXES[1:])
    assert_close(final_from_zero + carried, final_from_state, rel_l2=1e-12, name="the final state", axes=STATE_AXES)


def _random_maps(ranks, seed):
    rng = np.random.default_rng(seed)
    return (list(0.5 * rng.standard_normal((ranks, H, D_K, D_K))), list(rng.standard_normal((ranks, H, D_K, D_V))),
            rng.standard_normal((H, D_K, D_V)))


@pytest.mark.parametrize("ranks", [1, 2, 3, 5, 8, 9])
def test_scan_equals_the_pass(ranks):
    transitions, zero_states, S0 = _random_maps(ranks, ranks)
    incoming, final = pass_states(transitions, zero_states, S0)
    scanned, scanned_final = scan_states(transitions, zero_states, S0)
    assert_close(np.stack(scanned), np.stack(incoming), rel_l2=1e-12, name="the incoming states", axes=("rank",) + STATE_AXES[1:])
    assert_close(scanned_final, final, rel_l2=1e-12, name="the final state", axes=STATE_AXES[1:])


def test_pass_backwards_is_the_gradient_of_the_pass():
    """pass_states on torch tensors (as the distributed implementation runs it) differentiated by
    autograd, for L = sum_r <G_r, S_r> + <G, S_after>: dL/dS_0 is the pass backwards' last answer, and
    dL/dZ_r (Z_r adds to the state rank r hands on) its gradient of that state."""
    ranks = 4
    transitions, zero_states, S0 = _random_maps(ranks, 11)
    rng = np.random.default_rng(12)
    G, G_final = list(rng.standard_normal((ranks, H, D_K, D_V))), rng.standard_normal((H, D_K, D_V))
    leaves = [torch.tensor(x, requires_grad=True) for x in (S0, *zero_states)]
    incoming, final = pass_states([torch.tensor(A) for A in transitions], leaves[1:], leaves[0])
    loss = sum((torch.tensor(g) * s).sum() for g, s in zip(G, incoming)) + (torch.tensor(G_final) * final).sum()
    loss.backward()
    outgoing, d_initial = pass_state_gradients(transitions, G, G_final)
    assert_close(d_initial, leaves[0].grad.numpy(), rel_l2=1e-12, name="dL/dS_0", axes=STATE_AXES[1:])
    assert_close(np.stack(outgoing), np.stack([z.grad.numpy() for z in leaves[1:]]), rel_l2=1e-12,
                 name="the gradients of the states handed on", axes=("rank",) + STATE_AXES[1:])


# ------------------------------------------------------------------------------------------ the references


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("lengths", [PACKED, AT_STARTS, (61,)], ids=["packed", "at starts", "one sequence"])
def test_references_equal_one_device(lengths, ranks):
    case = make_case(lengths, seed=ranks)
    expected_o, expected_states = one_device(case)[:2]
    for name, reference in (("A", lambda *a: recurrent(*a)), ("B", lambda *a: chunkwise(*a[:-2], CHUNK_SIZE, *a[-2:]))):
        o, states = reference(*case.inputs, case.cu_seqlens, ranks, case.initial_state, True)
        assert_close(o, expected_o, rel_l2=1e-12, name=f"reference {name}'s o")
        assert_close(states, expected_states, rel_l2=1e-12, name=f"reference {name}'s final states", axes=STATE_AXES)


@pytest.mark.parametrize("ranks", [1, 2, 4, 7])
@pytest.mark.parametrize("lengths", [PACKED, AT_STARTS], ids=["packed", "at starts"])
def test_backward_equals_one_device(lengths, ranks):
    case = make_case(lengths, seed=10 + ranks)
    expected = one_device(case)
    result = chunkwise_backward(*case.inputs, case.do, case.cu_seqlens, ranks, CHUNK_SIZE, case.initial_state,
                                case.d_final_state)
    for name, actual, wanted in zip(GRADIENTS, result[:6], expected[2:]):
        assert_close(actual, wanted, rel_l2=1e-12, name=name, axes=STATE_AXES if name == "d_initial_state" else None)


def test_references_leave_their_inputs_and_agree_twice():
    case = make_case(PACKED, seed=5)
    arrays = [*case.inputs, case.do, case.initial_state, case.d_final_state]
    before = [a.copy() for a in arrays]
    first = chunkwise_backward(*case.inputs, case.do, case.cu_seqlens, 4, CHUNK_SIZE, case.initial_state,
                               case.d_final_state)
    second = chunkwise_backward(*case.inputs, case.do, case.cu_seqlens, 4, CHUNK_SIZE, case.initial_state,
                                case.d_final_state)
    recurrent(*case.inputs, case.cu_seqlens, 4, case.initial_state)
    for name, original, after in zip(("q", "k", "v", "g", "beta", "do", "initial_state", "d_final_state"), before, arrays):
        assert np.array_equal(original, after), f"{name} changed during the call"
    for name, a, b in zip(GRADIENTS + ("o", "final_state"), first, second):
        assert np.array_equal(a, b), f"a second call gave another {name}"


def test_reference_inputs_are_checked():
    case = make_case(PACKED, seed=6)
    with pytest.raises(ValueError, match="initial_state must have shape"):
        chunkwise(*case.inputs, case.cu_seqlens, 2, CHUNK_SIZE, case.initial_state[:2])
    with pytest.raises(ValueError, match="end at N = 97"):
        recurrent(*case.inputs, case.cu_seqlens[:-1], 2)
    with pytest.raises(ValueError, match="do must have shape"):
        chunkwise_backward(*case.inputs, case.do[:, :5], case.cu_seqlens, 2, CHUNK_SIZE)


# ------------------------------------------------------------------------------------------ the identities


test_identity_holds, test_identity_is_not_vacuous, test_refuted_form_differs = identity_tests(identities)


@pytest.mark.parametrize("build", identities.REFUTED, ids=lambda build: build.__name__)
def test_refuted_form_hides_where_its_docstring_says(build):
    """A = I, a symmetric map, tokens that leave the state, commuting maps: on those inputs the mistake
    gives the right answer, so the tests need inputs away from them."""
    assert inspect.signature(build).parameters, "every mistake of this stage hides somewhere"
    assert build(True).holds()
