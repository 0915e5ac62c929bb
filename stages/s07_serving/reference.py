"""Stage 7 references in NumPy float64: KDA as a server runs it, sequence by sequence from stored states.

    S_t = S_{t-1} Diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T        o_t = S_t q_t
                                                             (paper layout: S is d_v x d_k)

The math is stage 4's. What is new is the bookkeeping of a server, in FLA's conventions:

- a batch of sequences of different lengths, packed without padding: q, k, g (1, T, H, d_k),
  v (1, T, H, d_v), beta (1, T, H), and `cu_seqlens` (N_seq + 1,), the offsets of the sequences
  (sequence i is tokens cu_seqlens[i] to cu_seqlens[i + 1] - 1). Without cu_seqlens, each of the
  B rows of a (B, N, H, ...) batch is one sequence;
- a state in and a state out per sequence: `initial_state` S_0^T (N_seq, H, d_k, d_v) and, with
  `output_final_state`, the final states in the same shape, S^T in the kernel layout (d_k x d_v),
  the layout of stage 5's `initial_state` and of FLA's;
- the decode step, one token per sequence, over a pool of states (P, H, d_k, d_v) that `slots`
  index: sequence b reads and writes state_pool[slots[b]].

The three references, each checked against the one before:

- `recurrent` (A): every sequence token by token, through `decode_step`.
- `chunkwise` (B): every sequence alone through stage 5's reference C (prepare, then the recurrence
  from the sequence's initial state): the work of one call per sequence.
- `kernel_mirror` (C): the design of variable-length kernels, one pass over all the sequences. The
  prepare grid runs one program per row of a chunk table, program -> (sequence, chunk in sequence)
  (`chunk_table`); a program loads its chunk's rows from the sequence's offset, the rows past the
  sequence's end as zeros, and stores only the sequence's rows (`prepare_varlen`). The recurrence
  runs one program per (d_v block, sequence x head), which walks its own sequence's chunks from its
  initial state with the same masks (`recurrence_varlen`). A zero row is a token that changes
  nothing (k = v = 0, beta = 0, g = 0: the padding of stages 4 and 5), so a short last chunk is exact.

`prefill_in_pieces` is chunked prefill: one prompt prefilled in pieces, each piece starting from the
state the one before left. The `prefill` call of stages/kda/calls.py runs reference C's
design as two varlen kernels.

`verify_step` and `accept_drafts` are speculative decoding's verify pass: T drafted tokens per
sequence, each a decode step, with the state after each token kept aside until the target model has
scored them; then each sequence keeps the state after the drafts it accepted.

The decode step in the kernel layout is

    S^T <- (I - beta k k^T) Diag(a) S^T + beta k v^T                  o = (S^T)^T q

and the kernel computes it as a decay, one product and a rank-one write, never forming a d_k x d_k
matrix (expand the product: (I - beta k k^T) X + beta k v^T = X + k (beta (v - X^T k))^T):

    S^T <- Diag(e^g) S^T                       decay: row d of S^T is key channel d
    u    = beta (v - (S^T)^T k)                the new value minus what the state recalls for k
    S^T <- S^T + k u^T                         the delta-rule write
    o    = (S^T)^T q                           read with the updated state

q, k: (B, H, d_k); v: (B, H, d_v); g = log(a): (B, H, d_k); beta: (B, H). The token axis is gone:
one token per sequence.

The pool is updated in place, as a server's is: it holds every live sequence's state (P of them,
64 KiB per head at d_k = d_v = 128 in fp32), a step touches only B of them, and a copy of the whole
pool per step would move more memory than the step itself. The reference does what the kernel does,
so the two are tested through the same contract: the states at `slots` change, the others do not.
"""

from collections.abc import Callable

import numpy as np
from numpy.typing import DTypeLike

from stages.common.checks import (Float64Array, check_array, check_chunking, check_cu_seqlens, check_gate_and_beta,
                                  check_layout, check_log_gates, check_qkv, check_shaped, check_slots, check_values)
from stages.s05_fast_kda.reference import SUB_BLOCK, ChunkTensors, prepare, recurrence

CHUNK_FIELDS = ("w", "u", "q_decayed", "a_qk", "k_to_chunk_end")  # ChunkTensors' per-token tensors


