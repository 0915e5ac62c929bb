"""Stage 7 library tests: variable-length batches with states in and out, chunked prefill, the decode step.

The varlen references A, B and C against each sequence run alone (stage 4's reference A from zero,
stage 6's reference A from a state), lengths that are and are not multiples of the chunk, empty
sequences, one chunk and many; the chunk table against its definition; chunked prefill in pieces of
any sizes against one pass. The decode reference, run token by token, against stage 4's reference A (from a zero state) and against
the references that take an initial state (stage 6's reference A, stage 5's recurrence); the kernel
through the tile interpreter against the reference, in float64 (tight) and fp16 / bf16 (a few units
of the dtype's roundoff); pool slots not in `slots` untouched; bad inputs refused; the kernel
compiled for sm_90a (`compile`) and run on a GPU (`gpu`).
"""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.s04_kda.reference import recurrent
from stages.s07_serving.reference import decode_step

POOL_AXES = ("slot", "head", "d_k", "d_v")
STEP_AXES = ("batch", "head", "channel")
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
FP32_FLOOR = 8 * 2.0**-24  # a program that computes in fp32 against float64
TF32_FLOOR = 2.0**-13  # stage 5's prepare: its block-inverse merges run as TF32 GEMMs


def _sequences(B, N, H, d_k, d_v, seed, gate_range=(0.3, 1.0)):
    """Strong gates (a down to 0.3, and up to 1: no decay), beta in [0, 1] with entries exactly 0 and 1."""
    x = make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=gate_range, beta_range=(0.0, 1.0), seed=seed)
    x.beta[:, 1::5] = 0.0
    x.beta[:, 3::5] = 1.0
    return x


def _slots(B, P, seed):
    """B distinct slots of a pool of P, in no particular order (never simply 0, 1, ..., B - 1)."""
    slots = np.random.default_rng(seed).permutation(P)[:B]
    return slots if not np.array_equal(slots, np.arange(B)) else slots[::-1].copy()


def _token(x, t):
    """Token t of every sequence: q, k (B, H, d_k), v (B, H, d_v), g (B, H, d_k), beta (B, H)."""
    return tuple(np.ascontiguousarray(a[:, t]) for a in (x.q, x.k, x.v, x.g, x.beta))


def _decode_all(x, pool, slots):
    """decode_step on every token in order: o (B, N, H, d_v); the pool ends with the final states."""
    return np.stack([decode_step(*_token(x, t), pool, slots) for t in range(x.q.shape[1])], axis=1)


def _final_state_of_reference_a(x):
    """S_N^T (B, H, d_k, d_v) read through reference A's outputs alone: d_k probe tokens appended,
    each with g = 0, beta = 0 (the state stays S_N) and q = e_j, so that o = S_N e_j, row j of S_N^T."""
    B, N, H, d_k = x.q.shape
    d_v = x.v.shape[3]
    probe_q = np.broadcast_to(np.eye(d_k)[None, :, None, :], (B, d_k, H, d_k))
    zeros_k, zeros_v = np.zeros((B, d_k, H, d_k)), np.zeros((B, d_k, H, d_v))
    o = recurrent(np.concatenate([x.q, probe_q], axis=1), np.concatenate([x.k, zeros_k], axis=1),
                  np.concatenate([x.v, zeros_v], axis=1), np.concatenate([x.g, zeros_k], axis=1),
                  np.concatenate([x.beta, np.zeros((B, d_k, H))], axis=1))
    return o[:, :N], o[:, N:].transpose(0, 2, 1, 3)  # (B, d_k, H, d_v) -> (B, H, d_k, d_v)


# ------------------------------------------------------------------------------------------ reference


@pytest.mark.parametrize("B, N, H, d_k, d_v, P", [(3, 12, 2, 6, 4, 7), (1, 9, 3, 4, 8, 1), (2, 20, 1, 8, 8, 2)])
def test_decode_steps_from_zero_equal_reference_a(B, N, H, d_k, d_v, P):
    """Token by token from a zero pool: reference A's outputs and final states (rel L2 <= 1e-12)."""
    x = _sequences(B, N, H, d_k, d_v, seed=N + P)
    expected_o, expected_state = _final_state_of_reference_a(x)
    pool, slots = np.zeros((P, H, d_k, d_v)), _slots(B, P, seed=N)
    assert_close(_decode_all(x, pool, slots), expected_o, rel_l2=1e-12)
    assert_close(pool[slots], expected_state, rel_l2=1e-12, name="the final states", axes=("batch", "head", "d_k", "d_v"))


def test_decode_steps_from_a_state_equal_the_references_with_initial_state():
    """From a nonzero state: stage 6's reference A and stage 5's recurrence, both given initial_state."""
    from stages.s05_fast_kda.reference import prepare, recurrence
    from stages.s06_backward.reference import recurrent_backward

    B, N, H, d_k, d_v, P = 2, 13, 2, 8, 4, 5
    x = _sequences(B, N, H, d_k, d_v, seed=11)
    initial_state = np.random.default_rng(12).standard_normal((B, H, d_k, d_v))
    pool, slots = np.random.default_rng(13).standard_normal((P, H, d_k, d_v)), _slots(B, P, seed=14)
    pool[slots] = initial_state
    o = _decode_all(x, pool, slots)
    a = recurrent_backward(x.q, x.k, x.v, x.g, x.beta, np.zeros((B, N, H, d_v)), initial_state)
    assert_close(o, a.o, rel_l2=1e-12)
    assert_close(pool[slots], a.final_state, rel_l2=1e-12, name="the final states", axes=("batch", "head", "d_k", "d_v"))
    chunk_o, chunk_state = recurrence(prepare(x.q, x.k, x.v, x.g, x.beta, 4, sub_block=2), 2, initial_state)
    assert_close(o, chunk_o[:, :N], rel_l2=1e-12, name="o against stage 5's recurrence")
    assert_close(pool[slots], chunk_state, rel_l2=1e-12, name="the final states against stage 5's recurrence",
                 axes=("batch", "head", "d_k", "d_v"))


def test_decode_step_writes_only_its_slots_and_leaves_inputs():
    B, H, d_k, d_v, P = 3, 2, 4, 5, 8
    x = _sequences(B, 1, H, d_k, d_v, seed=3)
    token = _token(x, 0)
    before = [a.copy() for a in token]
    pool, slots = np.random.default_rng(4).standard_normal((P, H, d_k, d_v)), np.array([6, 0, 3])
    original = pool.copy()
    decode_step(*token, pool, slots)
    others = np.setdiff1d(np.arange(P), slots)
    assert np.array_equal(pool[others], original[others]), "a slot not in `slots` changed"
    assert not np.any(pool[slots] == original[slots]), "a slot in `slots` kept its state"
    for given, kept in zip(token, before):
        assert np.array_equal(given, kept), "decode_step changed an input"


BAD_INPUTS = [
    (dict(slots=np.array([0, 0])), ValueError, "slots must be distinct"),
    (dict(slots=np.array([0, 4])), ValueError, r"slots must lie in \[0, P\) = \[0, 4\)"),
    (dict(slots=np.array([-1, 2])), ValueError, r"slots must lie in \[0, P\)"),
    (dict(slots=np.array([0, 1, 2])), ValueError, r"slots must have shape \(B,\) = \(2,\)"),
    (dict(slots=np.array([0.0, 1.0])), TypeError, "slots must have an integer dtype"),
    (dict(slots=[0, 1]), TypeError, "slots must be a numpy.ndarray"),
    (dict(state_pool=np.zeros((4, 2, 3, 5))), ValueError, "state_pool must be"),
    (dict(state_pool=np.zeros((4, 2, 3, 4), np.float32)), TypeError, "state_pool must have dtype float64"),
    (dict(g=np.full((2, 2, 3), 0.1)), ValueError, "log gates must be <= 0"),
    (dict(beta=np.full((2, 2), 1.5)), ValueError, r"beta must lie in \[0, 1\]"),
    (dict(q=np.zeros((2, 1, 2, 3))), ValueError, "q must have rank 3"),
    (dict(k=np.zeros((2, 2, 4))), ValueError, "k must have q's shape"),
    (dict(v=np.zeros((2, 3, 4))), ValueError, "v must be"),
]


