"""Stage 7, prefill of variable-length batches: the varlen references, the chunk table, the varlen
kernels and their wrapper `prefill`.

The varlen references A, B and C against each sequence run alone (stage 4's reference A from zero,
stage 6's reference A from a state), lengths that are and are not multiples of the chunk, empty
sequences, one chunk and many; the chunk table against its definition; chunked prefill in pieces of
any sizes against one pass; the varlen prepare and recurrence through the tile interpreter against
reference C, alone and as `prefill` wires them, any gate included; bad inputs refused on any
machine; the kernels compiled for run-time sizes (`compile`) and run on a GPU against float64 and
FLA (`gpu`). Decode is tests/kernels/test_s07_decode.py; the two serving together, tests/stages/test_s07_serving.py.
"""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.device_checks import FLAG_COUNT
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.s04_kda.reference import recurrent
from tests.stages.s07_cases import FP32_FLOOR, POOL_AXES, UNIT_ROUNDOFF, make_sequences

TF32_FLOOR = 2.0**-13  # stage 5's prepare: its block-inverse merges run as TF32 GEMMs


# ------------------------------------------------------------------------------------------ varlen references

MIXES = [  # (lengths, chunk_size, block_dv, sub_block): the sequences of one packed batch
    ((5, 0, 17, 16, 1, 33), 8, 3, 4),  # empty, one token, a full chunk, short last chunks, many chunks
    ((16,), 16, 6, 4),  # one sequence of one full chunk
    ((9, 40), 16, 2, 8),  # two sequences, neither a multiple of the chunk
]


def _packed(lengths, H=2, d_k=8, d_v=6, seed=0):
    """A packed batch (1, T, ...) of sequences of the given lengths, strong gates, beta 0 and 1; its cu_seqlens."""
    x = make_sequences(1, sum(lengths), H, d_k, d_v, seed=seed)
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
    x = make_sequences(B, N, H, d_k, d_v, seed=4)
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
    x = make_sequences(B, N, H, d_k, d_v, seed=6, gate_range=(0.5, 1.0))
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


# ------------------------------------------------------------------------------------------ prefill, on the CPU


@pytest.mark.parametrize("lengths, C", [((5, 0, 17, 16, 1, 33), 8), ((64, 128, 64), 64), ((1, 33, 65), 32),
                                         ((0, 0, 7), 32), ((40,), 64)])
def test_varlen_index_is_the_chunk_table_then_rows_that_start_past_their_sequence(lengths, C):
    """prefill's index, built by device ops (here on the CPU): cu_seqlens, reference.chunk_table's
    chunk_offsets and rows, then rows up to most_chunks whose chunk starts at or past its sequence's
    end (the prepare runs them on zeros). most_chunks is the bound: reached where every length is 1 past a
    multiple of C ((1, 33, 65) at C = 32), twice the chunks where every length is a whole number of
    them; empty sequences and a single sequence included."""
    import torch

    from stages.kda.calls import varlen_index
    from stages.kda.config import most_chunks
    from stages.s07_serving.reference import chunk_table

    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
    T, N_seq = int(cu_seqlens[-1]), len(lengths)
    chunks, chunk_offsets = chunk_table(cu_seqlens, C)
    for dtype in (torch.int32, torch.int64):
        index = varlen_index(torch.tensor(cu_seqlens, dtype=dtype), T, C)
        assert index.dtype == torch.int32 and index.shape == (2 * (N_seq + 1) + 2 * most_chunks(T, N_seq, C),)
        index = index.numpy()
        assert index[:N_seq + 1].tolist() == cu_seqlens.tolist()
        assert index[N_seq + 1:2 * N_seq + 2].tolist() == chunk_offsets.tolist()
        rows = index[2 * N_seq + 2:].reshape(-1, 2)
        assert rows[:len(chunks)].tolist() == chunks.tolist()
        for sequence, chunk in rows[len(chunks):]:
            assert 0 <= sequence < N_seq and cu_seqlens[sequence] + chunk * C >= cu_seqlens[sequence + 1]
    if lengths == (1, 33, 65):
        assert len(chunks) == most_chunks(T, N_seq, C)


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