# --8<-- [start:sequence_rows]
def sequence_rows(B: int, N: int, cu_seqlens: np.ndarray | None) -> list[tuple[int, slice]]:
    """Where each sequence of a batch lies: [(batch row, token rows)], one pair per sequence.

    Without cu_seqlens, row b of a (B, N, ...) batch is sequence b; with it (FLA's packed batch,
    B = 1), sequence i is tokens cu_seqlens[i] to cu_seqlens[i + 1] - 1 of the one row.
    """
    if cu_seqlens is None:
        return [(b, slice(0, N)) for b in range(B)]
    check_cu_seqlens(cu_seqlens, B, N)
    return [(0, slice(int(start), int(end))) for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:])]
# --8<-- [end:sequence_rows]


def initial_states(initial_state: Float64Array | None, N_seq: int, H: int, d_k: int, d_v: int) -> Float64Array:
    """A copy of initial_state (N_seq, H, d_k, d_v), S^T in the kernel layout, or zeros if None: the
    states a reference advances (the caller's array is never written)."""
    if initial_state is None:
        return np.zeros((N_seq, H, d_k, d_v))
    check_shaped("initial_state", initial_state, (N_seq, H, d_k, d_v),
                 f"(N_seq, H, d_k, d_v) = {(N_seq, H, d_k, d_v)}, one S^T per sequence in the kernel layout")
    return initial_state.copy()


def check_varlen_inputs(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                        cu_seqlens: np.ndarray | None,
                        initial_state: Float64Array | None) -> tuple[list[tuple[int, slice]], Float64Array]:
    """The inputs of a varlen reference (recurrent, chunkwise): returns (the sequences as sequence_rows
    gives them, their initial states as initial_states gives them)."""
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="channel")
    sequences = sequence_rows(B, N, cu_seqlens)
    return sequences, initial_states(initial_state, len(sequences), H, d_k, d_v)


# --8<-- [start:recurrent]
def recurrent(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
              cu_seqlens: np.ndarray | None = None, initial_state: Float64Array | None = None,
              output_final_state: bool = False) -> Float64Array | tuple[Float64Array, Float64Array]:
    """Reference A: every sequence token by token, each token a decode step. State S^T: (d_k, d_v).

    q, k: (B, N, H, d_k); v: (B, N, H, d_v); g: (B, N, H, d_k); beta: (B, N, H); B = 1 with
    cu_seqlens. Returns o (B, N, H, d_v), and with output_final_state also the final states
    (N_seq, H, d_k, d_v).
    """
    sequences, states = check_varlen_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    o = np.zeros(v.shape)
    for i, (b, rows) in enumerate(sequences):
        pool, slot = states[i:i + 1], np.zeros(1, dtype=np.int64)  # a pool of one: the view is advanced in place
        for t in range(rows.start, rows.stop):
            token = (x[b, t][None] for x in (q, k, v, g, beta))  # one token, batch of one
            o[b, t] = decode_step(*token, pool, slot)[0]
    return (o, states) if output_final_state else o
# --8<-- [end:recurrent]


# --8<-- [start:chunkwise]
def chunkwise(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
              chunk_size: int, cu_seqlens: np.ndarray | None = None, initial_state: Float64Array | None = None,
              output_final_state: bool = False) -> Float64Array | tuple[Float64Array, Float64Array]:
    """Reference B: every sequence alone through stage 5's prepare and recurrence, from its own state.

    Shapes as `recurrent`. Each sequence is cut out, padded to a multiple of chunk_size by stage 5's
    prepare, and its output cut back: the work of a batch of separate calls, one per sequence.
    """
    sequences, states = check_varlen_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    check_chunking(q.shape[1], v.shape[3], chunk_size)
    o = np.zeros(v.shape)
    for i, (b, rows) in enumerate(sequences):
        tensors = prepare(*(x[b:b + 1, rows] for x in (q, k, v, g, beta)), chunk_size, sub_block=chunk_size)
        o_padded, final_state = recurrence(tensors, v.shape[3], initial_state=states[i:i + 1])
        o[b, rows] = o_padded[0, :rows.stop - rows.start]
        states[i] = final_state[0]
    return (o, states) if output_final_state else o
