"""Stage 6 library tests: the gradient references A (token by token) and B (chunk by chunk) against
torch.autograd of a float64 torch transcription of reference A, and B against A."""

import numpy as np
import pytest
import torch

from stages.common.errors import error_report
from stages.common.inputs import make_backward_inputs
from stages.s04_kda.reference import recurrent
from stages.s06_backward import reference

GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state")

SHAPES = [
    # B, N, H, d_k, d_v, chunk_size
    (2, 11, 2, 5, 3, 4),  # three chunks, the last one short; d_k != d_v
    (1, 16, 3, 8, 4, 8),  # two full chunks, three heads
    (2, 9, 1, 4, 6, 16),  # a chunk longer than the sequence; d_v > d_k
    (1, 7, 2, 3, 5, 1),  # chunks of one token
]


def torch_recurrent(q, k, v, g, beta, initial_state):
    """Reference A in torch, float64, for autograd: S_t = S_{t-1} Diag(e^{g_t})(I - beta_t k_t k_t^T)
    + beta_t v_t k_t^T, o_t = S_t q_t, S in the paper layout (d_v x d_k). initial_state: S_0^T
    (B, H, d_k, d_v). Returns (o: (B, N, H, d_v), S_N^T: (B, H, d_k, d_v))."""
    B, N, H, d_k = q.shape
    eye = torch.eye(d_k, dtype=q.dtype)
    outputs, finals = [], []
    for b in range(B):
        for h in range(H):
            S = initial_state[b, h].T
            rows = []
            for t in range(N):
                k_t, beta_t = k[b, t, h], beta[b, t, h]
                S = S @ torch.diag(torch.exp(g[b, t, h])) @ (eye - beta_t * torch.outer(k_t, k_t)) \
                    + beta_t * torch.outer(v[b, t, h], k_t)
                rows.append(S @ q[b, t, h])
            outputs.append(torch.stack(rows))  # (N, d_v)
            finals.append(S.T)
    o = torch.stack(outputs).reshape(B, H, N, -1).permute(0, 2, 1, 3)
    return o, torch.stack(finals).reshape(B, H, d_k, -1)


def autograd_gradients(q, k, v, g, beta, do, initial_state, d_final_state):
    """{name: gradient} of loss = <o, do> + <S_N^T, d_final_state> by torch.autograd, and o, S_N^T."""
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, g, beta, initial_state)]
    o, final_state = torch_recurrent(*leaves)
    loss = (o * torch.from_numpy(do)).sum()
    if d_final_state is not None:
        loss = loss + (final_state * torch.from_numpy(d_final_state)).sum()
    loss.backward()
    gradients = {name: leaf.grad.numpy() for name, leaf in zip(GRADIENTS, leaves)}
    return gradients, o.detach().numpy(), final_state.detach().numpy()


_inputs = make_backward_inputs  # the other stage 6 test files import it under this name


def _assert_close(result, expected, tolerance):
    for name in GRADIENTS:
        report = error_report(getattr(result, name), expected[name])
        assert report.rel_l2 <= tolerance, f"{name}: {report}"


@pytest.mark.parametrize("with_final_state_gradient", [False, True])
@pytest.mark.parametrize("with_initial_state", [False, True])
@pytest.mark.parametrize("B, N, H, d_k, d_v, chunk_size", SHAPES)
def test_gradients_equal_autograd(B, N, H, d_k, d_v, chunk_size, with_initial_state, with_final_state_gradient):
    x, do, S_0, dS_N = _inputs(B, N, H, d_k, d_v, seed=N + d_k)
    S_0 = S_0 if with_initial_state else None
    dS_N = dS_N if with_final_state_gradient else None
    expected, o, final_state = autograd_gradients(x.q, x.k, x.v, x.g, x.beta, do,
                                                  np.zeros((B, H, d_k, d_v)) if S_0 is None else S_0, dS_N)
    a = reference.recurrent_backward(x.q, x.k, x.v, x.g, x.beta, do, S_0, dS_N)
    b = reference.chunkwise_backward(x.q, x.k, x.v, x.g, x.beta, do, chunk_size, S_0, dS_N)
    for result in (a, b):
        _assert_close(result, expected, 1e-12)
        assert error_report(result.o, o).rel_l2 <= 1e-12
        assert error_report(result.final_state, final_state).rel_l2 <= 1e-12