def _interpreted_kernels(lengths, dtype, value_flags=False, C=PREFILL_C, H=PREFILL_H, d=PREFILL_D,
                         block_dv=PREFILL_BLOCK_DV):
    """(varlen prepare, varlen recurrence) through the tile interpreter, built for the packed batch of
    `lengths` as prefill sizes it (most_chunks rows in the chunk table), as varlen_forward calls them
    (torch tensors, outputs written in place)."""
    from stages.common.interpreter import interpret
    from stages.kda.config import most_chunks

    n_chunks = most_chunks(sum(lengths), len(lengths), C)
    sizes = (sum(lengths), n_chunks * C, n_chunks, len(lengths), H, d, d, C)
    return (interpret(_packed_prepare(*sizes, dtype, value_flags=value_flags)),
            interpret(_packed_recurrence(*sizes, block_dv, dtype)))


def _packed_prepare(T_tokens, T_padded, n_chunks, N_seq, H, d_k, d_v, C, dtype, value_flags=False):
    """The prepare program for a packed batch of these sizes (prefill's, at fixed sizes)."""
    from stages.kda.prepare import PackedBatch, build_prepare_program

    return build_prepare_program(1, T_padded, H, d_k, d_v, C, dtype, value_flags=value_flags,
                                 packed=PackedBatch(T_tokens, n_chunks, N_seq))


def _packed_recurrence(T_tokens, T_padded, n_chunks, N_seq, H, d_k, d_v, C, block_dv, dtype):
    """The recurrence program for a packed batch of these sizes."""
    from stages.kda.prepare import PackedBatch
    from stages.kda.recurrence import build_recurrence_program

    return build_recurrence_program(1, T_padded, H, d_k, d_v, C, block_dv, dtype,
                                    packed=PackedBatch(T_tokens, n_chunks, N_seq))


def _prefill_on_the_cpu(x, cu_seqlens, S0, dtype, kernels):
    """stages.kda.calls.varlen_forward on CPU torch tensors with interpreted kernels: the
    wrapper's index and the kernels' launches as on the GPU. Returns float64 (o, final states)."""
    import torch

    from stages.kda.calls import varlen_forward, varlen_index

    operand = {"float64": torch.float64, "bfloat16": torch.bfloat16}[dtype]
    state = torch.float64 if dtype == "float64" else torch.float32
    args = [torch.tensor(a, dtype=operand) for a in (x.q, x.k, x.v)] + [torch.tensor(a, dtype=state) for a in (x.g, x.beta)]
    index = varlen_index(torch.tensor(cu_seqlens), x.q.shape[1], PREFILL_C)
    o, final_states = varlen_forward(*args, index, torch.tensor(S0, dtype=state), PREFILL_C, kernels)
    return o.double().numpy(), final_states.double().numpy()


def _prefill_case(seed, lengths=PREFILL_LENGTHS, with_state=True):
    x, cu_seqlens = _packed(lengths, H=PREFILL_H, d_k=PREFILL_D, d_v=PREFILL_D, seed=seed)
    S0 = np.random.default_rng(seed).standard_normal((len(lengths), PREFILL_H, PREFILL_D, PREFILL_D))
    return x, cu_seqlens, (0.1 * S0.astype(np.float32).astype(np.float64) if with_state else np.zeros_like(S0))


def _varlen_sizes(cu_seqlens, n_chunks=None):
    """(T_tokens, T_padded, n_chunks, N_seq, H, d_k, d_v, C) of the CPU checks' packed batch: n_chunks
    the batch's own chunks unless given."""
    from stages.s07_serving.reference import chunk_table

    n_chunks = n_chunks or int(chunk_table(cu_seqlens, PREFILL_C)[1][-1])
    return (int(cu_seqlens[-1]), n_chunks * PREFILL_C, n_chunks, len(cu_seqlens) - 1, PREFILL_H, PREFILL_D, PREFILL_D,
            PREFILL_C)