# --8<-- [end:chunkwise]


# --8<-- [start:chunk_table]
def chunk_table(cu_seqlens: np.ndarray, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The chunks of a packed batch, the varlen kernels' index: (chunks, chunk_offsets).

    chunks (n_chunks, 2): row p is (sequence, chunk in the sequence) of program p of the prepare grid;
    chunk_offsets (N_seq + 1,): sequence i owns rows chunk_offsets[i] to chunk_offsets[i + 1] - 1, in
    order. A sequence of n tokens has ceil(n / chunk_size) chunks (none if it is empty).
    """
    chunk_counts = -(-np.diff(cu_seqlens) // chunk_size)
    chunk_offsets = np.concatenate([[0], np.cumsum(chunk_counts)])
    sequence = np.repeat(np.arange(len(chunk_counts)), chunk_counts)
    chunk_in_sequence = np.arange(chunk_offsets[-1]) - chunk_offsets[sequence]
    return np.stack([sequence, chunk_in_sequence], axis=1), chunk_offsets
# --8<-- [end:chunk_table]


# --8<-- [start:chunk_aligned_rows]
def chunk_aligned_rows(cu_seqlens: np.ndarray, chunk_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each token of a packed batch goes when every sequence starts a new chunk: (token_rows,
    chunk_offsets).

    In that layout of chunk_offsets[-1] * chunk_size rows (chunk_offsets as `chunk_table` gives it),
    sequence i starts at row chunk_size * chunk_offsets[i] and keeps its tokens in order: token_rows
    (T,) is each token's row, the packed rows shifted sequence by sequence. The rows no token takes,
    the end of each sequence's last chunk, hold zero tokens. No chunk holds two sequences: the varlen
    prepare writes this layout, row p * chunk_size on for row p of the chunk table.
    """
    _, chunk_offsets = chunk_table(cu_seqlens, chunk_size)
    starts = chunk_size * chunk_offsets[:-1]  # each sequence's first row in the layout
    token_rows = np.arange(cu_seqlens[-1]) + np.repeat(starts - cu_seqlens[:-1], np.diff(cu_seqlens))
    return token_rows, chunk_offsets
# --8<-- [end:chunk_aligned_rows]


def chunk_rows(x: np.ndarray, start: int, end: int, chunk_size: int) -> np.ndarray:
    """Rows start to end - 1 of x's token axis (axis 1), zero rows after them up to chunk_size: a
    kernel's masked load, which reads nothing of the next sequence."""
    rows = x[:, start:end]
    return np.pad(rows, [(0, 0), (0, chunk_size - rows.shape[1])] + [(0, 0)] * (x.ndim - 2))


# --8<-- [start:prepare_varlen]
def prepare_varlen(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                   cu_seqlens: np.ndarray, chunk_size: int, sub_block: int = SUB_BLOCK,
                   operand_dtype: DTypeLike = np.float64) -> ChunkTensors:
    """The varlen prepare kernel's control flow: one program per (row of the chunk table, head).

    q, k, g: (1, T, H, d_k), v: (1, T, H, d_v), beta: (1, T, H), packed by cu_seqlens. Returns
    ChunkTensors packed like the inputs, T rows (no padding stored), chunk_decay (1, n_chunks, H, d_k)
    indexed by the chunk table's rows.
    """
    B, T, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, T, H, d_k, gate="channel")
    check_cu_seqlens(cu_seqlens, B, T)
    check_chunking(T, d_v, chunk_size)
    C = chunk_size
    chunks, _ = chunk_table(cu_seqlens, C)
    out = ChunkTensors(np.zeros((1, T, H, d_k)), np.zeros((1, T, H, d_v)), np.zeros((1, T, H, d_k)),
                       np.zeros((1, T, H, d_k)), np.zeros((1, T, H, C)), np.zeros((1, len(chunks), H, d_k)))
    # grid.x: the chunk table's rows (grid.y, the heads, inside stage 5's prepare). Programs run in
    # no set order: walked backwards, a store past a sequence's end lands on rows already written.
    for p in reversed(range(len(chunks))):
        sequence, chunk = chunks[p]
        start = cu_seqlens[sequence] + chunk * C  # token offset: the sequence's start, then whole chunks
        end = min(start + C, cu_seqlens[sequence + 1])  # a sequence's last chunk may be short
        tile = (chunk_rows(x, start, end, C) for x in (q, k, v, g, beta))  # masked load: zeros past the end
        one = prepare(*tile, C, sub_block, operand_dtype)  # stage 5's program on one chunk
        for field in CHUNK_FIELDS:  # masked store: the rows past the end are the next sequence's
            getattr(out, field)[0, start:end] = getattr(one, field)[0, :end - start]
        out.chunk_decay[0, p] = one.chunk_decay[0, 0]
    return out
