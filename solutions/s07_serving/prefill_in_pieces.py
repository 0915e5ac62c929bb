"""Exercise s07.prefill_in_pieces (fix): chunked prefill, one prompt in pieces of any sizes.

A server bounds the tokens of one forward pass, so a long prompt is prefilled in pieces. Each piece
is one call of `forward`, a forward pass with an initial state in and a final state out (stage 7's
`chunkwise` with output_final_state, or the GPU's `prefill`); the pieces together must give what one
pass over the whole prompt gives: every output, and the state after the last token.

This function runs and looks right, and carries one known bug. Find it and fix it.
Read: stage 7 page, "Chunked prefill".  Check: course check s07
"""

from collections.abc import Callable

import numpy as np

from stages.common.checks import Float64Array


def prefill_in_pieces(forward: Callable, q: Float64Array, k: Float64Array, v: Float64Array, g: Float64Array,
                      beta: Float64Array, piece_lengths: list[int],
                      initial_state: Float64Array | None = None) -> tuple[Float64Array, Float64Array]:
    """B prompts of N tokens prefilled piece by piece, pieces of piece_lengths tokens (summing to N).

    forward(q, k, v, g, beta, initial_state) -> (o, final state): one forward pass. q, k, g: (B, N, H, d_k); v: (B, N, H, d_v); beta: (B, N, H); initial_state: (B, H, d_k, d_v) or
    None. Returns (o: (B, N, H, d_v), the state after the last piece: (B, H, d_k, d_v)).
    """
    if not len(piece_lengths) or min(piece_lengths) < 0 or sum(piece_lengths) != q.shape[1]:
        raise ValueError(f"piece_lengths must be one or more lengths >= 0 that sum to N = {q.shape[1]}, "
                         f"got {list(piece_lengths)}")
    state, outputs, start = initial_state, [], 0
    # EXERCISE BEGIN
    for length in piece_lengths:
        rows = slice(start, start + length)
        o, state = forward(*(x[:, rows] for x in (q, k, v, g, beta)), state)
        outputs.append(o)
        start += length
    # EXERCISE END
    return np.concatenate(outputs, axis=1), state