def test_varlen_prepare_program_matches_reference_c():
    """The varlen prepare alone (float64 operands, fp32 on chip), on the table prefill builds, against
    reference C's prepare_varlen: each token's outputs at its chunk-aligned row within the TF32
    rounding of stage 5's block-inverse merges, the rows past each sequence's end exactly zero (the
    recurrence reads them as zero tokens), the chunk decays by row of the chunk table; the table's
    rows past the batch's chunks a zero chunk's outputs, written (the interpreter's outputs start as
    NaN) where no sequence's rows are; the packed inputs read in place, unchanged."""
    import torch

    from stages.common.interpreter import interpret
    from stages.kda.calls import varlen_index
    from stages.kda.config import most_chunks
    from stages.s07_serving.reference import CHUNK_FIELDS, chunk_aligned_rows, chunk_table, prepare_varlen

    x, cu_seqlens, _ = _prefill_case(seed=50)
    inputs = (x.q, x.k, x.v, x.g, x.beta)
    kept = [a.copy() for a in inputs]
    expected = prepare_varlen(*inputs, cu_seqlens, PREFILL_C, sub_block=16)
    T, N_seq = int(cu_seqlens[-1]), len(cu_seqlens) - 1
    index = varlen_index(torch.tensor(cu_seqlens), T, PREFILL_C).numpy()
    sizes = _varlen_sizes(cu_seqlens, most_chunks(T, N_seq, PREFILL_C))
    program = _packed_prepare(*sizes, "float64")
    outputs = interpret(program, out_idx=[7, 8, 9, 10, 11, 12])(
        *inputs, index[2 * N_seq + 2:].reshape(-1, 2), index[:N_seq + 1])
    prepared, chunk_decay = dict(zip(("w", "u", "q_decayed", "k_to_chunk_end", "a_qk"), outputs[:5])), outputs[5]
    n_chunks = int(chunk_table(cu_seqlens, PREFILL_C)[1][-1])
    assert sizes[2] > n_chunks, "the table has no row past the batch's chunks: the test does not test them"
    token_rows, _ = chunk_aligned_rows(cu_seqlens, PREFILL_C)
    padding_rows = np.setdiff1d(np.arange(n_chunks * PREFILL_C), token_rows)
    assert len(padding_rows) == n_chunks * PREFILL_C - sizes[0] > 0
    for field in CHUNK_FIELDS:
        assert_close(prepared[field][:, token_rows], getattr(expected, field), rel_l2=TF32_FLOOR, name=field)
        assert np.array_equal(prepared[field][:, padding_rows], np.zeros_like(prepared[field][:, padding_rows])), \
            f"{field}: a row past a sequence's end is not zero"
        past = prepared[field][:, n_chunks * PREFILL_C:]
        assert np.array_equal(past, np.zeros_like(past)), f"{field}: a row past the chunks is not a zero chunk's"
    assert_close(chunk_decay[:, :n_chunks], expected.chunk_decay, rel_l2=FP32_FLOOR, name="the chunk decays")
    assert np.array_equal(chunk_decay[:, n_chunks:], np.ones_like(chunk_decay[:, n_chunks:])), \
        "a chunk decay past the batch's chunks is not a zero chunk's (e^0 = 1)"
    for given, before in zip(inputs, kept):
        assert np.array_equal(given, before), "the prepare changed an input"


def test_varlen_recurrence_program_matches_reference_c():
    """The varlen recurrence alone (float64 operands, its fp32 state) against reference C's
    recurrence_varlen on reference C's prepare_varlen, laid out chunk-aligned: fp32's rounding, a
    program per (d_v block, sequence x head) that reads only its own sequence's chunks, and o stored
    straight to the packed rows (every row written once: o's buffer starts as NaN in the interpreter)."""
    from stages.common.interpreter import interpret
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

    program = _packed_recurrence(*_varlen_sizes(cu_seqlens), PREFILL_BLOCK_DV, "float64")
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

    from stages.kda.config import KernelConfig

    return [
        (dict(cu_seqlens=torch.tensor([0.0, 3.0, 10.0])), TypeError, "cu_seqlens must have dtype int32 or int64"),
        (dict(cu_seqlens=torch.tensor([0, 3, 11], dtype=torch.int32), checks="host"), ValueError, "end at T = 10"),
        (dict(cu_seqlens=torch.tensor([0, 5, 3, 10]), initial_state=torch.zeros(3, 2, 32, 32), checks="host"),
         ValueError, "never decrease"),
        (dict(cu_seqlens=torch.tensor([0])), ValueError, r"shape \(N_seq \+ 1,\)"),
        (dict(initial_state=torch.zeros(3, 2, 32, 32)), ValueError, r"initial_state must have shape \(N_seq"),
        (dict(initial_state=torch.zeros(2, 2, 32, 32, dtype=torch.float64)), TypeError, "initial_state must have dtype"),
        (dict(g=torch.full((1, 10, 2, 32), 0.5), checks="host"), ValueError, "g must be finite and <= 0"),
        (dict(beta=torch.rand(1, 10, 3)), ValueError, r"beta must have shape \(B, T, H\)"),
        (dict(config=KernelConfig(chunk_size=48)), ValueError, "chunk_size must be 32 or 64"),
        (dict(config=KernelConfig(block_dv=12)), ValueError, "block_dv"),
        (dict(q=torch.randn(1, 10, 2, 16, dtype=torch.bfloat16), k=torch.randn(1, 10, 2, 16, dtype=torch.bfloat16),
              g=-torch.rand(1, 10, 2, 16), initial_state=torch.zeros(2, 2, 16, 32)), ValueError,
         "d_k must be a multiple of 32"),
        (dict(), ValueError, "must be on a CUDA device"),  # every check passed: the device is last
        # the default, checks="device": a bad value is the kernel's to flag, none is read here
        (dict(g=torch.full((1, 10, 2, 32), 0.5)), ValueError, "must be on a CUDA device"),
        (dict(cu_seqlens=torch.tensor([0, 3, 11])), ValueError, "must be on a CUDA device"),
        (dict(checks="never"), ValueError, "checks must be one of 'device', 'host', 'off'"),
    ]