# --8<-- [end:prepare_varlen]


# --8<-- [start:recurrence_varlen]
def recurrence_varlen(tensors: ChunkTensors, cu_seqlens: np.ndarray, block_dv: int,
                      initial_state: Float64Array | None = None) -> tuple[Float64Array, Float64Array]:
    """The varlen recurrence kernel's control flow: one program per (block of d_v columns, sequence x head).

    tensors: from `prepare_varlen`; initial_state: S_0^T (N_seq, H, d_k, d_v) or None for zeros.
    Returns (o: (1, T, H, d_v), the final states S^T: (N_seq, H, d_k, d_v)).
    """
    _, T, H, d_k = tensors.w.shape
    d_v, C = tensors.u.shape[3], tensors.a_qk.shape[3]
    N_seq = check_cu_seqlens(cu_seqlens, 1, T)
    check_chunking(T, d_v, C, block_dv)
    initial = initial_states(initial_state, N_seq, H, d_k, d_v)
    _, chunk_offsets = chunk_table(cu_seqlens, C)
    o, final_state = np.zeros((1, T, H, d_v)), np.zeros((N_seq, H, d_k, d_v))
    for i_v in range(d_v // block_dv):  # grid.x: one program per block of value columns
        cols = slice(i_v * block_dv, (i_v + 1) * block_dv)
        for i_nh in reversed(range(N_seq * H)):  # grid.y: one program per (sequence, head), last first
            sequence, h = divmod(i_nh, H)
            S_T = initial[sequence, h][:, cols].copy()
            for chunk in range(chunk_offsets[sequence + 1] - chunk_offsets[sequence]):  # its own chunks
                start = cu_seqlens[sequence] + chunk * C
                end = min(start + C, cu_seqlens[sequence + 1])
                # masked loads of this head's rows: zeros past the sequence's end
                W, U, Q_decayed, A_qk, K_to_chunk_end = (
                    chunk_rows(getattr(tensors, field), start, end, C)[0, :, h] for field in CHUNK_FIELDS)
                V_new = U[:, cols] - W @ S_T  # GEMM: the pseudo-values (zero rows past the end)
                acc_o = Q_decayed @ S_T  # GEMM: the inter-chunk term
                acc_o += A_qk @ V_new  # GEMM: the intra-chunk term, accumulated
                o[0, start:end, h, cols] = acc_o[:end - start]  # masked store
                S_T *= tensors.chunk_decay[0, chunk_offsets[sequence] + chunk, h][:, None]  # the decay ...
                S_T += K_to_chunk_end.T @ V_new  # ... then the chunk (GEMM)
            final_state[sequence, h, :, cols] = S_T
    return o, final_state
# --8<-- [end:recurrence_varlen]


# --8<-- [start:kernel_mirror]
def kernel_mirror(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                  chunk_size: int, block_dv: int, cu_seqlens: np.ndarray | None = None,
                  initial_state: Float64Array | None = None, output_final_state: bool = False,
                  sub_block: int = SUB_BLOCK) -> Float64Array | tuple[Float64Array, Float64Array]:
    """Reference C: the varlen prepare kernel, then the varlen recurrence kernel. Shapes as `recurrent`.

    Without cu_seqlens the B rows of N tokens are packed into one row with cu_seqlens = 0, N, 2N,
    ..., BN: an equal-length batch is the packed batch whose sequences are all N long.
    """
    B, N, H, d_k, d_v = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, N, H, d_k, gate="channel")
    check_chunking(N, d_v, chunk_size, block_dv)
    packed = cu_seqlens is None
    if packed:
        q, k, v, g, beta = (x.reshape(1, B * N, *x.shape[2:]) for x in (q, k, v, g, beta))
        cu_seqlens = np.arange(B + 1) * N
    tensors = prepare_varlen(q, k, v, g, beta, cu_seqlens, chunk_size, sub_block)
    o, final_state = recurrence_varlen(tensors, cu_seqlens, block_dv, initial_state)
    o = o.reshape(B, N, H, d_v)
    return (o, final_state) if output_final_state else o
