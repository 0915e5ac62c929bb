"""The fast path on the tensors as a model passes them (stages.kda.inputs): the gate, the q/k norms, q's
scale and beta's sigmoid computed by the kernels as they load the tokens, grouped value heads.

Every case runs the kernels through the tile interpreter in float64 and compares with a float64
recurrence, token by token, on the same tensors activated in torch by `activate` (whose formulas are
checked here against FLA's naive gate by hand-written cases): both gate forms, A_log and dt_bias
given or not, gates down to -60 a token, lengths that are not a multiple of the chunk (the dense
prepare reads them unpadded), packed batches with empty and short sequences, beta in (0, 2). The
bound is the TF32 floor of the block inverse's merges. The final states are compared too: a
padded row that kept a raw gate's activation would decay the state past the sequence's end.
"""

import numpy as np
import pytest
import torch

from stages.common.interpreter import interpret
from stages.kda.inputs import InputForm, activate, activate_gate
from stages.kda.prepare import PackedBatch, build_prepare_program, prepare_outputs
from stages.kda.recurrence import build_recurrence_program

TF32_FLOOR = 2.0**-13  # the block inverse's merges are TF32 GEMMs
C, BLOCK_DV = 32, 16
D_K, D_V = 32, 32
FORMS = {
    # Kimi Linear's default gate, q scaled as FLA's default 1 / sqrt(K) would
    "softplus": InputForm(gate="softplus", l2_normalize=True, beta="sigmoid", scale=D_K ** -0.5),
    # the bounded gate (safe_gate), with A_log, beta up to 2 (allow_neg_eigval)
    "sigmoid": InputForm(gate="sigmoid", lower_bound=-5.0, l2_normalize=True, beta="sigmoid2"),
    # the norms and the scale alone, g and beta given as they are
    "norms": InputForm(l2_normalize=True, scale=0.5),
}


def recurrence(q, k, v, g, beta, state=None):
    """KDA token by token in float64, S^T (d_k x d_v) per (batch row, head), from `state` or zeros:
    S^T <- (I - beta k k^T) Diag(e^g) S^T + beta k v^T, o = (S^T)^T q. Any beta (no range check).
    Returns (o (B, N, H, d_v), final states (B, H, d_k, d_v))."""
    B, N, H, d_k = q.shape
    S = np.zeros((B, H, d_k, v.shape[3])) if state is None else state.copy()
    o = np.zeros(v.shape)
    for b in range(B):
        for h in range(H):
            for t in range(N):
                kt = k[b, t, h]
                S[b, h] = np.exp(g[b, t, h])[:, None] * S[b, h]
                S[b, h] += beta[b, t, h] * np.outer(kt, v[b, t, h] - kt @ S[b, h])
                o[b, t, h] = q[b, t, h] @ S[b, h]
    return o, S


def raw_inputs(B, N, H, group, seed, strong=False):
    """q, k (B, N, H / group, D_K), v (B, N, H, D_V), the raw gate x, beta logits, A_log (H,), dt_bias
    (H * D_K,), float64. strong: A_log = log 50, so that -exp(A_log) softplus(x + dt_bias) reaches
    -60 a token (a whole chunk summing to thousands)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, N, H // group, D_K)) * 3
    k = rng.standard_normal((B, N, H // group, D_K)) * 3
    v = rng.standard_normal((B, N, H, D_V))
    x = rng.standard_normal((B, N, H, D_K)) * (2 if strong else 1)
    beta = rng.standard_normal((B, N, H)) * 2
    A_log = np.full(H, np.log(50.0)) if strong else rng.uniform(-2, 1, H)
    dt_bias = rng.standard_normal(H * D_K)
    return q, k, v, x, beta, A_log, dt_bias


def expected(form, q, k, v, x, beta, A_log, dt_bias, group, state=None):
    """The float64 recurrence on activate's tensors: (o, final states)."""
    q_a, k_a, g_a, beta_a = activated(form, q, k, x, beta, A_log, dt_bias, group)
    return recurrence(q_a, k_a, v, g_a, beta_a, state)


def activated(form, q, k, x, beta, A_log, dt_bias, group):
    """The recurrence's q, k (repeated over the group), g and beta, in float64 through `activate`."""
    q, k, g, beta = (t.numpy() for t in activate(form, *(torch.tensor(a) for a in (q, k, x, beta)),
                                                 None if A_log is None else torch.tensor(A_log),
                                                 None if dt_bias is None else torch.tensor(dt_bias)))
    return np.repeat(q, group, axis=2), np.repeat(k, group, axis=2), g, beta