@pytest.mark.parametrize("case", range(15))
def test_prefill_refuses_bad_inputs_on_any_machine(case):
    from stages.kda.calls import prefill

    change, error, message = _bad_prefill_inputs()[case]
    arguments = _prefill_arguments()
    arguments.update(change)
    with pytest.raises(error, match=message):
        prefill(**arguments)


def test_prefill_refuses_cu_seqlens_with_more_than_one_row():
    import torch

    from stages.kda.calls import prefill

    arguments = _prefill_arguments()
    for name in ("q", "k", "v", "g", "beta"):
        arguments[name] = torch.cat([arguments[name]] * 2)
    with pytest.raises(ValueError, match="B must be 1"):
        prefill(**arguments)


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


# ------------------------------------------------------------------------------------------ value flags

# PREFILL_LENGTHS's sequences start at tokens 0, 32, 32, 33, 64, 134 (167 in all)
BAD_PREFILL_VALUES = [  # (tensor, token, value, flag): in the middle of the 70-token sequence, at the last
    # token of the 31-token one, in the 1-token one, in a short last chunk, at a sequence's first token
    ("g", 104, 0.25, "gate"), ("g", 63, np.nan, "gate"), ("g", 32, -np.inf, "gate"),
    ("beta", 166, -0.01, "beta"), ("beta", 5, 1.5, "beta"), ("beta", 133, np.nan, "beta"), ("beta", 64, 2.0, "beta"),
]


@pytest.fixture
def cpu_prefill(monkeypatch):
    """prefill with cu_seqlens on CPU torch tensors (bf16, gates fp32), PREFILL_LENGTHS' batch: the
    device check skipped, the varlen kernels interpreted in place (the Flags tensor written as on the
    GPU). The CPU's flags are clear before and after."""
    torch = pytest.importorskip("torch")
    from stages.common.device_checks import flags_for
    from stages.kda import calls, checks
    from stages.kda.config import KernelConfig

    def compiled_prefill_kernels(H, d_k, d_v, chunk_size, block_dv, dtype, num_stages, value_flags=False,
                                 programs_per_sm=1, channel_passes=2):
        assert (channel_passes, programs_per_sm) == (2, 1)  # the config's defaults: what _interpreted_kernels builds
        return _interpreted_kernels(PREFILL_LENGTHS, dtype, value_flags, chunk_size, H, d_k, block_dv)

    monkeypatch.setattr(checks, "check_on_cuda", lambda tensors: None)
    monkeypatch.setattr(calls, "compiled_prefill_kernels", compiled_prefill_kernels)
    flags_for("cpu").zero_()

    def prefill(x, cu_seqlens, checks="device"):
        tensors = [torch.tensor(a, dtype=torch.bfloat16) for a in (x.q, x.k, x.v)]
        tensors += [torch.tensor(a, dtype=torch.float32) for a in (x.g, x.beta)]
        config = KernelConfig(chunk_size=PREFILL_C, block_dv=PREFILL_BLOCK_DV)
        return calls.prefill(*tensors, cu_seqlens=torch.tensor(cu_seqlens), checks=checks, config=config)[0]

    yield prefill
    flags_for("cpu").zero_()