# --8<-- [end:kernel_mirror]


# --8<-- [start:prefill_in_pieces]
def prefill_in_pieces(forward: Callable, q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array,
                      beta: Float64Array, piece_lengths: list[int],
                      initial_state: Float64Array | None = None) -> tuple[Float64Array, Float64Array]:
    """Chunked prefill: B prompts of N tokens prefilled piece by piece, pieces of piece_lengths tokens
    (any sizes, summing to N), as a server does when it bounds the tokens of one forward pass.

    forward(q, k, v, g, beta, initial_state) -> (o, final state): one forward pass with a state in
    and out (`chunkwise` with output_final_state, or the GPU's `prefill`). q, k, g: (B, N, H, d_k);
    v: (B, N, H, d_v); beta: (B, N, H); initial_state: (B, H, d_k, d_v) or None. Returns
    (o: (B, N, H, d_v), the state after the last piece: (B, H, d_k, d_v)).
    """
    if not len(piece_lengths) or min(piece_lengths) < 0 or sum(piece_lengths) != q.shape[1]:
        raise ValueError(f"piece_lengths must be one or more lengths >= 0 that sum to N = {q.shape[1]}, "
                         f"got {list(piece_lengths)}")
    state, outputs, start = initial_state, [], 0
    # EXERCISE BEGIN
    for length in piece_lengths:
        rows = slice(start, start + length)
        o, state = forward(*(x[:, rows] for x in (q, k, v, g, beta)), state)  # from where the last piece stopped
        outputs.append(o)
        start += length
    # EXERCISE END
    return np.concatenate(outputs, axis=1), state
# --8<-- [end:prefill_in_pieces]


