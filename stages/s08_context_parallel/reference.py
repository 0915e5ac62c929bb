"""Stage 8 references in NumPy float64: KDA split over R ranks, each rank holding a contiguous part of the tokens.

    S_t = S_{t-1} Diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T        o_t = S_t q_t
                                                             (paper layout: S is d_v x d_k)

The math is stage 4's and the batch is stage 7's packed row (q, k, g (1, T, H, d_k), v (1, T, H, d_v),
beta (1, T, H), `cu_seqlens`); what is new is that the T tokens are cut into R contiguous parts, rank r
holding tokens boundaries[r] to boundaries[r + 1] - 1 (FLA's cp_context convention: `split_over_ranks`).
A sequence may cross a boundary, or several: the rank after the boundary must start it from the state
the rank before left, which that rank knows only once it has run its own tokens.

In the kernel layout (S^T, d_k x d_v) one token is S^T <- F_t S^T + beta_t k_t v_t^T with
F_t = (I - beta_t k_t k_t^T) Diag(a_t), so a rank's n tokens act on the state it starts from as one
affine map:

    S_out^T = A S_in^T + Z,   A = F_n ... F_2 F_1 (d_k x d_k),   Z = the rank's final state from zero

(paper layout: S_out = S_in M + Z^T with M = A^T = Diag(a_1)(I - beta_1 k_1 k_1^T) ... Diag(a_n)(...)).
Its outputs are affine in S_in too: o_t = o_t(from zero) + (F_t ... F_1 S_in^T)^T q_t, the incoming
state carried to token t and read by q_t. So the ranks work at once, from zero, and meet only at their
boundaries:

    1. each rank alone: its outputs and final state from zero, and its map A (`transition_map`);
    2. the pass: S_in of rank r + 1 = A_r S_in of rank r + Z_r, rank after rank (`pass_states`), or as a
       scan over ranks in ceil(log2 R) rounds (`scan_states`);
    3. each rank's correction: the outputs its incoming state adds (`state_correction`, stage 5's
       recurrence with the values removed: Q e^gamma S_in^T, and the WY term through A_qk and W; no
       d_k x d_k map is formed for it).

The references, each checked against one device's pass:

- `recurrent` (A): the ranks in turn, each running its sequences token by token (stage 7's reference A)
  from the states the rank before it left: the sequential pass with all the work in it.
- `chunkwise` (B): the three steps above on stage 5's chunk tensors.
- `chunkwise_backward` (B, backward): the same three steps in reverse; the gradient of a rank's
  incoming state flows back rank by rank through the transposed maps (`pass_state_gradients`).

A rank whose last sequence begins on it hands on a state that does not depend on what it received: its
map is zero. Ranks whose boundary no sequence crosses pass nothing (their map and state are zero), so
one pass over all ranks serves a packed batch whatever its sequences.
"""

import dataclasses
from typing import NamedTuple

import numpy as np

from stages.common.checks import Float64Array, check_chunking, check_cu_seqlens, check_output_gradient, check_positive_integer
from stages.s05_fast_kda.reference import ChunkTensors, prepare, recurrence
from stages.s06_backward.reference import Gradients
from stages.s06_backward.reference import chunkwise_backward as sequence_backward
from stages.s07_serving.reference import check_varlen_inputs
from stages.s07_serving.reference import recurrent as packed_recurrent


# --8<-- [start:split_over_ranks]
class RankPart(NamedTuple):
    """One rank's share of a packed batch: what FLA's cp_context holds for a rank."""

    tokens: slice  # its rows of the packed batch
    cu_seqlens: np.ndarray  # (n_local + 1,) its sequences' offsets in its own rows, from 0
    sequences: range  # the indices of its sequences in the whole batch, first to last
    receives: bool  # its first sequence began on an earlier rank: it starts from the state handed to it
    sends: bool  # its last sequence goes on after its last token: it hands the state on to the next rank


def rank_boundaries(T: int, ranks: int) -> np.ndarray:
    """(ranks + 1,) token offsets: rank r holds tokens boundaries[r] to boundaries[r + 1] - 1, the T
    tokens split as evenly as they go (the parts differ by at most one token)."""
    check_positive_integer("ranks", ranks)
    if T < ranks:
        raise ValueError(f"every rank needs a token: T = {T} tokens cannot be split over {ranks} ranks")
    return np.arange(ranks + 1) * T // ranks