def _flagged_case(change=None):
    """PREFILL_LENGTHS' batch with good values at the edges (g down to -50 and -1e4, g = 0, beta 0
    and 1: make_sequences' betas take both); with change = (tensor, token, value), one entry of that
    token changed (g: in head 1, channel 7)."""
    x, cu_seqlens, _ = _prefill_case(seed=55)
    x.g[0, 70:90, 0] = -50.0
    x.g[0, 100, 1, :3], x.g[0, 101, 0, 4] = -1e4, 0.0
    if change is not None:
        name, token, value = change
        index = (0, token, 1, 7) if name == "g" else (0, token, 1)
        getattr(x, name)[index] = value
    return x, cu_seqlens


@pytest.mark.parametrize("name, token, value, flag", BAD_PREFILL_VALUES)
def test_the_default_prefill_flags_a_bad_value_and_raises_where_the_caller_syncs(cpu_prefill, name, token, value,
                                                                                 flag):
    """A bad g or beta in any sequence of the packed batch: the call returns, raise_if_flagged raises
    that kind's message alone, and clears the flags."""
    from stages.common.device_checks import BAD_BETA, BAD_GATE, MESSAGES, raise_if_flagged

    cpu_prefill(*_flagged_case((name, token, value)))  # no host read of the values, no error here
    with pytest.raises(ValueError) as raised:
        raise_if_flagged("cpu")
    assert str(raised.value) == MESSAGES[BAD_GATE if flag == "gate" else BAD_BETA]
    raise_if_flagged("cpu")  # cleared


def test_good_values_flag_nothing_in_prefill_and_off_flags_nothing(cpu_prefill):
    """The edges set no flag, and the flagged kernels' output is the unflagged ones', bit for bit;
    checks="off" runs the prepare without Flags, so a bad value sets nothing."""
    import torch

    from stages.common.device_checks import flags_for

    x, cu_seqlens = _flagged_case()
    flagged = cpu_prefill(x, cu_seqlens)
    assert not flags_for("cpu").any(), flags_for("cpu")
    assert torch.equal(flagged, cpu_prefill(x, cu_seqlens, checks="off"))
    cpu_prefill(*_flagged_case(("g", 104, 0.25)), checks="off")
    assert not flags_for("cpu").any()


# offsets out of order in PREFILL_LENGTHS' batch (167 tokens, 6 sequences): past the end, short of it,
# from a token above 0, decreasing, negative
BAD_CU_SEQLENS = [(0, 32, 32, 33, 64, 134, 200), (0, 32, 32, 33, 64, 134, 160), (5, 32, 32, 33, 64, 134, 167),
                  (0, 32, 40, 33, 64, 134, 167), (0, -32, 32, 33, 64, 134, 167)]


@pytest.mark.parametrize("cu_seqlens", BAD_CU_SEQLENS)
def test_the_default_prefill_flags_cu_seqlens_out_of_order_and_reads_nothing_outside(cpu_prefill, cu_seqlens):
    """Offsets out of order are the device's to flag (nothing read to the host): the call returns,
    having read and written nothing outside the batch's tensors (the interpreter raises on an index
    out of range), and raise_if_flagged raises the cu_seqlens message alone; with checks="off"
    nothing is flagged, and with checks="host" the call refuses before a kernel."""
    from stages.common.device_checks import BAD_CU_SEQLENS, MESSAGES, flags_for, raise_if_flagged

    x, _ = _flagged_case()
    cu_seqlens = np.array(cu_seqlens)
    cpu_prefill(x, cu_seqlens)
    with pytest.raises(ValueError) as raised:
        raise_if_flagged("cpu")
    assert str(raised.value) == MESSAGES[BAD_CU_SEQLENS]
    cpu_prefill(x, cu_seqlens, checks="off")
    assert not flags_for("cpu").any()
    with pytest.raises(ValueError, match="cu_seqlens must start at 0, never decrease and end at T = 167"):
        cpu_prefill(x, cu_seqlens, checks="host")


def test_prefill_on_the_host_refuses_before_the_kernels(cpu_prefill, monkeypatch):
    from stages.kda import calls

    monkeypatch.setattr(calls, "compiled_prefill_kernels", lambda *arguments: pytest.fail("a kernel was built"))
    with pytest.raises(ValueError, match="g must be finite and <= 0"):
        cpu_prefill(*_flagged_case(("g", 63, np.nan)), checks="host")
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 1\]"):
        cpu_prefill(*_flagged_case(("beta", 166, -0.01)), checks="host")