def check_decode_inputs(q, k, v, g, beta, state_pool, slots):
    """The shapes of one decode step; returns (B, H, d_k, d_v, P). Every array float64, the token's
    finite, g <= 0, beta in [0, 1], slots in [0, P) and distinct. The pool's values are not read, as
    the kernel does not read them to check: they are the server's own results (a state that overflowed
    is what the recurrence computed), and a scan of every live state would cost more than the
    step itself."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_array(name, x, 3, "(B, H, D): one token per sequence")
    if tuple(k.shape) != tuple(q.shape):
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    B, H, d_k = q.shape
    if tuple(v.shape[:2]) != (B, H):
        raise ValueError(f"v must be (B, H, d_v) = ({B}, {H}, d_v), got {tuple(v.shape)}")
    d_v = v.shape[2]
    check_shaped("g", g, (B, H, d_k), f"(B, H, d_k) = {(B, H, d_k)}")
    check_log_gates("g", g)
    check_shaped("beta", beta, (B, H), f"(B, H) = {(B, H)}")
    check_values("beta", beta, 0.0, 1.0, "beta must lie in [0, 1]")
    check_layout("state_pool", state_pool, 4, "(P, H, d_k, d_v)")
    if tuple(state_pool.shape[1:]) != (H, d_k, d_v):
        raise ValueError(f"state_pool must be (P, H, d_k, d_v) = (P, {H}, {d_k}, {d_v}), S^T in the kernel layout, "
                         f"got {tuple(state_pool.shape)}")
    P = state_pool.shape[0]
    check_slots(slots, B, P)
    return B, H, d_k, d_v, P


# --8<-- [start:decode_step]
def decode_step(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                state_pool: Float64Array, slots: np.ndarray) -> Float64Array:
    """One token per sequence: advance state_pool[slots[b]] (S^T, the kernel layout) by the token
    and return o: (B, H, d_v). The pool is updated in place; every input is checked first, so a
    refused call leaves it as it was."""
    B, H, d_k, d_v, _ = check_decode_inputs(q, k, v, g, beta, state_pool, slots)
    o = np.zeros((B, H, d_v))
    for b in range(B):
        for h in range(H):
            k_t, beta_t = k[b, h], beta[b, h]
            # EXERCISE BEGIN
            slot = slots[b]  # where sequence b's state lives: its slot, not its place in the batch
            S_T = state_pool[slot, h]  # (d_k, d_v)
            decay = np.diag(np.exp(g[b, h]))  # Diag(a_t): one rate per key channel, a row of S^T
            householder = np.eye(d_k) - beta_t * np.outer(k_t, k_t)
            # stage 4's S Diag(a)(I - beta k k^T), transposed: the Householder factor acts last
            S_T = householder @ decay @ S_T + beta_t * np.outer(k_t, v[b, h])
            o[b, h] = S_T.T @ q[b, h]
            state_pool[slot, h] = S_T  # back where it came from
            # EXERCISE END
    return o
# --8<-- [end:decode_step]


# --8<-- [start:verify_step]
def verify_step(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                state_pool: Float64Array, slots: np.ndarray) -> tuple[Float64Array, Float64Array]:
    """Speculative decoding's verify pass: T drafted tokens per sequence, token t a decode step from
    the state token t - 1 left, sequence b starting from state_pool[slots[b]] (S^T, the kernel layout).

    q, k, g: (B, T, H, d_k); v: (B, T, H, d_v); beta: (B, T, H), T >= 1. Returns (o (B, T, H, d_v),
    the state after each drafted token (B, T, H, d_k, d_v)). The pool is not written: which state a
    sequence keeps is known only once the target model has scored the outputs (`accept_drafts`).
    """
    B, T, H, d_k, _ = check_qkv(q, k, v)
    check_gate_and_beta(g, beta, B, T, H, d_k, gate="channel")
    if T == 0:
        raise ValueError("a verify pass takes at least one drafted token per sequence, got T = 0")
    check_decode_inputs(*(x[:, 0] for x in (q, k, v, g, beta)), state_pool, slots)
    scratch = state_pool[slots]  # a copy, (B, H, d_k, d_v): a pool of B states, sequence b at slot b
    o, drafted_states = np.zeros(v.shape), np.zeros((B, T, *scratch.shape[1:]))
    for t in range(T):
        o[:, t] = decode_step(*(x[:, t] for x in (q, k, v, g, beta)), scratch, np.arange(B))
        drafted_states[:, t] = scratch  # the state after drafted token t, kept in case it is the last accepted
    return o, drafted_states


def accept_drafts(state_pool: Float64Array, slots: np.ndarray, drafted_states: Float64Array,
                  accepted: np.ndarray) -> None:
    """After `verify_step`: sequence b keeps the state after its first accepted[b] drafted tokens,
    state_pool[slots[b]] <- drafted_states[b, accepted[b] - 1], in place; accepted[b] = 0 keeps the
    state from before the drafts. drafted_states: (B, T, H, d_k, d_v); accepted: (B,) integers in [0, T].
    Every input is checked first, so a refused call leaves the pool as it was."""
    check_array("state_pool", state_pool, 4, "(P, H, d_k, d_v)")
    check_array("drafted_states", drafted_states, 5, "(B, T, H, d_k, d_v)")
    P, H, d_k, d_v = state_pool.shape
    B, T = drafted_states.shape[:2]
    if tuple(drafted_states.shape[2:]) != (H, d_k, d_v):
        raise ValueError(f"drafted_states must be (B, T, H, d_k, d_v) = (B, T, {H}, {d_k}, {d_v}), the pool's "
                         f"states, got {tuple(drafted_states.shape)}")
    check_slots(slots, B, P)
    if not (isinstance(accepted, np.ndarray) and np.issubdtype(accepted.dtype, np.integer)
            and accepted.shape == (B,)):
        raise ValueError(f"accepted must be an integer numpy.ndarray of shape (B,) = ({B},), one count per sequence")
    if B and (accepted.min() < 0 or accepted.max() > T):
        raise ValueError(f"accepted must lie in [0, T] = [0, {T}], got [{accepted.min()}, {accepted.max()}]")
    for b in range(B):
        if accepted[b]:  # none accepted: the slot already holds the state from before the drafts
            state_pool[slots[b]] = drafted_states[b, accepted[b] - 1]
# --8<-- [end:verify_step]