@pytest.mark.parametrize("chunk_size", [1, 3, 8, 16, 64])
def test_chunkwise_equals_recurrent(chunk_size):
    """B against A at a larger size: d_k = 16, d_v = 8, N = 40, gates down to 0.5, both states."""
    x, do, S_0, dS_N = _inputs(2, 40, 2, 16, 8, seed=7)
    a = reference.recurrent_backward(x.q, x.k, x.v, x.g, x.beta, do, S_0, dS_N)
    b = reference.chunkwise_backward(x.q, x.k, x.v, x.g, x.beta, do, chunk_size, S_0, dS_N)
    _assert_close(b, a._asdict(), 1e-12)


def test_forward_outputs_are_stage_4s():
    x, do, _, _ = _inputs(2, 13, 2, 4, 3, seed=3)
    expected = recurrent(x.q, x.k, x.v, x.g, x.beta)
    assert error_report(reference.recurrent_backward(x.q, x.k, x.v, x.g, x.beta, do).o, expected).rel_l2 <= 1e-14
    assert error_report(reference.chunkwise_backward(x.q, x.k, x.v, x.g, x.beta, do, 4).o, expected).rel_l2 <= 1e-14


def test_gate_gradient_at_g_zero():
    """a = 1 everywhere (g = 0, no decay) is allowed, and its gradient is still autograd's."""
    x, do, S_0, dS_N = _inputs(1, 10, 2, 4, 4, seed=5)
    g = np.zeros_like(x.g)
    expected, _, _ = autograd_gradients(x.q, x.k, x.v, g, x.beta, do, S_0, dS_N)
    _assert_close(reference.chunkwise_backward(x.q, x.k, x.v, g, x.beta, do, 4, S_0, dS_N), expected, 1e-12)


@pytest.mark.parametrize("function", ["recurrent_backward", "chunkwise_backward", "kernel_mirror_backward"])
def test_inputs_unchanged(function):
    x, do, S_0, dS_N = _inputs(2, 9, 2, 4, 3, seed=4)
    arguments = [x.q, x.k, x.v, x.g, x.beta, do]
    before = [a.copy() for a in (*arguments, S_0, dS_N)]
    extra = () if function == "recurrent_backward" else (4,)
    getattr(reference, function)(*arguments, *extra, S_0, dS_N)
    for original, after in zip(before, (*arguments, S_0, dS_N)):
        assert np.array_equal(original, after)


@pytest.mark.parametrize("function", ["recurrent_backward", "chunkwise_backward", "kernel_mirror_backward"])
def test_input_checks(function):
    x, do, S_0, dS_N = _inputs(1, 6, 1, 4, 3, seed=6)
    extra = () if function == "recurrent_backward" else (4,)
    call = getattr(reference, function)
    with pytest.raises(ValueError, match=r"do must have shape \(B, N, H, d_v\)"):
        call(x.q, x.k, x.v, x.g, x.beta, do[:, :-1], *extra)
    with pytest.raises(TypeError, match="do must have dtype float64"):
        call(x.q, x.k, x.v, x.g, x.beta, do.astype(np.float32), *extra)
    with pytest.raises(ValueError, match=r"initial_state must have shape \(B, H, d_k, d_v\)"):
        call(x.q, x.k, x.v, x.g, x.beta, do, *extra, S_0.transpose(0, 1, 3, 2))
    with pytest.raises(ValueError, match=r"d_final_state must have shape \(B, H, d_k, d_v\)"):
        call(x.q, x.k, x.v, x.g, x.beta, do, *extra, S_0, dS_N[0])
    with pytest.raises(ValueError, match="beta must lie in"):
        call(x.q, x.k, x.v, x.g, x.beta + 1.0, do, *extra)
    with pytest.raises(ValueError, match="log gates must be <= 0"):
        call(x.q, x.k, x.v, -x.g, x.beta, do, *extra)


# ----------------------------------------------------------------------------- reference C