@pytest.mark.parametrize("token, flagged", [(64, False), (63, True)])
def test_rows_past_a_sequence_end_are_not_read_for_the_flags(token, flagged):
    """The varlen prepare run on one chunk alone, the 31-token sequence's (tokens 33 to 63): a bad g at
    token 64, the next sequence's first (the row its program would read if the loads were not masked),
    sets no flag; at token 63, its own last, it does."""
    from stages.common.interpreter import interpret

    x, cu_seqlens = _flagged_case(("g", token, 0.25))
    T_tokens, C, H, d = int(cu_seqlens[-1]), PREFILL_C, PREFILL_H, PREFILL_D
    program = _packed_prepare(T_tokens, C, 1, len(PREFILL_LENGTHS), H, d, d, C, "float64",
                                           value_flags=True)
    flags = np.zeros(FLAG_COUNT, dtype=np.int32)
    outputs = [np.zeros((1, C, H, width)) for width in (d, d, d, d, C)] + [np.zeros((1, 1, H, d))]
    chunks = np.array([[3, 0]], dtype=np.int32)  # sequence 3's chunk 0
    interpret(program)(x.q, x.k, x.v, x.g, x.beta, chunks, cu_seqlens.astype(np.int32), flags, *outputs)
    assert flags.tolist() == [int(flagged)] + [0] * (FLAG_COUNT - 1)


# ------------------------------------------------------------------------------------------ compile, GPU


@pytest.mark.compile
@pytest.mark.parametrize("kernel, value_flags", [("prepare", False), ("prepare", True), ("recurrence", False)])
def test_prefill_kernels_compile_for_any_batch_without_spills(kernel, value_flags):
    """As prefill compiles them, the token, chunk and sequence counts run-time sizes (H=32, d=128, bf16,
    C=64, 64 columns a program), the prepare with and without the value flags (prefill's default
    has them): no spills, shared memory within an H100/H200 SM's 227 KiB."""
    from stages.s07_serving.kernel import varlen_compile_report

    report = varlen_compile_report(kernel, value_flags=value_flags)
    print(f"{kernel} sm_90a:", report.summary())
    assert report.spill_stores == 0 and report.spill_loads == 0, report.summary()
    assert not report.divergent_barriers, report.divergent_barriers  # a barrier some warps skip hangs the GPU
    assert not report.misplaced_warp_group_operands, report.misplaced_warp_group_operands  # wrong columns read
    assert report.shared_memory <= 227 * 1024, report.summary()
    assert "N_seq" in str(report.grid) if kernel == "recurrence" else "n_chunks" in str(report.grid), report.grid