def dense_forward(form, q, k, v, x, beta, A_log, dt_bias, group, dtype="float64"):
    """The dense prepare (reading the N tokens unpadded) and the recurrence through the interpreter,
    A_log and dt_bias zeros where not given, as stages.kda.calls passes them. Returns (o, final state)."""
    B, N, H = v.shape[:3]
    N_padded = -(-N // C) * C
    gate_dtype = "float64" if dtype == "float64" else dtype
    prepare = interpret(build_prepare_program(B, N_padded, H, D_K, D_V, C, dtype=dtype, form=form, group=group,
                                              gate_dtype=gate_dtype, beta_dtype=gate_dtype, tokens=N),
                        out_idx=prepare_outputs(raw_gate=form.raw_gate))
    recurrence_ = interpret(build_recurrence_program(B, N_padded, H, D_K, D_V, C, BLOCK_DV, dtype=dtype),
                            out_idx=[7, 8])
    parameters = gate_parameters(form, A_log, dt_bias, H)
    o, state = recurrence_(*prepare(q, k, v, x, beta, *parameters), np.zeros((B, H, D_K, D_V)))
    return o[:, :N], state


def gate_parameters(form, A_log, dt_bias, H):
    if not form.raw_gate:
        return ()
    return (np.zeros(H) if A_log is None else A_log,
            np.zeros((H, D_K)) if dt_bias is None else dt_bias.reshape(H, D_K))


def relative_l2(actual, expected):
    return np.linalg.norm(actual - expected) / np.linalg.norm(expected)


@pytest.mark.parametrize("name", list(FORMS))
def test_dense_forward_activates_as_it_loads(name):
    """N = 83 with C = 32 (the last chunk short, read unpadded), two value heads on one q/k head: o and
    the final state within the TF32 floor of the float64 recurrence on activate's tensors. The inputs
    are unchanged by the call, and a second call gives the same outputs."""
    form, group = FORMS[name], 2
    inputs = raw_inputs(1, 83, 2, group, seed=1)
    q, k, v, x, beta, A_log, dt_bias = inputs
    if not form.raw_gate:  # a log gate and beta as they are
        x, beta = -np.abs(x), 1 / (1 + np.exp(-beta))
    before = [a.copy() for a in (q, k, v, x, beta, A_log, dt_bias)]
    o, state = dense_forward(form, q, k, v, x, beta, A_log if form.raw_gate else None,
                             dt_bias if form.raw_gate else None, group)
    expected_o, expected_state = expected(form, q, k, v, x, beta, A_log, dt_bias, group)
    assert relative_l2(o, expected_o) <= TF32_FLOOR
    assert relative_l2(state, expected_state) <= TF32_FLOOR
    assert all(np.array_equal(a, b) for a, b in zip((q, k, v, x, beta, A_log, dt_bias), before))
    again = dense_forward(form, q, k, v, x, beta, A_log if form.raw_gate else None,
                          dt_bias if form.raw_gate else None, group)
    assert np.array_equal(again[0], o) and np.array_equal(again[1], state)


def test_strong_raw_gates_and_no_parameters():
    """Gates down to -60 a token from the softplus form (A_log = log 50; whole chunks summing to
    thousands: the prepare's exact sub-blocks), and the bounded gate with neither A_log nor dt_bias
    (lower_bound * sigmoid(x))."""
    q, k, v, x, beta, A_log, dt_bias = raw_inputs(1, 64, 2, 1, seed=2, strong=True)
    g = activated(FORMS["softplus"], q, k, x, beta, A_log, dt_bias, 1)[2]
    assert g.min() < -50 and g.reshape(2, 32, 2, D_K).sum(axis=1).min() < -1000  # the gates the case is about
    for form, parameters in ((FORMS["softplus"], (A_log, dt_bias)), (FORMS["sigmoid"], (None, None))):
        o, state = dense_forward(form, q, k, v, x, beta, *parameters, 1)
        expected_o, expected_state = expected(form, q, k, v, x, beta, *parameters, 1)
        assert relative_l2(o, expected_o) <= TF32_FLOOR
        assert relative_l2(state, expected_state) <= TF32_FLOOR


def test_packed_forward_activates_as_it_loads():
    """A packed batch of sequences 40, 0, 5 and 33 tokens long (an empty one, one shorter than a chunk,
    chunks cut at sequence ends), each from its own initial state: o and every final state within the
    TF32 floor of each sequence run alone through the float64 recurrence."""
    from stages.kda.calls import varlen_index

    form, group, lengths = FORMS["sigmoid"], 2, (40, 0, 5, 33)
    q, k, v, x, beta, A_log, dt_bias = raw_inputs(1, sum(lengths), 2, group, seed=3)
    H, T, N_seq = 2, sum(lengths), len(lengths)
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    index = varlen_index(cu_seqlens, T, C).numpy()
    n_chunks = (index.size - 2 * (N_seq + 1)) // 2
    offsets, chunk_offsets, chunks = index[:N_seq + 1], index[N_seq + 1:2 * N_seq + 2], index[2 * N_seq + 2:]
    packed = PackedBatch(T, n_chunks, N_seq)  # the sizes as static numbers: the interpreter runs one batch
    prepare = interpret(build_prepare_program(1, n_chunks * C, H, D_K, D_V, C, dtype="float64", packed=packed,
                                              form=form, group=group, gate_dtype="float64", beta_dtype="float64"))
    recurrence_ = interpret(build_recurrence_program(1, n_chunks * C, H, D_K, D_V, C, BLOCK_DV, dtype="float64",
                                                     packed=packed))
    prepared = [np.zeros((1, n_chunks * C, H, D_K)), np.zeros((1, n_chunks * C, H, D_V)),
                np.zeros((1, n_chunks * C, H, D_K)), np.zeros((1, n_chunks * C, H, D_K)),
                np.zeros((1, n_chunks * C, H, C)), np.zeros((1, n_chunks, H, D_K))]
    prepare(q, k, v, x, beta, A_log, dt_bias.reshape(H, D_K), chunks.reshape(n_chunks, 2), offsets, *prepared)
    initial = np.random.default_rng(4).standard_normal((N_seq, H, D_K, D_V))
    o, final = np.zeros((1, T, H, D_V)), np.zeros((N_seq, H, D_K, D_V))
    recurrence_(*prepared, initial, chunk_offsets, offsets, o, final)
    q_a, k_a, g_a, beta_a = activated(form, q, k, x, beta, A_log, dt_bias, group)
    for i, (start, end) in enumerate(zip(offsets[:-1], offsets[1:])):
        part = slice(start, end)
        expected_o, expected_state = recurrence(q_a[:, part], k_a[:, part], v[:, part], g_a[:, part],
                                                beta_a[:, part], initial[i:i + 1])
        if end > start:
            assert relative_l2(o[:, part], expected_o) <= TF32_FLOOR
        assert relative_l2(final[i:i + 1], expected_state) <= TF32_FLOOR


def test_bfloat16_inputs_as_a_model_passes_them():
    """q, k, v, the raw gate and beta's logits in bf16 (Kimi Linear's dtypes): o within 8 bf16 units of
    the float64 recurrence on the same bf16 values activated exactly."""
    form, group = FORMS["softplus"], 1
    q, k, v, x, beta, A_log, dt_bias = raw_inputs(1, 70, 2, group, seed=5)
    q, k, v, x, beta = (torch.tensor(a).to(torch.bfloat16).double().numpy() for a in (q, k, v, x, beta))
    o, _ = dense_forward(form, q, k, v, x, beta, A_log, dt_bias, group, dtype="bfloat16")
    expected_o, _ = expected(form, q, k, v, x, beta, A_log, dt_bias, group)
    assert relative_l2(o.astype(np.float64), expected_o) <= 8 * 2.0**-8


def test_activate_is_flas_gate():
    """activate's formulas, by hand on a few values: -exp(A_log) * softplus(x + dt_bias) with torch's
    threshold (x itself above 20), lower_bound * sigmoid(exp(A_log) * (x + dt_bias)), its form without
    A_log, the L2 norm with eps 1e-6 and the scale, 2 sigmoid for beta up to 2."""
    x = torch.tensor([[[[-30.0, 0.0, 1.0, 25.0]]]], dtype=torch.float64)  # (B, N, H, K) = (1, 1, 1, 4)
    A_log, dt_bias = torch.tensor([np.log(2.0)], dtype=torch.float64), torch.tensor([0.0, 0.5, -1.0, 0.0],
                                                                                     dtype=torch.float64)
    softplus = activate_gate(InputForm(gate="softplus"), x, A_log, dt_bias)
    expected = -2 * np.array([np.log1p(np.exp(-30.0)), np.log1p(np.exp(0.5)), np.log(2.0), 25.0])
    np.testing.assert_allclose(softplus.ravel().numpy(), expected, rtol=1e-12)
    bounded = activate_gate(InputForm(gate="sigmoid", lower_bound=-5.0), x, A_log, dt_bias)
    np.testing.assert_allclose(bounded.ravel().numpy(), -5 / (1 + np.exp(-2 * np.array([-30.0, 0.5, 0.0, 25.0]))),
                               rtol=1e-12)
    plain_sigmoid = activate_gate(InputForm(gate="sigmoid", lower_bound=-5.0), x, None, None)
    np.testing.assert_allclose(plain_sigmoid.ravel().numpy(), -5 / (1 + np.exp(-x.ravel().numpy())), rtol=1e-12)
    q = torch.tensor([[[[3.0, 4.0]]]], dtype=torch.float64)
    form = InputForm(l2_normalize=True, beta="sigmoid2", scale=0.5)
    q_a, k_a, _, beta_a = activate(form, q, q, torch.zeros(1, 1, 1, 2), torch.tensor([[[0.0]]]))
    np.testing.assert_allclose(q_a.ravel().numpy(), 0.5 * np.array([3.0, 4.0]) / np.sqrt(25 + 1e-6), rtol=1e-12)
    np.testing.assert_allclose(k_a.ravel().numpy(), np.array([3.0, 4.0]) / np.sqrt(25 + 1e-6), rtol=1e-12)
    assert beta_a.item() == 1.0  # 2 sigmoid(0)


def test_input_form_refuses_what_it_cannot_mean():
    """A lower bound belongs to the sigmoid gate and must be below 0; forms are named."""
    with pytest.raises(ValueError, match="lower_bound is the 'sigmoid' gate's floor"):
        InputForm(gate="softplus", lower_bound=-5.0)
    with pytest.raises(ValueError, match="lower_bound is the 'sigmoid' gate's floor"):
        InputForm(gate="sigmoid")
    with pytest.raises(ValueError, match="lower_bound must be below 0"):
        InputForm(gate="sigmoid", lower_bound=0.5)
    with pytest.raises(ValueError, match="gate must be one of"):
        InputForm(gate="exp")
    with pytest.raises(ValueError, match="beta must be one of"):
        InputForm(beta="tanh")


# ------------------------------------------------------------------------------------------ on the GPU


def torch_recurrence(q, k, v, g, beta, state=None):
    """`recurrence` in torch (any device, float64, differentiable), batched over (B, H): (o, final states)."""
    import torch

    B, N, H, d_k = q.shape
    S = q.new_zeros(B, H, d_k, v.shape[3]) if state is None else state
    outputs = []
    for t in range(N):
        k_t = k[:, t]
        S = torch.exp(g[:, t])[..., None] * S
        S = S + beta[:, t, :, None, None] * k_t[..., None] * (v[:, t] - (k_t[..., None] * S).sum(-2))[:, :, None, :]
        outputs.append((q[:, t, :, :, None] * S).sum(-2))
    return (torch.stack(outputs, dim=1) if outputs else v.new_zeros(v.shape)), S


def _gpu_raw_inputs(B, N, H_qk, H, D, seed):
    """Raw bf16 q, k, v, gate x, beta logits and fp32 A_log, dt_bias on the GPU, as Kimi Linear's layer
    passes them; float64 leaves of the same values for the exact reference's autograd."""
    import torch

    generator = torch.Generator(device="cuda").manual_seed(seed)

    def normal(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", generator=generator).to(dtype)

    raw = [normal(B, N, H_qk, D), normal(B, N, H_qk, D), normal(B, N, H, D), normal(B, N, H, D), normal(B, N, H),
           normal(H, dtype=torch.float32), normal(H * D, dtype=torch.float32)]
    return raw, [x.double().requires_grad_() for x in raw]


def _exact(form, exact_leaves, group, initial_state):
    q, k, v, x, beta, A_log, dt_bias = exact_leaves
    q_a, k_a, g_a, beta_a = activate(form, q, k, x, beta, A_log, dt_bias)
    q_a, k_a = (t.repeat_interleave(group, dim=2) for t in (q_a, k_a))
    return torch_recurrence(q_a, k_a, v, g_a, beta_a, initial_state.double())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["softplus", "sigmoid"])
def test_fused_forward_and_backward_on_gpu_match_float64(name):
    """bf16 on the H200, the tensors as Kimi Linear passes them (raw gate, raw q and k, beta logits),
    T = 300 (not a multiple of 64), grouped value heads (4 on 2), an initial state: o, the final state
    and the gradients of every raw tensor (q, k, v, the gate, beta's logits, A_log, dt_bias, the initial
    state) within bf16's reach of float64 autograd through activate and the recurrence. The inputs are
    unchanged by the calls."""
    import torch

    from stages.common.errors import error_report
    from stages.kda.calls import backward, forward

    form, group = FORMS[name], 2
    raw, exact_leaves = _gpu_raw_inputs(1, 300, 2, 4, 64, seed=7)
    form = InputForm(gate=form.gate, lower_bound=form.lower_bound, l2_normalize=True, beta=form.beta, scale=0.125)
    initial_state = torch.randn(1, 4, 64, 64, device="cuda")
    before = [x.clone() for x in raw]
    q, k, v, x, beta, A_log, dt_bias = raw
    o, final_state = forward(q, k, v, x, beta, initial_state, True, "device", None, form, A_log, dt_bias)
    do = torch.randn_like(o)
    d_state = torch.randn_like(final_state)
    gradients = backward(q, k, v, x, beta, do, initial_state, d_state, "device", None, None, form, A_log, dt_bias)
    exact_initial = initial_state.double().requires_grad_()
    exact_o, exact_state = _exact(form, exact_leaves, group, exact_initial)
    expected = torch.autograd.grad((exact_o, exact_state), [*exact_leaves, exact_initial], (do.double(), d_state.double()))
    for name_, mine, exact in (("o", o, exact_o), ("final_state", final_state, exact_state)):
        report = error_report(mine.double(), exact.detach())
        print(f"{name} {name_}: {report}")
        assert report.rel_l2 <= 2e-2, name_
    names = ("dq", "dk", "dv", "dg", "dbeta", "dA_log", "ddt_bias", "d_initial_state")
    ours = (gradients.dq, gradients.dk, gradients.dv, gradients.dg, gradients.dbeta, gradients.dA_log,
            gradients.ddt_bias, gradients.d_initial_state)
    for name_, mine, exact in zip(names, ours, expected):
        report = error_report(mine.double(), exact)
        print(f"{name} {name_}: {report}")
        assert report.rel_l2 <= 3e-2, name_
    assert all(torch.equal(a, b) for a, b in zip(raw, before))


@pytest.mark.gpu
def test_fused_prefill_and_decode_on_gpu_match_float64():
    """The packed prefill (sequences of 130, 0, 77 and 64 tokens, each from its own state) and then one
    decode step of each sequence from its prefilled state, in the bounded gate's form with grouped value
    heads, bf16: o and the states within bf16's reach of the float64 recurrence run on each sequence."""
    import torch

    from stages.common.errors import error_report
    from stages.kda.calls import decode, prefill

    form, group, lengths = FORMS["sigmoid"], 2, (130, 0, 77, 64)
    raw, exact_leaves = _gpu_raw_inputs(1, sum(lengths), 2, 4, 64, seed=8)
    q, k, v, x, beta, A_log, dt_bias = raw
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    initial = torch.randn(len(lengths), 4, 64, 64, device="cuda")
    o, states = prefill(q, k, v, x, beta, cu_seqlens, initial, True, "device", None, form, A_log, dt_bias)
    step, step_exact = _gpu_raw_inputs(len(lengths), 1, 2, 4, 64, seed=9)
    pool = states.clone()
    slots = torch.arange(len(lengths), dtype=torch.int32, device="cuda")
    o_step, _ = decode(*(t[:, 0] for t in step[:5]), pool, slots, "device", None, form, step[5], step[6])
    with torch.no_grad():
        q_a, k_a, g_a, beta_a = activate(form, *exact_leaves[:2], exact_leaves[3], exact_leaves[4], *exact_leaves[5:])
        q_a, k_a = (t.repeat_interleave(group, dim=2) for t in (q_a, k_a))
        v64 = exact_leaves[2]
        for i, (start, end) in enumerate(zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist())):
            part = slice(start, end)
            exact_o, exact_state = torch_recurrence(q_a[:, part], k_a[:, part], v64[:, part], g_a[:, part],
                                                    beta_a[:, part], initial[i:i + 1].double())
            if end > start:
                assert error_report(o[:, part].double(), exact_o).rel_l2 <= 2e-2
            assert error_report(states[i:i + 1].double(), exact_state).rel_l2 <= 2e-2
            s_q, s_k, s_g, s_beta = activate(form, step_exact[0][i:i + 1], step_exact[1][i:i + 1],
                                             step_exact[3][i:i + 1], step_exact[4][i:i + 1], *step_exact[5:])
            s_q, s_k = (t.repeat_interleave(group, dim=2) for t in (s_q, s_k))
            exact_step, exact_next = torch_recurrence(s_q, s_k, step_exact[2][i:i + 1], s_g, s_beta, exact_state)
            assert error_report(o_step[i:i + 1].double(), exact_step[:, 0]).rel_l2 <= 2e-2
            assert error_report(pool[i:i + 1].double(), exact_next).rel_l2 <= 2e-2