def split_over_ranks(cu_seqlens: np.ndarray, ranks: int) -> list[RankPart]:
    """The packed batch cut by `rank_boundaries` into `ranks` parts, one RankPart each.

    A sequence belongs to every rank it has tokens on; an empty one to the rank its offset falls on
    (the last rank at the batch's end). A boundary lies inside a sequence, and the rank after it
    receives a state, unless a sequence starts there.
    """
    T = int(cu_seqlens[-1]) if isinstance(cu_seqlens, np.ndarray) and cu_seqlens.size else 0
    check_cu_seqlens(cu_seqlens, 1, T)
    boundaries = rank_boundaries(T, ranks)
    starts, ends = cu_seqlens[:-1], cu_seqlens[1:]
    parts = []
    for r, (low, high) in enumerate(zip(boundaries[:-1], boundaries[1:])):
        last_rank = r == ranks - 1
        local = [i for i, (start, end) in enumerate(zip(starts, ends))
                 if (start < high and end > low)  # it has tokens here
                 or (start == end and (low <= start < high or (last_rank and start == T)))]  # empty, here
        offsets = np.clip(cu_seqlens[local[0]:local[-1] + 2], low, high) - low
        parts.append(RankPart(slice(int(low), int(high)), offsets, range(local[0], local[-1] + 1),
                              receives=r > 0 and low not in cu_seqlens,
                              sends=not last_rank and high not in cu_seqlens))
    return parts
# --8<-- [end:split_over_ranks]


# --8<-- [start:recurrent]
def recurrent(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
              cu_seqlens: np.ndarray, ranks: int, initial_state: Float64Array | None = None,
              output_final_state: bool = False) -> Float64Array | tuple[Float64Array, Float64Array]:
    """Reference A: the ranks in turn, each running its sequences token by token (stage 7's reference A)
    from the states the ranks before it left. State S^T: (d_k, d_v).

    q, k, g: (1, T, H, d_k); v: (1, T, H, d_v); beta: (1, T, H); cu_seqlens (N_seq + 1,) of the whole
    batch; initial_state: (N_seq, H, d_k, d_v) or None. Returns o (1, T, H, d_v), and with
    output_final_state the final states (N_seq, H, d_k, d_v).
    """
    _, states = check_varlen_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    o = np.zeros(v.shape)
    for part in split_over_ranks(cu_seqlens, ranks):
        local = (x[:, part.tokens] for x in (q, k, v, g, beta))
        # a sequence that began before this rank's first token is where the rank before left it
        o[:, part.tokens], states[part.sequences] = packed_recurrent(
            *local, part.cu_seqlens, states[part.sequences], output_final_state=True)
    return (o, states) if output_final_state else o
# --8<-- [end:recurrent]