@pytest.mark.parametrize("change, error, message", BAD_INPUTS)
def test_decode_step_refuses_bad_inputs_and_leaves_the_pool(change, error, message):
    x = _sequences(2, 1, 2, 3, 4, seed=5)
    q, k, v, g, beta = _token(x, 0)
    arguments = dict(q=q, k=k, v=v, g=g, beta=beta, state_pool=np.ones((4, 2, 3, 4)), slots=np.array([2, 0]))
    arguments.update(change)
    pool = arguments["state_pool"]
    kept = np.array(pool, copy=True)
    with pytest.raises(error, match=message):
        decode_step(**arguments)
    assert np.array_equal(pool, kept), "a refused call changed the pool"


# ------------------------------------------------------------------------------------------ varlen references

MIXES = [  # (lengths, chunk_size, block_dv, sub_block): the sequences of one packed batch
    ((5, 0, 17, 16, 1, 33), 8, 3, 4),  # empty, one token, a full chunk, short last chunks, many chunks
    ((16,), 16, 6, 4),  # one sequence of one full chunk
    ((9, 40), 16, 2, 8),  # two sequences, neither a multiple of the chunk
]


def _packed(lengths, H=2, d_k=8, d_v=6, seed=0):
    """A packed batch (1, T, ...) of sequences of the given lengths, strong gates, beta 0 and 1; its cu_seqlens."""
    x = _sequences(1, sum(lengths), H, d_k, d_v, seed=seed)
    return x, np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)


def _each_sequence_alone(x, cu_seqlens, initial_state):
    """o and the final states from stage 6's reference A (token by token, paper layout, its own
    initial-state code), one call per sequence: the independent answer."""
    from stages.s06_backward.reference import recurrent_backward

    o, final_states = np.zeros(x.v.shape), initial_state.copy()
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        if end > start:
            rows = slice(start, end)
            alone = recurrent_backward(*(a[:, rows] for a in (x.q, x.k, x.v, x.g, x.beta)),
                                       np.zeros(x.v[:, rows].shape), initial_state[i:i + 1])
            o[:, rows], final_states[i] = alone.o, alone.final_state[0]
    return o, final_states


def _varlen_references(x, chunk_size, block_dv, sub_block):
    """The three references as callables (cu_seqlens, initial_state) -> (o, final states)."""
    from stages.s07_serving.reference import chunkwise, kernel_mirror, recurrent

    args = (x.q, x.k, x.v, x.g, x.beta)
    return {
        "A": lambda cu, S0: recurrent(*args, cu, S0, output_final_state=True),
        "B": lambda cu, S0: chunkwise(*args, chunk_size, cu, S0, output_final_state=True),
        "C": lambda cu, S0: kernel_mirror(*args, chunk_size, block_dv, cu, S0, output_final_state=True,
                                         sub_block=sub_block),
    }


@pytest.mark.parametrize("lengths, chunk_size, block_dv, sub_block", MIXES)
@pytest.mark.parametrize("which", ["A", "B", "C"])
def test_varlen_reference_equals_each_sequence_alone(which, lengths, chunk_size, block_dv, sub_block):
    """From nonzero initial states: the outputs and the final states of each sequence run alone."""
    x, cu_seqlens = _packed(lengths, seed=len(lengths))
    initial_state = np.random.default_rng(1).standard_normal((len(lengths), 2, 8, 6))
    kept = [a.copy() for a in (x.q, x.k, x.v, x.g, x.beta, cu_seqlens, initial_state)]
    expected_o, expected_states = _each_sequence_alone(x, cu_seqlens, initial_state)
    reference = _varlen_references(x, chunk_size, block_dv, sub_block)[which]
    o, final_states = reference(cu_seqlens, initial_state)
    assert_close(o, expected_o, rel_l2=1e-12)
    assert_close(final_states, expected_states, rel_l2=1e-12, name="the final states", axes=POOL_AXES)
    again = reference(cu_seqlens, initial_state)
    assert np.array_equal(again[0], o) and np.array_equal(again[1], final_states), "a second call differs"
    for given, before in zip((x.q, x.k, x.v, x.g, x.beta, cu_seqlens, initial_state), kept):
        assert np.array_equal(given, before), f"reference {which} changed an input"


@pytest.mark.parametrize("which", ["A", "B", "C"])
def test_varlen_reference_from_zero_equals_stage_four(which):
    """No initial state: each sequence's output is stage 4's reference A on it alone, and an empty
    sequence's final state is zero."""
    lengths = (13, 0, 24)
    x, cu_seqlens = _packed(lengths, seed=3)
    o, final_states = _varlen_references(x, 8, 3, 4)[which](cu_seqlens, None)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        rows = slice(start, end)
        if end > start:
            assert_close(o[:, rows], recurrent(*(a[:, rows] for a in (x.q, x.k, x.v, x.g, x.beta))), rel_l2=1e-12)
    assert np.array_equal(final_states[1], np.zeros((2, 8, 6))), "an empty sequence's state moved"


@pytest.mark.parametrize("which", ["A", "B", "C"])
def test_equal_length_batch_is_the_packed_batch(which):
    """Without cu_seqlens each row of (B, N, ...) is one sequence: the same numbers as the rows packed
    into one with cu_seqlens = 0, N, 2N, ..."""
    B, N, H, d_k, d_v = 3, 11, 2, 8, 6
    x = _sequences(B, N, H, d_k, d_v, seed=4)
    S0 = np.random.default_rng(5).standard_normal((B, H, d_k, d_v))
    o, final_states = _varlen_references(x, 8, 3, 4)[which](None, S0)
    packed = type(x)(*(a.reshape(1, B * N, *a.shape[2:]) for a in (x.q, x.k, x.v, x.g, x.beta)))
    expected_o, expected_states = _each_sequence_alone(packed, np.arange(B + 1) * N, S0)
    assert_close(o, expected_o.reshape(B, N, H, d_v), rel_l2=1e-12)
    assert_close(final_states, expected_states, rel_l2=1e-12, name="the final states", axes=POOL_AXES)


def test_output_final_state_false_returns_the_output_alone():
    from stages.s07_serving.reference import chunkwise, kernel_mirror
    from stages.s07_serving.reference import recurrent as recurrent_varlen

    x, cu_seqlens = _packed((4, 7))
    args = (x.q, x.k, x.v, x.g, x.beta)
    for o in (recurrent_varlen(*args, cu_seqlens), chunkwise(*args, 8, cu_seqlens), kernel_mirror(*args, 16, 6, cu_seqlens)):
        assert isinstance(o, np.ndarray) and o.shape == x.v.shape