def test_prefill_refuses_a_batch_past_32_bit_indices():
    """The kernels of run-time size index in int32: 2^31 entries or more in one buffer are refused."""
    from stages.kda.checks import check_int32_indexing

    check_int32_indexing(2**31 // (32 * 128) - 64, 32, 128)  # the largest batch of 64-row chunks that fits
    with pytest.raises(ValueError, match="2\\^31 or more: prefill it in smaller batches"):
        check_int32_indexing(2**31 // (32 * 128), 32, 128)


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

    from stages.kda.calls import prefill
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
def test_the_default_prefill_flags_bad_values_on_the_gpu():
    """checks="device" on the GPU, cu_seqlens given: good values (g down to -1e4, beta 0 and 1) flag
    nothing; a bad g or beta in any sequence raises at raise_if_flagged (not at the call), with
    checks="off" nothing. (The call captured in a CUDA graph: the next test.)"""
    import torch

    from stages.common.device_checks import BAD_BETA, BAD_GATE, MESSAGES, raise_if_flagged
    from stages.kda.calls import prefill

    device = torch.device("cuda")
    x, cu_seqlens, _ = _gpu_packed(GPU_LENGTHS, 2, 128, seed=32)  # sequences from tokens 0, 1, 64, 128, 193, 493, 1493
    x.g[0, 600:700, 1] = -50.0
    x.g[0, 700, 0, :5], x.beta[0, 3], x.beta[0, 4] = -1e4, 0.0, 1.0
    args = [torch.tensor(a, dtype=torch.bfloat16, device=device) for a in (x.q, x.k, x.v)]
    g, beta = (torch.tensor(a, dtype=torch.float32, device=device) for a in (x.g, x.beta))
    cu = torch.tensor(cu_seqlens, device=device)
    raise_if_flagged(device)
    prefill(*args, g, beta, cu_seqlens=cu)
    raise_if_flagged(device)  # good values: quiet
    gpu_bad_values = [  # the middle of the 300-token sequence, the last token of the 65-token one, the
        # 1-token one, the last token of the batch, the 1000-token one, the last of the 63-token one, a first token
        ("g", 343, 0.25, "gate"), ("g", 192, np.nan, "gate"), ("g", 0, -np.inf, "gate"), ("beta", 1509, -0.01, "beta"),
        ("beta", 1000, 1.5, "beta"), ("beta", 63, np.nan, "beta"), ("beta", 193, 2.0, "beta")]
    for name, token, value, flag in gpu_bad_values:
        bad = {"g": g.clone(), "beta": beta.clone()}
        bad[name][(0, token, 1, 7) if name == "g" else (0, token, 1)] = value
        prefill(*args, bad["g"], bad["beta"], cu_seqlens=cu, checks="off")
        raise_if_flagged(device)  # "off": nothing flagged
        prefill(*args, bad["g"], bad["beta"], cu_seqlens=cu)  # no error here
        with pytest.raises(ValueError) as raised:
            raise_if_flagged(device)
        assert str(raised.value) == MESSAGES[BAD_GATE if flag == "gate" else BAD_BETA]


@pytest.mark.gpu
def test_prefill_with_cu_seqlens_syncs_nothing_and_replays_as_a_cuda_graph():
    """The default call with cu_seqlens runs under torch's sync debug mode "error" (a host sync would
    raise), and captured in a CUDA graph it replays any batch of the same token and sequence counts:
    new lengths and new values copied into the captured tensors give the eager call's outputs, bit
    for bit; offsets out of order copied in are flagged at raise_if_flagged."""
    import torch

    from stages.common.device_checks import BAD_CU_SEQLENS, MESSAGES, raise_if_flagged
    from stages.kda.calls import prefill

    device = torch.device("cuda")
    x, cu_seqlens, S0 = _gpu_packed(GPU_LENGTHS, 2, 128, seed=33)
    tensors = [torch.tensor(a, dtype=torch.bfloat16, device=device) for a in (x.q, x.k, x.v)]
    tensors += [torch.tensor(a, dtype=torch.float32, device=device) for a in (x.g, x.beta)]
    cu, state = torch.tensor(cu_seqlens, device=device), torch.tensor(S0, dtype=torch.float32, device=device)

    def call():
        return prefill(*tensors, cu_seqlens=cu, initial_state=state, output_final_state=True)

    call()  # compiles, makes the flags
    raise_if_flagged(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()  # warm-up on the capture's stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    other_lengths = (300, 0, 17, 1000, 1, 64, 65, 63)  # the same count and total, in another order
    y, other_cu, other_S0 = _gpu_packed(other_lengths, 2, 128, seed=34)
    for given, new in zip(tensors, (y.q, y.k, y.v, y.g, y.beta)):
        given.copy_(torch.tensor(new, dtype=given.dtype, device=device))
    cu.copy_(torch.tensor(other_cu, device=device))
    state.copy_(torch.tensor(other_S0, dtype=torch.float32, device=device))
    graph.replay()
    expected = call()
    for replayed, eager in zip(captured, expected):
        assert torch.equal(replayed, eager), "the replayed graph differs from the eager call"
    raise_if_flagged(device)
    cu.copy_(torch.tensor(other_cu[::-1].copy(), device=device))  # decreasing
    graph.replay()
    with pytest.raises(ValueError) as raised:
        raise_if_flagged(device)
    assert str(raised.value) == MESSAGES[BAD_CU_SEQLENS]


def test_the_compiled_pair_is_made_once_and_then_returned_without_threads(monkeypatch):
    """Starting compile_in_threads's two threads on every prefill cost 260 us of host time per call."""
    from stages.kda import compiled

    started = []

    def compile_in_threads(compilers, log=None):
        started.append(sorted(compilers))
        return {name: object() for name in compilers}

    monkeypatch.setattr(compiled, "compile_in_threads", compile_in_threads)
    arguments = (2, 64, 64, 64, 32, "a dtype only this test asks for", 2, True)
    first, second = compiled.compiled_prefill_kernels(*arguments), compiled.compiled_prefill_kernels(*arguments)
    assert started == [["prepare", "recurrence"]] and first == second