# --8<-- [start:transition_map]
def transition_map(tensors: ChunkTensors) -> Float64Array:
    """A = F_n ... F_1 (H, d_k, d_k), F_t = (I - beta_t k_t k_t^T) Diag(a_t): the map one sequence's
    tokens apply to the state S^T they start from, composed chunk by chunk from stage 5's tensors
    (B = 1). One chunk's recurrence step, S^T <- Diag(e^{gamma_C}) S^T + K_to_chunk_end^T (U - W S^T),
    is S^T <- (Diag(e^{gamma_C}) - K_to_chunk_end^T W) S^T + (a term without S): that matrix is the
    chunk's map. Zero-padded tokens (k = 0, g = 0, beta = 0) are the identity.
    """
    _, N_padded, H, d_k = tensors.w.shape
    C = tensors.a_qk.shape[3]
    A = np.tile(np.eye(d_k), (H, 1, 1))
    for i_c in range(N_padded // C):
        rows = slice(i_c * C, (i_c + 1) * C)
        for h in range(H):
            chunk_map = np.diag(tensors.chunk_decay[0, i_c, h]) - tensors.k_to_chunk_end[0, rows, h].T @ tensors.w[0, rows, h]
            A[h] = chunk_map @ A[h]  # the later chunk acts last
    return A
# --8<-- [end:transition_map]


# --8<-- [start:state_correction]
def state_correction(tensors: ChunkTensors, incoming: Float64Array) -> tuple[Float64Array, Float64Array]:
    """What the incoming state S_in^T (1, H, d_k, d_v) adds to one sequence's pass from zero: the
    outputs (1, N_padded, H, d_v) and the final state A S_in^T (1, H, d_k, d_v).

    Both are affine in the state, so the addition is the pass with the values removed (U = 0), from
    S_in: in each chunk, Q e^gamma S^T (the state read by the decayed queries) plus A_qk (-W S^T) (the
    WY term: what the chunk's own writes remove from the state first), then the state carried to the
    next chunk. It reads the rank's per-token tensors, never a d_k x d_k map.
    """
    without_values = dataclasses.replace(tensors, u=np.zeros_like(tensors.u))
    return recurrence(without_values, block_dv=tensors.u.shape[3], initial_state=incoming)
# --8<-- [end:state_correction]


# --8<-- [start:pass_states]
def pass_states(transitions, zero_states, initial_state):
    """The pass: the state each rank starts from, rank after rank (S^T, the kernel layout).

    Rank r's tokens carry the state it starts from, S_r, to A_r S_r + Z_r (A_r = transitions[r]
    (H, d_k, d_k), Z_r = zero_states[r] (H, d_k, d_v): its final state from zero). Returns (the list
    of the R states S_0 = initial_state, S_1, ..., S_{R-1}, each (H, d_k, d_v); the state after the
    last rank). NumPy arrays or torch tensors alike.
    """
    incoming, state = [], initial_state
    # EXERCISE BEGIN
    for transition, zero_state in zip(transitions, zero_states, strict=True):
        incoming.append(state)  # what this rank starts from: what the ranks before it left
        state = transition @ state + zero_state  # carried through this rank's tokens, plus what they wrote
    # EXERCISE END
    return incoming, state
# --8<-- [end:pass_states]


# --8<-- [start:pass_state_gradients]
def pass_state_gradients(transitions, incoming_gradients, final_gradient):
    """The pass backwards: the gradient of the state each rank hands on, rank after rank from the last.

    For L = sum of the ranks' losses: dL/dS_r = incoming_gradients[r] (the gradient of rank r's
    incoming state through its own outputs, (H, d_k, d_v)) + A_r^T dL/dS_{r+1}, the state it hands on
    being A_r S_r + Z_r; final_gradient is dL/dS after the last rank. Returns (the list of R gradients
    of the states the ranks hand on, dL/dS_{r+1} for rank r; dL/dS_0, the first rank's incoming state).
    """
    outgoing, gradient = [None] * len(transitions), final_gradient
    for r in reversed(range(len(transitions))):
        outgoing[r] = gradient
        gradient = transitions[r].swapaxes(-1, -2) @ gradient + incoming_gradients[r]
    return outgoing, gradient
# --8<-- [end:pass_state_gradients]


# --8<-- [start:scan_states]
def scan_states(transitions, zero_states, initial_state):
    """`pass_states` as a scan: ceil(log2 R) rounds, in each of which every rank composes its map with
    the map of the rank `step` before it (all at once), so that after the last round rank r holds the map
    of ranks 0 to r. Composing two maps, earlier then later, is (A_l A_e, A_l Z_e + Z_l): a d_k x d_k
    by d_k x (d_k + d_v) product per head. Returns what `pass_states` returns."""
    maps = list(zip(transitions, zero_states, strict=True))  # rank r: S -> A S + Z
    step = 1
    while step < len(maps):
        maps = [maps[r] if r < step else _compose(maps[r - step], maps[r]) for r in range(len(maps))]
        step *= 2
    after = [A @ initial_state + Z for A, Z in maps]  # the state after rank r
    return [initial_state] + after[:-1], after[-1]


def _compose(earlier, later):
    """The map of two consecutive ranks: S -> A_l (A_e S + Z_e) + Z_l."""
    (A_e, Z_e), (A_l, Z_l) = earlier, later
    return A_l @ A_e, A_l @ Z_e + Z_l
# --8<-- [end:scan_states]


class RankPass(NamedTuple):
    """What `chunkwise` keeps of a rank between the steps: its zero-start outputs and final states, its
    first sequence's chunk tensors (for the correction) and its summary for the pass."""

    o: Float64Array  # (1, n_tokens, H, d_v), from the states it knows (zero for a sequence it receives)
    final_states: Float64Array  # (n_local, H, d_k, d_v)
    first_tensors: ChunkTensors
    transition: Float64Array  # (H, d_k, d_k): the map from what it receives to what it hands on
    zero_state: Float64Array  # (H, d_k, d_v): what it hands on from a zero incoming state


# --8<-- [start:rank_alone]
def rank_alone(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
               part: RankPart, initial_states: Float64Array, chunk_size: int) -> RankPass:
    """Step 1 on one rank, with nothing from the others: each of its sequences through stage 5's prepare
    and recurrence from its own initial state (initial_states: (n_local, H, d_k, d_v)), the one it
    receives from zero. q, k, g: (1, n, H, d_k), v: (1, n, H, d_v), beta: (1, n, H), its tokens."""
    H, d_k, d_v = q.shape[2], q.shape[3], v.shape[3]
    o, finals, tensors = np.zeros(v.shape), np.zeros((len(part.sequences), H, d_k, d_v)), []
    # sub_block=1: every key a slab of its own, so no exponent spans more than one token's gate and any
    # gate <= 0 runs in float64 (chunk_kda's CPU path does the same)
    for i, (start, end) in enumerate(zip(part.cu_seqlens[:-1], part.cu_seqlens[1:])):
        rows = slice(start, end)
        tensors.append(prepare(*(x[:, rows] for x in (q, k, v, g, beta)), chunk_size, sub_block=1))
        start_state = np.zeros((1, H, d_k, d_v)) if i == 0 and part.receives else initial_states[i:i + 1]
        o_padded, final = recurrence(tensors[i], d_v, initial_state=start_state)
        o[:, rows], finals[i] = o_padded[:, :end - start], final[0]
    transition, zero_state = np.zeros((H, d_k, d_k)), np.zeros((H, d_k, d_v))  # hands nothing on
    if part.sends:
        zero_state = finals[-1].copy()
        if part.receives and len(part.sequences) == 1:  # one sequence through the whole rank
            transition = transition_map(tensors[0])
    return RankPass(o, finals, tensors[0], transition, zero_state)
# --8<-- [end:rank_alone]


def forward_over_ranks(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                       cu_seqlens: np.ndarray, ranks: int, chunk_size: int,
                       initial_state: Float64Array | None = None):
    """Reference B's three steps; returns (o, final states, the parts, the passes, the incoming states).
    Shapes as `chunkwise`."""
    _, states = check_varlen_inputs(q, k, v, g, beta, cu_seqlens, initial_state)
    check_chunking(q.shape[1], v.shape[3], chunk_size)
    parts = split_over_ranks(cu_seqlens, ranks)
    # 1. every rank alone (in parallel on R devices)
    passes = [rank_alone(*(x[:, part.tokens] for x in (q, k, v, g, beta)), part, states[part.sequences], chunk_size)
              for part in parts]
    # 2. the pass: small, sequential
    incoming, _ = pass_states([p.transition for p in passes], [p.zero_state for p in passes], np.zeros(states.shape[1:]))
    # 3. every rank's correction (in parallel)
    o = np.zeros(v.shape)
    for part, rank_pass, state in zip(parts, passes, incoming):
        o[:, part.tokens], finals = rank_pass.o, rank_pass.final_states
        if part.receives:
            first = slice(part.tokens.start, part.tokens.start + part.cu_seqlens[1])
            o_correction, carried = state_correction(rank_pass.first_tensors, state[None])
            o[:, first] += o_correction[:, :first.stop - first.start]
            finals[0] += carried[0]
        ending_here = part.sequences[:-1] if part.sends else part.sequences
        states[ending_here] = finals[:len(ending_here)]
    return o, states, parts, passes, incoming


# --8<-- [start:chunkwise]
def chunkwise(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
              cu_seqlens: np.ndarray, ranks: int, chunk_size: int, initial_state: Float64Array | None = None,
              output_final_state: bool = False) -> Float64Array | tuple[Float64Array, Float64Array]:
    """Reference B: each rank alone from zero, the pass of states, each rank's correction. State S^T.

    Shapes as `recurrent`; chunk_size: stage 5's chunks, within each sequence of each rank.
    """
    o, final_states, *_ = forward_over_ranks(q, k, v, g, beta, cu_seqlens, ranks, chunk_size, initial_state)
    return (o, final_states) if output_final_state else o
# --8<-- [end:chunkwise]


# --8<-- [start:chunkwise_backward]
def chunkwise_backward(q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array, beta: Float64Array,
                       do: Float64Array, cu_seqlens: np.ndarray, ranks: int, chunk_size: int,
                       initial_state: Float64Array | None = None,
                       d_final_state: Float64Array | None = None) -> Gradients:
    """Reference B backwards: the gradients of L = <do, o> + <d_final_state, final states>.

    Shapes as `recurrent`; do: (1, T, H, d_v); d_final_state: (N_seq, H, d_k, d_v) or None. Each
    sequence of each rank runs stage 6's reference B at the state it started from in the forward (the
    incoming state for the one it received). The steps of the forward, reversed:

        1. each rank alone: its gradients with a zero gradient on the state it hands on, which gives
           the gradient of its incoming state through its own outputs;
        2. the pass backwards (`pass_state_gradients`), from the last rank: the gradient of the state
           each rank hands on;
        3. each rank that hands a state on: the gradients that one adds (its sequence again, with
           do = 0 and that gradient on its final state).

    Returns stage 6's Gradients (d_initial_state: (N_seq, H, d_k, d_v); o, final_state: the forward's).
    """
    o, final_states, parts, passes, incoming = forward_over_ranks(q, k, v, g, beta, cu_seqlens, ranks, chunk_size,
                                                                  initial_state)
    check_output_gradient(do, *v.shape)
    N_seq, H, d_k, d_v = final_states.shape
    starts = np.zeros(final_states.shape) if initial_state is None else initial_state
    d_finals = np.zeros(final_states.shape) if d_final_state is None else d_final_state
    grads = [np.zeros(x.shape) for x in (q, k, v, g, beta)]
    d_initial = np.zeros(final_states.shape)

    def sequence(part, i, start_state, d_o, d_final):
        """Stage 6's reference B on local sequence i of `part`; adds to grads, returns dS_0^T (H, d_k, d_v)."""
        rows = slice(part.tokens.start + part.cu_seqlens[i], part.tokens.start + part.cu_seqlens[i + 1])
        result = sequence_backward(*(x[:, rows] for x in (q, k, v, g, beta)), d_o[:, rows], chunk_size,
                                   initial_state=start_state[None], d_final_state=d_final[None])
        for grad, part_grad in zip(grads, result[:5]):
            grad[:, rows] += part_grad
        return result.d_initial_state[0]

    # 1. every rank alone: the state it hands on gets no gradient yet
    summaries = []
    for part, rank_pass, state in zip(parts, passes, incoming):
        through_own_outputs = np.zeros((H, d_k, d_v))
        for i, seq in enumerate(part.sequences):
            received, sent = i == 0 and part.receives, part.sends and i == len(part.sequences) - 1
            d_start = sequence(part, i, state if received else starts[seq], do,
                               np.zeros((H, d_k, d_v)) if sent else d_finals[seq])
            if received:
                through_own_outputs = d_start  # the incoming state's gradient, for the rank before
            else:
                d_initial[seq] += d_start
        transition = rank_pass.transition if part.receives else np.zeros((H, d_k, d_k))
        summaries.append((transition, through_own_outputs))
    # 2. the pass backwards
    outgoing, _ = pass_state_gradients([s[0] for s in summaries], [s[1] for s in summaries], np.zeros((H, d_k, d_v)))
    # 3. what the gradient of the state handed on adds, on the ranks that hand one on
    for part, state, d_outgoing in zip(parts, incoming, outgoing):
        if part.sends:
            i, seq = len(part.sequences) - 1, part.sequences[-1]
            received = i == 0 and part.receives
            d_start = sequence(part, i, state if received else starts[seq], np.zeros(do.shape), d_outgoing)
            if not received:  # else the pass has carried it back already: it is A^T times d_outgoing
                d_initial[seq] += d_start
    return Gradients(*grads, d_initial, o, final_states)
# --8<-- [end:chunkwise_backward]
