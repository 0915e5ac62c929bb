"""Exercise s08.pass_states (fix): the pass of states from rank to rank.

A sequence split over R ranks: rank r holds a contiguous part of its tokens, and each rank has run its
part from a zero state. Its tokens act on the state it starts from, S_r (S^T, the kernel layout), as
one affine map: they hand on A_r S_r + Z_r, where A_r = transitions[r] (H, d_k, d_k) is the product of
the tokens' factors and Z_r = zero_states[r] (H, d_k, d_v) the rank's final state from zero. The pass
gives every rank the state it starts from, S_0 = initial_state, S_1, ..., S_{R-1}, and the state after
the last rank: what one device running the whole sequence would have had at each boundary.

The distributed implementation runs this same function, one rank's step at a time or over every
rank's summary, on torch tensors: use only `@`, `+` and indexing, which NumPy arrays and torch tensors
share.

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 8 page, "The pass of states".  Check: course check s08
"""


def pass_states(transitions, zero_states, initial_state):
    """The state each rank starts from, rank after rank (S^T, the kernel layout).

    transitions: (R, H, d_k, d_k), A_r; zero_states: (R, H, d_k, d_v), Z_r; initial_state:
    (H, d_k, d_v), S_0. Returns (a list of the R states S_0, ..., S_{R-1}, each (H, d_k, d_v); the
    state after the last rank, (H, d_k, d_v)). Rank r hands on A_r S_r + Z_r.
    """
    incoming, state = [], initial_state
    # EXERCISE BEGIN
    for transition, zero_state in zip(transitions, zero_states, strict=True):
        incoming.append(state)
        state = transition @ state + zero_state
    # EXERCISE END
    return incoming, state