MIRROR_SHAPES = [
    # B, N, H, d_k, d_v, chunk_size, block_dv, sub_block
    (1, 16, 1, 4, 4, 16, 4, 4),  # one chunk
    (2, 45, 2, 16, 8, 16, 4, 8),  # many chunks, N not a multiple of chunk_size, two value blocks
    (1, 128, 1, 16, 6, 64, 2, 16),  # the kernel's chunk and sub-block, three value blocks
    (1, 7, 2, 4, 4, 8, 1, 1),  # a chunk longer than the sequence, one-row sub-blocks
]


@pytest.mark.parametrize("with_states", [False, True])
@pytest.mark.parametrize("B, N, H, d_k, d_v, chunk_size, block_dv, sub_block", MIRROR_SHAPES)
def test_kernel_mirror_equals_chunkwise(B, N, H, d_k, d_v, chunk_size, block_dv, sub_block, with_states):
    """C against B: gates down to 0.5 (the anchors at work), beta at 0 and 1, with and without S_0 and dS_N."""
    x, do, S_0, dS_N = _inputs(B, N, H, d_k, d_v, seed=N + block_dv)
    S_0, dS_N = (S_0, dS_N) if with_states else (None, None)
    b = reference.chunkwise_backward(x.q, x.k, x.v, x.g, x.beta, do, chunk_size, S_0, dS_N)
    c = reference.kernel_mirror_backward(x.q, x.k, x.v, x.g, x.beta, do, chunk_size, S_0, dS_N, block_dv, sub_block)
    _assert_close(c, b._asdict(), 1e-12)
    assert error_report(c.o, b.o).rel_l2 <= 1e-12
    assert error_report(c.final_state, b.final_state).rel_l2 <= 1e-12


def test_kernel_mirror_with_gates_near_log_one_half_at_full_chunk():
    """Every gate in [0.5, 0.55] over chunks of 64: e^{-gamma} reaches 2^60 across a chunk, the anchored
    factors stay <= 2^8, and C still meets B in float64."""
    x, do, S_0, dS_N = _inputs(1, 150, 2, 16, 8, seed=21, gate_range=(0.5, 0.55))
    b = reference.chunkwise_backward(x.q, x.k, x.v, x.g, x.beta, do, 64, S_0, dS_N)
    c = reference.kernel_mirror_backward(x.q, x.k, x.v, x.g, x.beta, do, 64, S_0, dS_N, 4)
    _assert_close(c, b._asdict(), 1e-12)


def test_kernel_mirror_independent_of_block_dv():
    x, do, S_0, dS_N = _inputs(2, 40, 2, 8, 8, seed=1)
    results = [reference.kernel_mirror_backward(x.q, x.k, x.v, x.g, x.beta, do, 8, S_0, dS_N, block_dv, 4)
               for block_dv in (1, 2, 8)]
    for result in results[1:]:
        _assert_close(result, results[0]._asdict(), 1e-14)


def test_score_gradients_equal_the_definition():
    """The anchored GEMMs against the sums they stand for, element by element, at sub-blocks of 1 to C."""
    rng = np.random.default_rng(8)
    C, d_k = 32, 6
    Q, K = rng.standard_normal((C, d_k)), rng.standard_normal((C, d_k))
    gamma = np.cumsum(np.log(rng.uniform(0.5, 1.0, (C, d_k))), axis=0)
    dA_qk_T, dM_T = np.triu(rng.standard_normal((C, C))), np.triu(rng.standard_normal((C, C)), 1)
    expected = [np.zeros((C, d_k)) for _ in range(4)]  # dQ_scores, dK_rows, dK_columns, dgamma
    for c in range(C):
        for i in range(c + 1):
            decay = np.exp(gamma[c] - gamma[i])
            expected[0][c] += dA_qk_T[i, c] * K[i] * decay
            expected[1][c] += dM_T[i, c] * K[i] * decay
            expected[2][i] += (dM_T[i, c] * K[c] + dA_qk_T[i, c] * Q[c]) * decay
            pair = (dA_qk_T[i, c] * Q[c] + dM_T[i, c] * K[c]) * K[i] * decay  # d/d gamma_c, and -d/d gamma_i
            expected[3][c] += pair
            expected[3][i] -= pair
    for sub_block in (1, 4, 8, 32):
        for actual, exact in zip(reference.score_gradients(Q, K, gamma, dA_qk_T, dM_T, sub_block), expected):
            assert np.max(np.abs(actual - exact)) <= 1e-13 * np.max(np.abs(exact))
