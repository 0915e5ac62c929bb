"""Shared by stage 8's test files (test_s08_context_parallel, test_s08_distributed) and the ranks the
latter starts (s08_ranks): packed batches to split over ranks, and one device's answer, each sequence
alone through stage 6's reference A (token by token, paper layout: no code shared with stage 8)."""

from dataclasses import dataclass

import numpy as np

from stages.common.inputs import make_backward_inputs
from stages.s06_backward.reference import recurrent_backward

H, D_K, D_V = 2, 8, 6  # d_k != d_v: a state passed transposed fails on its shape
CHUNK_SIZE = 16
# T = 97: over 4 ranks (24, 24, 24, 25 tokens) the second sequence crosses three boundaries, the last
# crosses one, and an empty sequence sits between; over 3 or 7 ranks the boundaries fall elsewhere
PACKED = (13, 40, 5, 0, 39)
# T = 60: over 2 and 4 ranks the boundaries at 15 and 30 are sequence starts (nothing passes there)
AT_STARTS = (15, 15, 20, 10)
STRONG_GATE = -50.0  # a log gate that wipes a channel in one token


@dataclass
class Case:
    """A packed batch (B = 1) of float64 arrays, what a loss hands back, and the sequences' offsets."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    g: np.ndarray
    beta: np.ndarray
    do: np.ndarray  # dLoss/do (1, T, H, d_v)
    cu_seqlens: np.ndarray
    initial_state: np.ndarray | None  # (N_seq, H, d_k, d_v)
    d_final_state: np.ndarray  # dLoss/d(final states) (N_seq, H, d_k, d_v)

    @property
    def inputs(self):
        return self.q, self.k, self.v, self.g, self.beta


def make_case(lengths, seed, initial_state=True):
    """Gates a in [0.5, 1) with a full chunk of log gate -50 in one channel of one head and every
    third token at -50 in another; beta in [0, 1] with a quarter of it exactly 0 or 1."""
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    T, N_seq = int(cu_seqlens[-1]), len(lengths)
    x, do, _, _ = make_backward_inputs(1, T, H, D_K, D_V, seed=seed)
    x.g[0, :CHUNK_SIZE, 0, 1] = STRONG_GATE
    x.g[0, ::3, 1, 0] = STRONG_GATE
    rng = np.random.default_rng(seed + 1)
    S0 = rng.standard_normal((N_seq, H, D_K, D_V)) if initial_state else None
    return Case(x.q, x.k, x.v, x.g, x.beta, do, cu_seqlens, S0, rng.standard_normal((N_seq, H, D_K, D_V)))


def one_device(case):
    """(o, final states, dq, dk, dv, dg, dbeta, d_initial_state): each sequence alone through stage 6's
    reference A, from its initial state (zeros if None), with the loss <do, o> + <d_final_state, final>."""
    S0 = np.zeros(case.d_final_state.shape) if case.initial_state is None else case.initial_state
    o, finals = np.zeros(case.v.shape), S0.copy()
    grads = [np.zeros(x.shape) for x in case.inputs]
    d_initial = case.d_final_state.copy()  # an empty sequence hands its final state's gradient back
    for i, (start, end) in enumerate(zip(case.cu_seqlens[:-1], case.cu_seqlens[1:])):
        if end == start:
            continue
        rows = slice(start, end)
        alone = recurrent_backward(*(x[:, rows] for x in case.inputs), case.do[:, rows], S0[i:i + 1],
                                   case.d_final_state[i:i + 1])
        o[:, rows], finals[i], d_initial[i] = alone.o, alone.final_state[0], alone.d_initial_state[0]
        for grad, part in zip(grads, alone[:5]):
            grad[:, rows] = part
    return (o, finals, *grads, d_initial)