def test_chunk_table_lists_every_chunk_of_every_sequence_in_order():
    """Against its definition written out: sequence i of n tokens owns chunks 0 .. ceil(n / C) - 1."""
    from stages.s07_serving.reference import chunk_table

    lengths, C = [5, 0, 17, 16, 1, 33], 8
    expected = [(i, c) for i, n in enumerate(lengths) for c in range((n + C - 1) // C)]
    chunks, chunk_offsets = chunk_table(np.concatenate([[0], np.cumsum(lengths)]), C)
    assert [tuple(row) for row in chunks] == expected
    for i in range(len(lengths)):
        owned = chunks[chunk_offsets[i]:chunk_offsets[i + 1]]
        assert [tuple(row) for row in owned] == [row for row in expected if row[0] == i]


@pytest.mark.parametrize("pieces", [(1, 3, 63, 64, 65, 200), (396,), (0, 200, 196)])
def test_prefill_in_pieces_equals_one_pass(pieces):
    """Pieces of any sizes (one token, under, at and over the chunk of 64), each from the state the
    one before left: the output and the final state of one pass over the whole prompt."""
    from stages.s07_serving.reference import chunkwise, prefill_in_pieces

    B, N, H, d_k, d_v = 2, 396, 1, 8, 4
    x = _sequences(B, N, H, d_k, d_v, seed=6, gate_range=(0.5, 1.0))
    S0 = np.random.default_rng(7).standard_normal((B, H, d_k, d_v))
    def forward(q, k, v, g, beta, initial_state):
        return chunkwise(q, k, v, g, beta, 64, initial_state=initial_state, output_final_state=True)

    o, state = prefill_in_pieces(forward, x.q, x.k, x.v, x.g, x.beta, list(pieces), initial_state=S0)
    expected = _each_sequence_alone(type(x)(*(a.reshape(1, B * N, *a.shape[2:]) for a in (x.q, x.k, x.v, x.g, x.beta))),
                                    np.arange(B + 1) * N, S0)
    assert_close(o, expected[0].reshape(B, N, H, d_v), rel_l2=1e-12, chunk_size=64)
    assert_close(state, expected[1], rel_l2=1e-12, name="the state after the last piece", axes=POOL_AXES)


def _bad_varlen_calls():
    from stages.s07_serving.reference import chunkwise, kernel_mirror, prefill_in_pieces
    from stages.s07_serving.reference import recurrent as recurrent_varlen

    x, cu = _packed((4, 7))
    args = (x.q, x.k, x.v, x.g, x.beta)
    return [
        (lambda: recurrent_varlen(*args, [0, 4, 11]), TypeError, "cu_seqlens must be a numpy.ndarray"),
        (lambda: recurrent_varlen(*args, cu.astype(float)), TypeError, "cu_seqlens must have an integer dtype"),
        (lambda: recurrent_varlen(*args, np.array([0, 5, 4, 11])), ValueError, "never decrease"),
        (lambda: chunkwise(*args, 8, np.array([1, 4, 11])), ValueError, "must start at 0"),
        (lambda: kernel_mirror(*args, 8, 6, np.array([0, 4, 12])), ValueError, "end at N = 11"),
        (lambda: recurrent_varlen(*args, np.array([0])), ValueError, r"shape \(N_seq \+ 1,\)"),
        (lambda: recurrent_varlen(*(np.concatenate([a, a]) for a in args), cu), ValueError, "B must be 1"),
        (lambda: recurrent_varlen(*args, cu, np.zeros((3, 2, 8, 6))), ValueError, r"initial_state must have shape \(N_seq"),
        (lambda: chunkwise(*args, 8, cu, np.zeros((2, 2, 6, 8))), ValueError, "initial_state must have shape"),
        (lambda: kernel_mirror(*args, 8, 4, cu), ValueError, "block_dv must be a positive divisor of d_v = 6"),
        (lambda: prefill_in_pieces(recurrent_varlen, *args, [4, 6]), ValueError, "sum to N = 11"),
        (lambda: prefill_in_pieces(recurrent_varlen, *args, []), ValueError, "one or more lengths"),
        (lambda: prefill_in_pieces(recurrent_varlen, *args, [12, -1]), ValueError, ">= 0"),
    ]


@pytest.mark.parametrize("case", range(13))
def test_varlen_references_refuse_bad_inputs(case):
    call, error, message = _bad_varlen_calls()[case]
    with pytest.raises(error, match=message):
        call()


# ------------------------------------------------------------------------------------------ kernel, interpreter

# two blocks of d_v columns, B * H = 6 programs per block, d_k != d_v
B, H, D_K, D_V, BLOCK_DV, P = 3, 2, 16, 32, 16, 7
SLOTS = np.array([5, 0, 3])


def _run_kernel(x, pool, dtype, state_dtype="float32", steps=None):
    """Every token of x through the interpreted kernel, in order, on `pool` (float64 array, updated in
    place); returns o (B, N, H, d_v)."""
    from stages.common.interpreter import interpret
    from stages.s07_serving.kernel import build_decode_program

    kernel = interpret(build_decode_program(B, P, H, D_K, D_V, BLOCK_DV, dtype=dtype, state_dtype=state_dtype))
    outputs = []
    for t in range(steps or x.q.shape[1]):
        o = np.zeros((B, H, D_V))
        kernel(*_token(x, t), SLOTS.astype(np.int32), pool, o)  # writes o and the pool in place
        outputs.append(o)
    return np.stack(outputs, axis=1)


def _kernel_case(seed, N=3):
    """Inputs for N steps and a pool whose entries are already fp32 values (so that rounding the pool
    to the kernel's fp32 changes no entry the kernel does not write)."""
    x = _sequences(B, N, H, D_K, D_V, seed=seed, gate_range=(0.5, 1.0))
    pool = np.random.default_rng(seed).standard_normal((P, H, D_K, D_V)).astype(np.float32).astype(np.float64)
    return x, pool


def _reference_steps(x, pool):
    expected_pool = pool.copy()
    return _decode_all(x, expected_pool, SLOTS), expected_pool


def test_float64_kernel_matches_the_reference():
    """The program with float64 operands and a float64 state: the reference's values to 1e-12."""
    x, pool = _kernel_case(seed=21)
    expected_o, expected_pool = _reference_steps(x, pool)
    o = _run_kernel(x, pool, "float64", state_dtype="float64")
    assert_close(o, expected_o, rel_l2=1e-12, axes=("batch", "token", "head", "channel"))
    assert_close(pool, expected_pool, rel_l2=1e-12, name="the pool", axes=POOL_AXES)


def test_float64_kernel_with_the_fp32_state_rounds_like_fp32():
    """The GPU's state dtype, fp32, with exact operands: fp32's rounding and no more."""
    x, pool = _kernel_case(seed=22)
    expected_o, expected_pool = _reference_steps(x, pool)
    o = _run_kernel(x, pool, "float64")
    assert_close(o, expected_o, rel_l2=FP32_FLOOR, axes=("batch", "token", "head", "channel"))
    assert_close(pool, expected_pool, rel_l2=FP32_FLOOR, name="the pool", axes=POOL_AXES)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_kernel_rounds_like_its_dtype(dtype):
    """q, k, v and o in the dtype, the state in fp32: o within [u/4, 4u] of the reference's (the lower
    end shows that the casts round at all), the pool within 4u."""
    x, pool = _kernel_case(seed=23)
    expected_o, expected_pool = _reference_steps(x, pool)
    u = UNIT_ROUNDOFF[dtype]
    o = _run_kernel(x, pool, dtype)
    assert_close(o, expected_o, rel_l2=4 * u, axes=("batch", "token", "head", "channel"))
    assert error_report(o, expected_o).rel_l2 >= u / 4, f"{dtype} does not round"
    assert_close(pool, expected_pool, rel_l2=4 * u, name="the pool", axes=POOL_AXES)


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_kernel_leaves_other_slots_untouched(dtype):
    x, pool = _kernel_case(seed=24, N=2)
    original = pool.copy()
    _run_kernel(x, pool, dtype)
    others = np.setdiff1d(np.arange(P), SLOTS)
    assert np.array_equal(pool[others], original[others]), "the kernel wrote a slot not in `slots`"
    assert not np.any(pool[SLOTS] == original[SLOTS]), "the kernel left a slot in `slots` as it was"


# ------------------------------------------------------------------------------------------ the wrapper


def _torch_arguments(B=2, H=2, d_k=16, d_v=32, P=4):
    import torch

    q, k = torch.randn(B, H, d_k, dtype=torch.float16), torch.randn(B, H, d_k, dtype=torch.float16)
    v = torch.randn(B, H, d_v, dtype=torch.float16)
    g, beta = -torch.rand(B, H, d_k), torch.rand(B, H)
    return dict(q=q, k=k, v=v, g=g, beta=beta, state_pool=torch.zeros(P, H, d_k, d_v),
                slots=torch.tensor([3, 1], dtype=torch.int32))


def _bad_wrapper_inputs():
    import torch

    return [
        (dict(q=torch.randn(2, 2, 16)), TypeError, "q must have dtype float16 or bfloat16"),
        (dict(k=torch.randn(2, 2, 8, dtype=torch.float16)), ValueError, "k must have the shape of q"),
        (dict(v=torch.randn(2, 2, 32, dtype=torch.bfloat16)), ValueError, "v must have the dtype of q"),
        (dict(v=torch.randn(2, 3, 32, dtype=torch.float16)), ValueError, r"v must be \(B, H, d_v\)"),
        (dict(g=torch.zeros(2, 2, 16, dtype=torch.float16)), TypeError, "g must have dtype float32"),
        (dict(beta=torch.zeros(2, 3)), ValueError, r"beta must have shape \(B, H\)"),
        (dict(state_pool=torch.zeros(4, 2, 16, 32, dtype=torch.float16)), TypeError, "state_pool must have dtype float32"),
        (dict(state_pool=torch.zeros(4, 2, 32, 16)), ValueError, "state_pool must be"),
        (dict(state_pool=torch.zeros(4, 2, 32, 16).transpose(2, 3)), ValueError, "state_pool must be contiguous"),
        (dict(slots=torch.tensor([3, 1])), TypeError, "slots must have dtype int32"),
        (dict(slots=torch.tensor([3, 1, 0], dtype=torch.int32)), ValueError, r"slots must have shape \(B,\)"),
        (dict(slots=torch.tensor([1, 1], dtype=torch.int32)), ValueError, "slots must be distinct"),
        (dict(slots=torch.tensor([0, 4], dtype=torch.int32)), ValueError, r"slots must lie in \[0, P\) = \[0, 4\)"),
        (dict(g=torch.full((2, 2, 16), 0.5)), ValueError, "g must be finite and <= 0"),
        (dict(beta=torch.full((2, 2), 2.0)), ValueError, r"beta must lie in \[0, 1\]"),
        (dict(block_dv=12), ValueError, "block_dv must be a positive divisor of d_v = 32"),
        (dict(), ValueError, "must be on a CUDA device"),  # every check passed: the device is last
    ]


@pytest.mark.parametrize("case", range(17))
def test_wrapper_refuses_bad_inputs_on_any_machine(case):
    """Every check runs before the device check, so each shows on a CPU-only machine."""
    from stages.s07_serving.kernel import decode

    change, error, message = _bad_wrapper_inputs()[case]
    arguments = _torch_arguments()
    arguments.update(change)
    with pytest.raises(error, match=message):
        decode(**arguments)


def test_wrapper_skips_the_value_checks_on_request():
    """check_values=False: repeated slots and a positive gate reach the device check (no host sync)."""
    import torch

    from stages.s07_serving.kernel import decode

    arguments = _torch_arguments()
    arguments.update(slots=torch.tensor([1, 1], dtype=torch.int32), g=torch.full((2, 2, 16), 0.5))
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        decode(**arguments, check_values=False)


# ------------------------------------------------------------------------------------------ prefill, on the CPU


def test_chunk_aligned_rows_start_every_sequence_on_a_chunk():
    """Against the definition written out: sequence i's tokens, in order, from row C * chunk_offsets[i]
    on, where chunk_offsets counts whole chunks per sequence; no row taken twice; the layout as short
    as it can be (every chunk holds a token of one sequence)."""
    from stages.s07_serving.reference import chunk_aligned_rows

    lengths, C = [5, 0, 17, 16, 1, 33], 8
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
    token_rows, chunk_offsets = chunk_aligned_rows(cu_seqlens, C)
    expected, row = [], 0
    for n in lengths:
        expected += list(range(row, row + n))
        row += C * ((n + C - 1) // C)
    assert token_rows.tolist() == expected
    assert chunk_offsets[-1] * C == row
    assert len(set((token_rows // C).tolist())) == chunk_offsets[-1], "a chunk without a token"


# prefill's CPU checks: shapes the interpreter runs in a few seconds (d_k in two 16-wide channel
# passes, C = 32), lengths 0, 1, C - 1, C, C + 1 and several chunks, packed in no order of length; the
# last one short, so that a load or store past a sequence's end runs off the batch (the interpreter
# raises: its programs run in order, and a later sequence would overwrite a store into its rows)
PREFILL_LENGTHS, PREFILL_C, PREFILL_H, PREFILL_D, PREFILL_BLOCK_DV = (32, 0, 1, 31, 70, 33), 32, 2, 32, 16


def _interpreted_kernels(lengths, dtype):
    """(varlen prepare, varlen recurrence) through the tile interpreter, built for the packed batch of
    `lengths`, as varlen_forward calls them (torch tensors, outputs written in place)."""
    from stages.common.interpreter import interpret
    from stages.s07_serving.kernel import build_varlen_prepare_program, build_varlen_recurrence_program
    from stages.s07_serving.reference import chunk_table

    n_chunks = int(chunk_table(np.concatenate([[0], np.cumsum(lengths)]), PREFILL_C)[1][-1])
    sizes = (sum(lengths), n_chunks * PREFILL_C, n_chunks, len(lengths), PREFILL_H, PREFILL_D, PREFILL_D, PREFILL_C)
    return (interpret(build_varlen_prepare_program(*sizes, dtype)),
            interpret(build_varlen_recurrence_program(*sizes, PREFILL_BLOCK_DV, dtype)))


def _prefill_on_the_cpu(x, cu_seqlens, S0, dtype, kernels):
    """stages.s07_serving.kernel.varlen_forward on CPU torch tensors with interpreted kernels: the
    wrapper's index and the kernels' launches as on the GPU. Returns float64 (o, final states)."""
    import torch

    from stages.s07_serving.kernel import varlen_forward, varlen_index

    operand = {"float64": torch.float64, "bfloat16": torch.bfloat16}[dtype]
    state = torch.float64 if dtype == "float64" else torch.float32
    args = [torch.tensor(a, dtype=operand) for a in (x.q, x.k, x.v)] + [torch.tensor(a, dtype=state) for a in (x.g, x.beta)]
    index = varlen_index(cu_seqlens, PREFILL_C)
    o, final_states = varlen_forward(*args, torch.from_numpy(index), int(index[2 * len(S0) + 1]),
                                     torch.tensor(S0, dtype=state), PREFILL_C, kernels)
    return o.double().numpy(), final_states.double().numpy()


def _prefill_case(seed, lengths=PREFILL_LENGTHS, with_state=True):
    x, cu_seqlens = _packed(lengths, H=PREFILL_H, d_k=PREFILL_D, d_v=PREFILL_D, seed=seed)
    S0 = np.random.default_rng(seed).standard_normal((len(lengths), PREFILL_H, PREFILL_D, PREFILL_D))
    return x, cu_seqlens, (0.1 * S0.astype(np.float32).astype(np.float64) if with_state else np.zeros_like(S0))


def _varlen_sizes(cu_seqlens):
    """(T_tokens, T_padded, n_chunks, N_seq, H, d_k, d_v, C) of the CPU checks' packed batch."""
    from stages.s07_serving.reference import chunk_table

    n_chunks = int(chunk_table(cu_seqlens, PREFILL_C)[1][-1])
    return (int(cu_seqlens[-1]), n_chunks * PREFILL_C, n_chunks, len(cu_seqlens) - 1, PREFILL_H, PREFILL_D, PREFILL_D,
            PREFILL_C)


def test_varlen_prepare_program_matches_reference_c():
    """The varlen prepare alone (float64 operands, fp32 on chip) against reference C's prepare_varlen:
    each token's outputs at its chunk-aligned row within the TF32 rounding of stage 5's block-inverse
    merges, the rows past each sequence's end exactly zero (the recurrence reads them as zero tokens),
    the chunk decays by row of the chunk table; the packed inputs read in place, unchanged."""
    from stages.common.interpreter import interpret
    from stages.s07_serving.kernel import build_varlen_prepare_program, varlen_index
    from stages.s07_serving.reference import CHUNK_FIELDS, chunk_aligned_rows, prepare_varlen

    x, cu_seqlens, _ = _prefill_case(seed=50)
    inputs = (x.q, x.k, x.v, x.g, x.beta)
    kept = [a.copy() for a in inputs]
    expected = prepare_varlen(*inputs, cu_seqlens, PREFILL_C, sub_block=16)
    sizes = _varlen_sizes(cu_seqlens)
    index, N_seq = varlen_index(cu_seqlens, PREFILL_C), sizes[3]
    program = build_varlen_prepare_program(*sizes, "float64")
    outputs = interpret(program, out_idx=[7, 8, 9, 10, 11, 12])(
        *inputs, index[2 * N_seq + 2:].reshape(-1, 2), index[:N_seq + 1])
    prepared, chunk_decay = dict(zip(("w", "u", "q_decayed", "k_to_chunk_end", "a_qk"), outputs[:5])), outputs[5]
    token_rows, _ = chunk_aligned_rows(cu_seqlens, PREFILL_C)
    padding_rows = np.setdiff1d(np.arange(sizes[1]), token_rows)
    assert len(padding_rows) == sizes[1] - sizes[0] > 0
    for field in CHUNK_FIELDS:
        assert_close(prepared[field][:, token_rows], getattr(expected, field), rel_l2=TF32_FLOOR, name=field)
        assert np.array_equal(prepared[field][:, padding_rows], np.zeros_like(prepared[field][:, padding_rows])), \
            f"{field}: a row past a sequence's end is not zero"
    assert_close(chunk_decay, expected.chunk_decay, rel_l2=FP32_FLOOR, name="the chunk decays")
    for given, before in zip(inputs, kept):
        assert np.array_equal(given, before), "the prepare changed an input"


def test_varlen_recurrence_program_matches_reference_c():
    """The varlen recurrence alone (float64 operands, its fp32 state) against reference C's
    recurrence_varlen on reference C's prepare_varlen, laid out chunk-aligned: fp32's rounding, a
    program per (d_v block, sequence x head) that reads only its own sequence's chunks, and o stored
    straight to the packed rows (every row written once: o's buffer starts as NaN in the interpreter)."""
    from stages.common.interpreter import interpret
    from stages.s07_serving.kernel import build_varlen_recurrence_program
    from stages.s07_serving.reference import chunk_aligned_rows, prepare_varlen, recurrence_varlen

    x, cu_seqlens, S0 = _prefill_case(seed=51)
    tensors = prepare_varlen(x.q, x.k, x.v, x.g, x.beta, cu_seqlens, PREFILL_C, sub_block=16)
    expected_o, expected_states = recurrence_varlen(tensors, cu_seqlens, PREFILL_BLOCK_DV, S0)
    token_rows, chunk_offsets = chunk_aligned_rows(cu_seqlens, PREFILL_C)
    n_chunks = int(chunk_offsets[-1])
    program_fields = ("w", "u", "q_decayed", "k_to_chunk_end", "a_qk")  # the program's parameter order

    def chunk_aligned(a):
        out = np.zeros((1, n_chunks * PREFILL_C, *a.shape[2:]))
        out[0, token_rows] = a[0]
        return out

    program = build_varlen_recurrence_program(*_varlen_sizes(cu_seqlens), PREFILL_BLOCK_DV, "float64")
    o, final_states = interpret(program, out_idx=[9, 10])(
        *(chunk_aligned(getattr(tensors, field)) for field in program_fields), tensors.chunk_decay, S0,
        chunk_offsets.astype(np.int32), cu_seqlens.astype(np.int32))
    assert_close(o, expected_o, rel_l2=FP32_FLOOR)
    assert_close(final_states, expected_states, rel_l2=FP32_FLOOR, name="the final states", axes=POOL_AXES)
    assert np.array_equal(final_states[1], S0[1].astype(np.float32)), "the empty sequence's state moved"


@pytest.mark.parametrize("lengths, with_state", [(PREFILL_LENGTHS, True), (PREFILL_LENGTHS, False),
                                                 ((64, 0, 32), True)])  # the last: every length whole chunks
def test_prefill_through_the_interpreter_matches_reference_c(lengths, with_state):
    """The whole prefill path (the index, the varlen prepare, the varlen recurrence) in float64 against
    reference C: within the TF32 rounding of stage 5's block-inverse merges; inputs unchanged and a
    second call the same."""
    from stages.s07_serving.reference import kernel_mirror

    x, cu_seqlens, S0 = _prefill_case(seed=52, lengths=lengths, with_state=with_state)
    kept = [a.copy() for a in (x.q, x.k, x.v, x.g, x.beta, S0)]
    expected_o, expected_states = kernel_mirror(x.q, x.k, x.v, x.g, x.beta, PREFILL_C, PREFILL_BLOCK_DV, cu_seqlens,
                                                S0 if with_state else None, output_final_state=True, sub_block=16)
    kernels = _interpreted_kernels(lengths, "float64")
    o, final_states = _prefill_on_the_cpu(x, cu_seqlens, S0, "float64", kernels)
    assert_close(o, expected_o, rel_l2=TF32_FLOOR, chunk_size=PREFILL_C)
    assert_close(final_states, expected_states, rel_l2=TF32_FLOOR, name="the final states", axes=POOL_AXES)
    again = _prefill_on_the_cpu(x, cu_seqlens, S0, "float64", kernels)
    assert np.array_equal(again[0], o) and np.array_equal(again[1], final_states), "a second call differs"
    for given, before in zip((x.q, x.k, x.v, x.g, x.beta, S0), kept):
        assert np.array_equal(given, before), "prefill changed an input"


def test_bf16_prefill_through_the_interpreter_rounds_like_bf16():
    """bf16 q, k, v and o, fp32 gates and states: each sequence's outputs and final states against
    reference A within [u/4, 4u] of bf16 (the lower end: the casts round at all)."""
    from stages.s07_serving.reference import recurrent as recurrent_varlen

    x, cu_seqlens, S0 = _prefill_case(seed=53)
    expected_o, expected_states = recurrent_varlen(x.q, x.k, x.v, x.g, x.beta, cu_seqlens, S0, output_final_state=True)
    o, final_states = _prefill_on_the_cpu(x, cu_seqlens, S0, "bfloat16", _interpreted_kernels(PREFILL_LENGTHS, "bfloat16"))
    u = UNIT_ROUNDOFF["bfloat16"]
    assert_close(o, expected_o, rel_l2=4 * u, chunk_size=PREFILL_C)
    assert error_report(o, expected_o).rel_l2 >= u / 4, "bf16 does not round"
    assert_close(final_states, expected_states, rel_l2=4 * u, name="the final states", axes=POOL_AXES)


def _prefill_arguments():
    import torch

    T, H, d_k, d_v = 10, 2, 32, 32
    q, k = torch.randn(1, T, H, d_k, dtype=torch.bfloat16), torch.randn(1, T, H, d_k, dtype=torch.bfloat16)
    return dict(q=q, k=k, v=torch.randn(1, T, H, d_v, dtype=torch.bfloat16), g=-torch.rand(1, T, H, d_k),
                beta=torch.rand(1, T, H), cu_seqlens=torch.tensor([0, 3, 10], dtype=torch.int32),
                initial_state=torch.zeros(2, H, d_k, d_v))


def _bad_prefill_inputs():
    import torch

    return [
        (dict(cu_seqlens=torch.tensor([0.0, 3.0, 10.0])), TypeError, "cu_seqlens must have dtype int32 or int64"),
        (dict(cu_seqlens=torch.tensor([0, 3, 11], dtype=torch.int32)), ValueError, "end at T = 10"),
        (dict(cu_seqlens=torch.tensor([0, 5, 3, 10])), ValueError, "never decrease"),
        (dict(cu_seqlens=torch.tensor([0])), ValueError, r"shape \(N_seq \+ 1,\)"),
        (dict(initial_state=torch.zeros(3, 2, 32, 32)), ValueError, r"initial_state must have shape \(N_seq"),
        (dict(initial_state=torch.zeros(2, 2, 32, 32, dtype=torch.float64)), TypeError, "initial_state must have dtype"),
        (dict(g=torch.full((1, 10, 2, 32), 0.5)), ValueError, "g must be finite and <= 0"),
        (dict(beta=torch.rand(1, 10, 3)), ValueError, r"beta must have shape \(B, T, H\)"),
        (dict(chunk_size=48), ValueError, "chunk_size must be 32 or 64"),
        (dict(block_dv=12), ValueError, "block_dv"),
        (dict(q=torch.randn(1, 10, 2, 16, dtype=torch.bfloat16), k=torch.randn(1, 10, 2, 16, dtype=torch.bfloat16),
              g=-torch.rand(1, 10, 2, 16), initial_state=torch.zeros(2, 2, 16, 32)), ValueError,
         "d_k must be a multiple of 32"),
        (dict(), ValueError, "must be on a CUDA device"),  # every check passed: the device is last
    ]


@pytest.mark.parametrize("case", range(12))
def test_prefill_refuses_bad_inputs_on_any_machine(case):
    from stages.s07_serving.kernel import prefill

    change, error, message = _bad_prefill_inputs()[case]
    arguments = _prefill_arguments()
    arguments.update(change)
    with pytest.raises(error, match=message):
        prefill(**arguments)


def test_prefill_refuses_cu_seqlens_with_more_than_one_row():
    import torch

    from stages.s07_serving.kernel import prefill

    arguments = _prefill_arguments()
    for name in ("q", "k", "v", "g", "beta"):
        arguments[name] = torch.cat([arguments[name]] * 2)
    with pytest.raises(ValueError, match="B must be 1"):
        prefill(**arguments)


# ------------------------------------------------------------------------------------------ end to end, as a server

# Three sequences of one server: the prompt pieces each prefill step takes from each (one token,
# under, at and over the chunk of 64, and steps where a sequence has nothing to prefill), then
# DECODE_STEPS tokens each, one per step.
PIECES = [(1, 65, 64), (3, 0, 0), (63, 64, 0), (64, 1, 0), (65, 66, 132), (200, 200, 200)]
DECODE_STEPS = 3


def _serve(x, pool, slots, prefill_step, decode_token):
    """A server's life for the sequences of x (B, N, ...): prefill steps, each a packed batch of every
    sequence's next piece from its state in the pool (gathered, then written back), then decode steps
    that advance the pool in place. Returns o (B, N, H, d_v) for every token, prompt and decoded."""
    B, N = x.q.shape[:2]
    o, done = np.zeros(x.v.shape), np.zeros(B, dtype=int)
    for step in PIECES:
        rows = [np.arange(done[b], done[b] + n) for b, n in enumerate(step)]
        cu_seqlens = np.concatenate([[0], np.cumsum(step)])
        packed = [np.concatenate([a[b, r] for b, r in enumerate(rows)])[None] for a in (x.q, x.k, x.v, x.g, x.beta)]
        o_step, pool[slots] = prefill_step(*packed, cu_seqlens, pool[slots])
        for b, r in enumerate(rows):
            o[b, r] = o_step[0, cu_seqlens[b]:cu_seqlens[b + 1]]
        done += step
    for t in range(done[0], N):
        assert np.all(done == t), "every sequence's prompt is prefilled before its decode steps"
        o[:, t] = decode_token(*(np.ascontiguousarray(a[:, t]) for a in (x.q, x.k, x.v, x.g, x.beta)), pool, slots)
        done += 1
    return o


def _served_inputs(seed, gate_range=(0.5, 1.0), H=H, d_k=D_K, d_v=D_V):
    prompts = np.sum(PIECES, axis=0)
    assert np.all(prompts == prompts[0]), "the schedule prefills equal prompts (the test then decodes in lockstep)"
    return _sequences(len(prompts), int(prompts[0]) + DECODE_STEPS, H, d_k, d_v, seed=seed, gate_range=gate_range)


@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-12), ("bfloat16", 4 * UNIT_ROUNDOFF["bfloat16"])])
def test_prefill_in_pieces_then_decode_equals_one_pass(dtype, tolerance):
    """Prefill through reference C (the varlen kernels' design) in pieces of any sizes, each sequence's
    state carried in the pool between steps, then decode steps through the decode kernel (tile
    interpreter; float64, or bf16 q, k, v, o with the fp32 state): the outputs of every token and
    the final states equal one pass of stage 4's reference A over each whole sequence."""
    from stages.common.interpreter import interpret
    from stages.s07_serving.kernel import build_decode_program
    from stages.s07_serving.reference import kernel_mirror

    x = _served_inputs(seed=41)
    pool = np.random.default_rng(42).standard_normal((P, H, D_K, D_V)).astype(np.float32).astype(np.float64)
    others = np.setdiff1d(np.arange(P), SLOTS)
    kept = pool[others].copy()
    pool[SLOTS] = 0.0  # new sequences start from a zero state
    program = build_decode_program(B, P, H, D_K, D_V, BLOCK_DV, dtype=dtype,
                                   state_dtype="float64" if dtype == "float64" else "float32")
    kernel = interpret(program)

    def prefill_step(q, k, v, g, beta, cu_seqlens, states):
        return kernel_mirror(q, k, v, g, beta, 64, BLOCK_DV, cu_seqlens, states, output_final_state=True)

    def decode_token(q, k, v, g, beta, pool, slots):
        o = np.zeros((B, H, D_V))
        kernel(q, k, v, g, beta, slots.astype(np.int32), pool, o)
        return o

    o = _serve(x, pool, SLOTS, prefill_step, decode_token)
    expected_o, expected_state = _final_state_of_reference_a(x)
    assert_close(o, expected_o, rel_l2=tolerance)
    prompt = x.q.shape[1] - DECODE_STEPS
    assert_close(o[:, :prompt], expected_o[:, :prompt], rel_l2=1e-12, name="the prefilled tokens' output")
    assert_close(pool[SLOTS], expected_state, rel_l2=tolerance, name="the final states", axes=POOL_AXES)
    assert np.array_equal(pool[others], kept), "a slot of another sequence changed"


# ------------------------------------------------------------------------------------------ compile, GPU


@pytest.mark.compile
def test_kernel_compiles_for_sm90a_without_spills():
    """At the benchmark's shape (B=64, H=32, d=128, a pool of 256 slots, bf16)."""
    from stages.s07_serving.kernel import compile_report

    report = compile_report()
    print("decode sm_90a:", report.summary())
    assert report.spill_stores == 0 and report.spill_loads == 0, report.summary()
    assert not report.divergent_barriers, report.divergent_barriers  # a barrier some warps skip hangs the GPU
    assert not report.misplaced_warp_group_operands, report.misplaced_warp_group_operands  # wrong columns read
    assert report.registers <= 128, report.summary()  # 4 blocks of 128 threads per SM at least
    assert report.shared_memory <= 8 * 1024, report.summary()  # q, k, e^g, v and the reductions' scratch


@pytest.mark.compile
@pytest.mark.parametrize("kernel", ["prepare", "recurrence"])
def test_prefill_kernels_compile_for_any_batch_without_spills(kernel):
    """As prefill compiles them, the token, chunk and sequence counts run-time sizes (H=32, d=128, bf16,
    C=64, 64 columns a program): no spills, shared memory within an H100/H200 SM's 227 KiB."""
    from stages.s07_serving.kernel import varlen_compile_report

    report = varlen_compile_report(kernel)
    print(f"{kernel} sm_90a:", report.summary())
    assert report.spill_stores == 0 and report.spill_loads == 0, report.summary()
    assert not report.divergent_barriers, report.divergent_barriers  # a barrier some warps skip hangs the GPU
    assert not report.misplaced_warp_group_operands, report.misplaced_warp_group_operands  # wrong columns read
    assert report.shared_memory <= 227 * 1024, report.summary()
    assert "N_seq" in str(report.grid) if kernel == "recurrence" else "n_chunks" in str(report.grid), report.grid


def test_prefill_refuses_a_batch_past_32_bit_indices():
    """The kernels of run-time size index in int32: 2^31 entries or more in one buffer are refused."""
    from stages.s07_serving.kernel import check_int32_indexing

    check_int32_indexing(2**31 // (32 * 128) - 64, 32, 128)  # the largest batch of 64-row chunks that fits
    with pytest.raises(ValueError, match="2\\^31 or more: prefill it in smaller batches"):
        check_int32_indexing(2**31 // (32 * 128), 32, 128)


@pytest.mark.compile
def test_a_pool_past_2_31_entries_is_indexed_in_64_bits():
    """8192 slots of H=32, d=128 hold 2^32 fp32 entries: the state's addresses must not wrap in int32."""
    from stages.common.tilelang_tools import lower
    from stages.s07_serving.kernel import build_decode_program

    source = lower(build_decode_program(64, 8192, 32, 128, 128, dtype="bfloat16")).kernel_source
    accesses = [line for line in source.splitlines() if "State_pool +" in line]
    assert len(accesses) == 2, accesses  # one read, one write
    assert all("(int64_t)slot" in line for line in accesses), accesses


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("B, P, H, d_k, d_v", [(8, 32, 4, 128, 128), (5, 9, 2, 64, 128)])
def test_kernel_matches_reference_on_gpu(dtype_name, B, P, H, d_k, d_v):
    """Four steps on the GPU against the reference: o and the states within 4u, other slots bitwise kept."""
    import torch

    from stages.s07_serving.kernel import decode

    N = 4
    x = _sequences(B, N, H, d_k, d_v, seed=B + d_k, gate_range=(0.5, 1.0))
    rng = np.random.default_rng(d_k)
    pool = rng.standard_normal((P, H, d_k, d_v)).astype(np.float32).astype(np.float64) * 0.1
    slots = _slots(B, P, seed=P)
    expected_pool = pool.copy()
    expected = _decode_all(x, expected_pool, slots)
    dtype = getattr(torch, dtype_name)
    pool_gpu = torch.tensor(pool, dtype=torch.float32, device="cuda")
    slots_gpu = torch.tensor(slots, dtype=torch.int32, device="cuda")
    outputs = []
    for t in range(N):
        q, k, v, g, beta = _token(x, t)
        outputs.append(decode(*(torch.tensor(a, dtype=dtype, device="cuda") for a in (q, k, v)),
                              *(torch.tensor(a, dtype=torch.float32, device="cuda") for a in (g, beta)),
                              pool_gpu, slots_gpu))
    o = torch.stack(outputs, dim=1).double().cpu().numpy()
    u = UNIT_ROUNDOFF[dtype_name]
    print(f"{dtype_name} B={B} P={P} H={H} d_k={d_k} d_v={d_v}: o {error_report(o, expected)}, "
          f"pool {error_report(pool_gpu, expected_pool)}")
    assert_close(o, expected, rel_l2=4 * u, axes=("batch", "token", "head", "channel"))
    assert_close(pool_gpu.double().cpu().numpy(), expected_pool, rel_l2=4 * u, name="the pool", axes=POOL_AXES)
    others = np.setdiff1d(np.arange(P), slots)
    assert np.array_equal(pool_gpu.cpu().numpy()[others], pool[others].astype(np.float32)), "another slot changed"


# lengths of a packed batch on the GPU: one token, under, at and over the chunk, long, and empty
GPU_LENGTHS = (1, 63, 64, 65, 300, 1000, 0, 17)


def _gpu_packed(lengths, H, D, seed):
    x = make_inputs(1, sum(lengths), H, D, D, gate="channel", gate_range=(0.5, 1.0), beta_range=(0.0, 1.0), seed=seed)
    S0 = np.random.default_rng(seed).standard_normal((len(lengths), H, D, D)).astype(np.float32).astype(np.float64)
    return x, np.concatenate([[0], np.cumsum(lengths)]), 0.1 * S0


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_prefill_matches_float64_and_fla_with_cu_seqlens(dtype_name):
    """A packed batch from nonzero states through prefill and through FLA's chunk_kda with the same
    arguments (cu_seqlens, initial_state, output_final_state, scale 1): ours within twice FLA's error
    against float64 (stage 7's reference B), outputs and final states."""
    import torch

    from stages.s07_serving.kernel import prefill
    from stages.s07_serving.reference import chunkwise

    H, D = 4, 128
    x, cu_seqlens, S0 = _gpu_packed(GPU_LENGTHS, H, D, seed=31)
    expected_o, expected_states = chunkwise(x.q, x.k, x.v, x.g, x.beta, 64, cu_seqlens, S0, output_final_state=True)
    dtype = getattr(torch, dtype_name)
    args = [torch.tensor(a, dtype=dtype, device="cuda") for a in (x.q, x.k, x.v)]
    args += [torch.tensor(a, dtype=torch.float32, device="cuda") for a in (x.g, x.beta)]
    cu = torch.tensor(cu_seqlens, dtype=torch.int64, device="cuda")
    state = torch.tensor(S0, dtype=torch.float32, device="cuda")
    o, final_states = prefill(*args, cu_seqlens=cu, initial_state=state, output_final_state=True)
    assert torch.equal(state, torch.tensor(S0, dtype=torch.float32, device="cuda")), "prefill changed initial_state"
    ours = error_report(o, expected_o), error_report(final_states, expected_states)
    print(f"{dtype_name} prefill vs float64: o {ours[0]}, states {ours[1]}")
    u = UNIT_ROUNDOFF[dtype_name]
    assert_close(o.double().cpu().numpy(), expected_o, rel_l2=8 * u)
    assert_close(final_states.double().cpu().numpy(), expected_states, rel_l2=8 * u, name="the final states",
                 axes=POOL_AXES)
    fla_ops = pytest.importorskip("fla.ops")
    fla_o, fla_states = fla_ops.chunk_kda(*args, scale=1.0, initial_state=state.clone(), output_final_state=True,
                                          cu_seqlens=cu)
    fla = error_report(fla_o, expected_o), error_report(fla_states, expected_states)
    print(f"{dtype_name} FLA chunk_kda vs float64: o {fla[0]}, states {fla[1]}; ours vs FLA {error_report(o, fla_o)}")
    assert ours[0].rel_l2 <= max(2 * fla[0].rel_l2, u), "our output is further from float64 than FLA's"
    assert ours[1].rel_l2 <= max(2 * fla[1].rel_l2, u), "our final states are further from float64 than FLA's"
    from_zero = prefill(*args, cu_seqlens=cu, output_final_state=True)  # no initial_state: zeros
    expected_from_zero = chunkwise(x.q, x.k, x.v, x.g, x.beta, 64, cu_seqlens, output_final_state=True)
    assert_close(from_zero[0].double().cpu().numpy(), expected_from_zero[0], rel_l2=8 * u, name="o from zero states")
    assert_close(from_zero[1].double().cpu().numpy(), expected_from_zero[1], rel_l2=8 * u,
                 name="the final states from zero", axes=POOL_AXES)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_prefill_in_pieces_then_decode_on_gpu(dtype_name):
    """The server's life of test_prefill_in_pieces_then_decode_equals_one_pass with the GPU kernels:
    prefill (cu_seqlens, states gathered from and written back to the pool) and decode, at H=4, d=128,
    against one float64 pass of stage 4's reference A: every token's output and the final states."""
    import torch

    from stages.s07_serving.kernel import decode, prefill

    dtype = getattr(torch, dtype_name)
    x = _served_inputs(seed=43, H=4, d_k=128, d_v=128)
    pool = torch.zeros((9, 4, 128, 128), dtype=torch.float32, device="cuda")
    slots = np.array([7, 2, 4])

    def cuda(*arrays, as_dtype):
        return [torch.tensor(a, dtype=as_dtype, device="cuda") for a in arrays]

    def prefill_step(q, k, v, g, beta, cu_seqlens, states):
        o, final_states = prefill(*cuda(q, k, v, as_dtype=dtype), *cuda(g, beta, as_dtype=torch.float32),
                                  cu_seqlens=torch.tensor(cu_seqlens, device="cuda"),
                                  initial_state=torch.tensor(states, dtype=torch.float32, device="cuda"),
                                  output_final_state=True)
        return o.double().cpu().numpy(), final_states.double().cpu().numpy()

    def decode_token(q, k, v, g, beta, host_pool, slots):
        pool[torch.tensor(slots)] = torch.tensor(host_pool[slots], dtype=torch.float32, device="cuda")
        o = decode(*cuda(q, k, v, as_dtype=dtype), *cuda(g, beta, as_dtype=torch.float32), pool,
                   torch.tensor(slots, dtype=torch.int32, device="cuda"))
        host_pool[slots] = pool[torch.tensor(slots)].double().cpu().numpy()
        return o.double().cpu().numpy()

    host_pool = np.zeros((9, 4, 128, 128))
    o = _serve(x, host_pool, slots, prefill_step, decode_token)
    expected_o, expected_state = _final_state_of_reference_a(x)
    u = UNIT_ROUNDOFF[dtype_name]
    print(f"{dtype_name} served: o {error_report(o, expected_o)}, states {error_report(host_pool[slots], expected_state)}")
    assert_close(o, expected_o, rel_l2=8 * u)
    assert_close(host_pool[slots], expected_state, rel_l2=8 * u, name="the final states", axes=POOL_AXES)


# ------------------------------------------------------------------------------------------ a layer served

LAYER_PIECES = [1, 3, 7, 13, 16, 1, 1, 1]  # prefill pieces around the chunk of 8, then three decode steps


class _ServedKernel:
    """chunk_kda's calling convention, as stage 6's KDALayer calls it, served as an engine serves the
    layer's B sequences: a call of one token each is a decode step over a state pool (the sequences'
    states at scattered slots of a larger pool, copied there from the cache), any longer call one
    packed prefill of the B sequences (cu_seqlens = 0, T, 2T, ...) from their states.

    prefill(q, k, v, g, beta, cu_seqlens, states) -> (o, final states) on the packed batch;
    decode(q, k, v, g, beta, pool, slots) -> o, advancing pool[slots] in place. `calls` records which
    path each call took.
    """

    def __init__(self, prefill, decode, pool, slots):
        self.prefill, self.decode, self.pool, self.slots, self.calls = prefill, decode, pool, slots, []

    def __call__(self, q, k, v, g, beta, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, scale=None):
        import torch

        from stages.s06_backward.autograd import l2_normalize

        B, T, H, d_k = q.shape
        if use_qk_l2norm_in_kernel:
            q, k = l2_normalize(q), l2_normalize(k)
        q = q * (d_k**-0.5 if scale is None else scale)
        states = (torch.zeros(B, H, d_k, v.shape[3], dtype=self.pool.dtype, device=q.device) if initial_state is None
                  else initial_state.to(self.pool.dtype))
        if T == 1:
            self.calls.append("decode")
            self.pool[self.slots] = states
            o = self.decode(*(x[:, 0].contiguous() for x in (q, k, v, g, beta)), self.pool, self.slots)
            return o[:, None], self.pool[self.slots].clone()
        self.calls.append("prefill")
        cu_seqlens = np.arange(B + 1) * T
        o, final_states = self.prefill(*(x.reshape(1, B * T, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)),
                                       cu_seqlens, states.contiguous())
        return o.reshape(B, T, *o.shape[2:]), final_states


def _serve_layer(layer, x, pieces):
    """y of x (B, T, d_model) through `layer`, prefilled and decoded piece by piece with the cache
    carried between calls; and the last cache."""
    import torch

    cache, ys, start = None, [], 0
    for length in pieces:
        y, cache = layer(x[:, start:start + length], cache, use_cache=True)
        ys.append(y)
        start += length
    return torch.cat(ys, dim=1), cache


def test_a_layer_served_in_pieces_and_decode_steps_equals_one_forward():
    """Stage 6's KDALayer (float64, CPU) with its kernel served by stage 7: packed prefill through
    reference C in pieces of 1, 3, C - 1, C + 5 and 2C tokens, then decode steps through the decode
    reference over a pool, the cache carried: y and the final cache equal one forward of the layer on
    its own kernel (rel L2 <= 1e-12); the pool's other slots untouched."""
    import torch

    from stages.s06_backward.layer import KDALayer
    from stages.s07_serving.reference import kernel_mirror

    def prefill(q, k, v, g, beta, cu_seqlens, states):
        o, final_states = kernel_mirror(*(a.numpy() for a in (q, k, v, g, beta)), 8, 4, cu_seqlens, states.numpy(),
                                        output_final_state=True, sub_block=4)
        return torch.from_numpy(o), torch.from_numpy(final_states)

    def decode(q, k, v, g, beta, pool, slots):
        return torch.from_numpy(decode_step(*(a.numpy() for a in (q, k, v, g, beta)), pool.numpy(), slots))

    torch.manual_seed(0)
    layer = KDALayer(d_model=24, n_heads=2, head_dim=8).double()
    x = torch.randn(3, sum(LAYER_PIECES), 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pool = torch.randn(7, 2, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    others, slots = pool[[0, 1, 3, 6]].clone(), np.array([5, 2, 4])
    with torch.no_grad():
        whole, whole_cache = layer(x, use_cache=True)
        layer.kernel = served = _ServedKernel(prefill, decode, pool, slots)
        y, cache = _serve_layer(layer, x, LAYER_PIECES)
    assert served.calls == ["decode", "prefill", "prefill", "prefill", "prefill", "decode", "decode", "decode"]
    assert error_report(y, whole).rel_l2 <= 1e-12
    for name, expected, actual in zip(whole_cache._fields, whole_cache, cache):
        assert error_report(actual, expected).rel_l2 <= 1e-12, name
    assert torch.equal(pool[[0, 1, 3, 6]], others), "a slot of another sequence changed"


@pytest.mark.gpu
def test_a_layer_served_by_prefill_and_decode_on_gpu():
    """The same on CUDA under bf16 autocast (H=4, d=128): stage 7's prefill (cu_seqlens, the varlen
    kernels) in pieces of 1, 3, 63, 69 and 128 tokens, then three steps of the decode kernel over a
    pool: y within twice the error of one prefill call on the whole, both against the float64 layer
    on the CPU."""
    import torch

    from stages.s06_backward.layer import KDALayer
    from stages.s07_serving.kernel import decode, prefill

    def prefill_on_gpu(q, k, v, g, beta, cu_seqlens, states):
        return prefill(*(a.to(torch.bfloat16) for a in (q, k, v)), g.float(), beta.float(),
                       cu_seqlens=torch.tensor(cu_seqlens, device="cuda"), initial_state=states,
                       output_final_state=True)

    def decode_on_gpu(q, k, v, g, beta, pool, slots):
        return decode(*(a.to(torch.bfloat16) for a in (q, k, v)), g.float(), beta.float(), pool, slots)

    torch.manual_seed(11)
    layer = KDALayer(d_model=256, n_heads=4, head_dim=128)
    pieces = [1, 3, 63, 69, 128, 1, 1, 1]
    x = torch.randn(3, sum(pieces), 256, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        truth = layer.double()(x.double())[0]
    layer, x = layer.float().cuda(), x.cuda()
    pool = torch.zeros(9, 4, 128, 128, device="cuda")
    layer.kernel = served = _ServedKernel(prefill_on_gpu, decode_on_gpu, pool,
                                          torch.tensor([7, 2, 4], dtype=torch.int32, device="cuda"))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        whole = layer(x)[0]
        y, cache = _serve_layer(layer, x, pieces)
    assert served.calls == ["prefill", "decode", "prefill", "prefill", "prefill", "prefill", "decode", "decode",
                            "decode"]
    whole_error, pieces_error = error_report(whole, truth), error_report(y, truth)
    print(f"served layer vs float64: one prefill {whole_error}, in pieces and decode steps {pieces_error}")
    # bf16 projections and kernels: a few 1e-3 expected; a lost state or a misplaced row is O(1)
    assert whole_error.rel_l2 <= 5e-2
    assert pieces_error.rel_l2 <= max(2 * whole_error.rel_l2, 1e-2)


def _chunked_fp32_gates(g, cu_seqlens, C):
    """The log gates whose float64 cumulative sums are the varlen prepare's fp32 ones: each chunk of
    each sequence summed in fp32 row by row from the chunk's start, and differenced back."""
    held = np.empty_like(g)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
        for first in range(start, end, C):
            rows = slice(first, min(first + C, end))
            gamma = np.cumsum(g[:, rows].astype(np.float32), axis=1, dtype=np.float32)
            held[:, rows] = np.diff(gamma.astype(np.float64), axis=1, prepend=0.0)
    return held


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_prefill_through_the_interpreter_takes_any_gate(dtype):
    """Gates down to -1e4 a token in the packed batch (lengths not multiples of the chunk, beta 0 and
    1): finite, against reference A within the TF32 floor (float64, on the gates the kernel's fp32
    cumulative sums hold) or 4u (bf16); inputs unchanged, a second call the same."""
    from stages.s07_serving.reference import recurrent as recurrent_varlen

    x, cu_seqlens, S0 = _prefill_case(seed=54)
    rng = np.random.default_rng(54)
    x.g[:, 40:80] = -rng.uniform(0.0, 1e4, x.g[:, 40:80].shape)
    x.g[:, 100:112, :, :3] = -300.0
    kept = [a.copy() for a in (x.q, x.k, x.v, x.g, x.beta, S0)]
    kernels = _interpreted_kernels(PREFILL_LENGTHS, dtype)
    o, final_states = _prefill_on_the_cpu(x, cu_seqlens, S0, dtype, kernels)
    assert np.all(np.isfinite(o)) and np.all(np.isfinite(final_states))
    gates = _chunked_fp32_gates(x.g, cu_seqlens, PREFILL_C) if dtype == "float64" else x.g
    expected_o, expected_states = recurrent_varlen(x.q, x.k, x.v, gates, x.beta, cu_seqlens, S0, output_final_state=True)
    bound = TF32_FLOOR if dtype == "float64" else 4 * UNIT_ROUNDOFF[dtype]
    assert_close(o, expected_o, rel_l2=bound, chunk_size=PREFILL_C)
    assert_close(final_states, expected_states, rel_l2=bound, name="the final states", axes=POOL_AXES)
    again = _prefill_on_the_cpu(x, cu_seqlens, S0, dtype, kernels)
    assert np.array_equal(again[0], o) and np.array_equal(again[1], final_states), "a second call differs"
    for given, before in zip((x.q, x.k, x.v, x.g, x.beta, S0), kept):
        assert np.array_equal(given, before), "prefill changed an input"
