"""Stage 6 chunk_kda: the autograd function on the CPU (gradcheck, and against torch.autograd of a
float64 torch recurrence), its arguments and refusals, and on a GPU against FLA's chunk_kda. FLA's
options beyond these (the in-kernel gate, grouped value heads, packed sequences, ...):
tests/kernels/test_fla_chunk_kda.py."""

import math

import numpy as np
import pytest
import torch

from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.kda import autograd
from stages.kda.autograd import CPU_CHUNK_SIZE, chunk_kda
from tests.stages.test_s06_backward import torch_recurrent

INPUTS = ("q", "k", "v", "g", "beta", "initial_state")


def _leaves(B, T, H, d_k, d_v, seed, gate_range=(0.5, 0.999), beta_range=(0.05, 0.95), dtype=torch.float64):
    """{name: float64 leaf tensor}: L2-normalized q and k, gates a in gate_range, a random S_0^T."""
    x = make_inputs(B, T, H, d_k, d_v, gate="channel", gate_range=gate_range, beta_range=beta_range, seed=seed)
    initial_state = np.random.default_rng(seed + 1).standard_normal((B, H, d_k, d_v))
    arrays = (x.q, x.k, x.v, x.g, x.beta, initial_state)
    return {name: torch.tensor(a, dtype=dtype, requires_grad=True) for name, a in zip(INPUTS, arrays)}


def _with_exact_betas(leaves, seed):
    """A quarter of beta's entries set to exactly 0 and 1: no write, and a full replacement."""
    beta = leaves["beta"].detach().clone().reshape(-1)
    picked = np.random.default_rng(seed).choice(beta.numel(), size=max(2, beta.numel() // 4), replace=False)
    beta[picked[::2]], beta[picked[1::2]] = 0.0, 1.0
    leaves["beta"] = beta.reshape(leaves["beta"].shape).requires_grad_()
    return leaves


def _loss_and_gradients(o, final_state, leaves, do, d_final_state):
    """loss = <o, do> + <S_T^T, d_final_state>; its gradients w.r.t. every leaf (None where it has none)."""
    loss = (o * do).sum() + (0 if final_state is None else (final_state * d_final_state).sum())
    used = [leaf for leaf in leaves.values() if leaf is not None]
    gradients = iter(torch.autograd.grad(loss, used, allow_unused=True))
    return {name: None if leaf is None else next(gradients) for name, leaf in leaves.items()}


@pytest.mark.parametrize("with_l2norm", [False, True])
@pytest.mark.parametrize("B, T, H, d_k, d_v, chunk_size", [
    (1, 4, 2, 3, 2, 4),  # one chunk
    (1, 6, 2, 3, 2, 4),  # T not a multiple of the chunk
    (2, 7, 1, 2, 3, 2),  # many chunks, the last one short; d_v > d_k
])
def test_gradcheck_on_the_cpu(B, T, H, d_k, d_v, chunk_size, with_l2norm, monkeypatch):
    """Finite differences against the backward, through o and the final state, with an initial state,
    gates down to 0.5 and the default scale 1 / sqrt(K) (and FLA's L2 norm in front); the CPU's chunk
    made small (CPU_CHUNK_SIZE), so that a few tokens span several chunks."""
    monkeypatch.setattr(autograd, "CPU_CHUNK_SIZE", chunk_size)
    leaves = _leaves(B, T, H, d_k, d_v, seed=T + chunk_size)

    def kda(q, k, v, g, beta, initial_state):
        return chunk_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                         use_qk_l2norm_in_kernel=with_l2norm)

    assert torch.autograd.gradcheck(kda, tuple(leaves.values()))


@pytest.mark.parametrize("with_initial_state", [False, True])
@pytest.mark.parametrize("B, T, H, d_k, d_v, chunk_size", [
    (1, 16, 2, 8, 4, 16),  # one full chunk
    (2, 21, 2, 5, 3, 8),  # three chunks, the last one short
    (1, 40, 1, 4, 6, CPU_CHUNK_SIZE),  # the CPU path's default chunk, T not a multiple of it
])
def test_gradients_equal_autograd_of_the_recurrence(B, T, H, d_k, d_v, chunk_size, with_initial_state, monkeypatch):
    """o, S_T^T and every gradient against torch.autograd of a float64 torch transcription of reference
    A, with gates down to 0.3 and beta exactly 0 and 1 in places (where finite differences cannot go)."""
    monkeypatch.setattr(autograd, "CPU_CHUNK_SIZE", chunk_size)
    leaves = _with_exact_betas(_leaves(B, T, H, d_k, d_v, seed=T, gate_range=(0.3, 0.999)), seed=T)
    if not with_initial_state:
        leaves["initial_state"] = None
    rng = np.random.default_rng(T + 7)
    do = torch.tensor(rng.standard_normal((B, T, H, d_v)))
    d_final_state = torch.tensor(rng.standard_normal((B, H, d_k, d_v)))

    o, final_state = chunk_kda(*[leaves[name] for name in INPUTS[:5]], scale=1.0, output_final_state=True,
                               initial_state=leaves["initial_state"])
    ours = _loss_and_gradients(o, final_state, leaves, do, d_final_state)
    zeros = torch.zeros(B, H, d_k, d_v, dtype=torch.float64)
    expected_o, expected_state = torch_recurrent(*[leaves[name] for name in INPUTS[:5]],
                                                 zeros if leaves["initial_state"] is None else leaves["initial_state"])
    expected = _loss_and_gradients(expected_o, expected_state, leaves, do, d_final_state)

    assert error_report(o, expected_o).rel_l2 <= 1e-12
    assert error_report(final_state, expected_state).rel_l2 <= 1e-12
    for name in INPUTS:
        if leaves[name] is None:
            assert ours[name] is None
            continue
        report = error_report(ours[name], expected[name])
        assert report.rel_l2 <= 1e-12, f"d{name}: {report}"


def test_the_cpu_path_takes_any_gate():
    """Kimi Linear's unbounded gate on the CPU path: log gates of -50 a token over whole chunks (in
    channels 0-1), -100 (channel 2: e^{800} past float64's range, were a factor taken across half a
    chunk), -1e4 over 25 tokens (channels 3-4), beta 0 and 1: o, S_T^T and every gradient against
    autograd of the float64 recurrence.

    The bound is the chunked algebra's own rounding on these inputs, measured here: stage 5's
    reference B (every decay a ratio e^{gamma_i - gamma_j}, no anchor, no range question) lies 2.9e-12
    from reference A (the chunk's (I + L)^{-1} amplifies rounding where a stretch of dead channels
    meets beta = 1; 3e-16 with gentle gates), and the CPU path may lie 4x as far; a wrong factor
    anywhere lies orders of magnitude further."""
    from stages.s04_kda.reference import recurrent
    from stages.s05_fast_kda.reference import chunkwise

    B, T, H, d_k, d_v = 1, 40, 2, 6, 4
    leaves = _with_exact_betas(_leaves(B, T, H, d_k, d_v, seed=41, gate_range=(0.3, 0.999)), seed=41)
    g = leaves["g"].detach().clone()
    g[..., 0:2], g[..., 2] = -50.0, -100.0
    g[:, 5:30, :, 3:5] = -1e4
    leaves["g"] = g.requires_grad_()
    arrays = [leaves[name].detach().numpy() for name in INPUTS[:5]]
    bound = 4 * max(error_report(chunkwise(*arrays, CPU_CHUNK_SIZE), recurrent(*arrays)).rel_l2, 2.5e-13)
    assert bound < 1e-10, f"the chunked algebra alone is off by {bound / 4:.1e}: the inputs are too ill-conditioned"
    rng = np.random.default_rng(42)
    do = torch.tensor(rng.standard_normal((B, T, H, d_v)))
    d_final_state = torch.tensor(rng.standard_normal((B, H, d_k, d_v)))
    o, final_state = chunk_kda(*[leaves[name] for name in INPUTS[:5]], scale=1.0, output_final_state=True,
                               initial_state=leaves["initial_state"])
    ours = _loss_and_gradients(o, final_state, leaves, do, d_final_state)
    expected_o, expected_state = torch_recurrent(*[leaves[name] for name in INPUTS])
    expected = _loss_and_gradients(expected_o, expected_state, leaves, do, d_final_state)
    assert error_report(o, expected_o).rel_l2 <= bound
    assert error_report(final_state, expected_state).rel_l2 <= bound
    for name in INPUTS:
        report = error_report(ours[name], expected[name])
        assert report.rel_l2 <= bound, f"d{name}: {report}"


def test_a_loss_on_the_final_state_alone():
    """o unused: its gradient arrives as None, and the backward starts from dS_T alone."""
    leaves = _leaves(1, 10, 2, 4, 3, seed=3)
    args = [leaves[name] for name in INPUTS[:5]]
    d_final_state = torch.tensor(np.random.default_rng(3).standard_normal((1, 2, 4, 3)))
    _, final_state = chunk_kda(*args, scale=1.0, initial_state=leaves["initial_state"], output_final_state=True)
    ours = torch.autograd.grad((final_state * d_final_state).sum(), list(leaves.values()))
    _, expected_state = torch_recurrent(*args, leaves["initial_state"])
    expected = torch.autograd.grad((expected_state * d_final_state).sum(), list(leaves.values()), allow_unused=True)
    assert expected[0] is None and torch.equal(ours[0], torch.zeros_like(ours[0]))  # q reaches o only
    for name, mine, theirs in list(zip(INPUTS, ours, expected))[1:]:
        assert error_report(mine, theirs).rel_l2 <= 1e-12, name


def test_scale_and_l2_norm_are_fla_s():
    """scale=None is 1 / sqrt(K) on q, and use_qk_l2norm_in_kernel divides q and k by sqrt(||x||^2 + 1e-6)."""
    leaves = _leaves(1, 9, 2, 4, 3, seed=5)
    q, k, v, g, beta = (leaves[name] for name in INPUTS[:5])
    q_raw, k_raw = 3 * q.detach(), 0.5 * k.detach()  # not unit norm
    o, _ = chunk_kda(q_raw, k_raw, v, g, beta, use_qk_l2norm_in_kernel=True)

    def fla_l2norm(x):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    expected, _ = torch_recurrent(fla_l2norm(q_raw) / math.sqrt(4), fla_l2norm(k_raw), v, g, beta,
                                  torch.zeros(1, 2, 4, 3, dtype=torch.float64))
    assert error_report(o, expected).rel_l2 <= 1e-12


def test_float32_in_float32_out_and_inputs_unchanged():
    """A float32 model trains on the CPU: outputs and gradients in the inputs' dtypes; the inputs are
    not modified, and a second call gives bitwise the same answer."""
    leaves = _leaves(2, 11, 2, 4, 4, seed=6, dtype=torch.float32)
    before = {name: leaf.detach().clone() for name, leaf in leaves.items()}
    do = torch.ones(2, 11, 2, 4)
    runs = []
    for _ in range(2):
        o, final_state = chunk_kda(*[leaves[name] for name in INPUTS[:5]], initial_state=leaves["initial_state"],
                                   output_final_state=True)
        gradients = _loss_and_gradients(o, final_state, leaves, do, torch.ones_like(final_state))
        runs.append((o, final_state, gradients))
    o, final_state, gradients = runs[0]
    assert o.dtype == torch.float32 and final_state.dtype == torch.float32
    assert all(gradients[name].dtype == torch.float32 for name in INPUTS)
    for name in INPUTS:
        assert torch.equal(leaves[name].detach(), before[name]), f"{name} was modified"
        assert torch.equal(gradients[name], runs[1][2][name])
    assert torch.equal(o, runs[1][0]) and torch.equal(final_state, runs[1][1])


def test_output_final_state_false_returns_none():
    leaves = _leaves(1, 5, 1, 2, 2, seed=8)
    o, final_state = chunk_kda(*[leaves[name] for name in INPUTS[:5]])
    assert final_state is None and o.shape == (1, 5, 1, 2)


def test_fla_options_at_their_defaults_pass_and_an_unknown_one_is_a_type_error():
    leaves = _leaves(1, 5, 1, 2, 2, seed=9)
    args = [leaves[name].detach() for name in INPUTS[:5]]
    chunk_kda(*args, cu_seqlens=None, use_gate_in_kernel=False, safe_gate=False, state_v_first=False, cp_context=None,
              use_graph=False, max_num_seqs=None, return_intermediate_states=False)
    with pytest.raises(TypeError, match="cp_context must be stage 8's CPContext"):
        chunk_kda(*args, cp_context=object())
    with pytest.raises(TypeError, match="unexpected keyword argument 'head_first'"):
        chunk_kda(*args, head_first=True)


def test_disable_recompute_gives_the_same_gradients_on_the_cpu():
    """FLA's disable_recompute is taken (on CUDA the forward keeps its prepare outputs); the CPU path
    recomputes whatever it is: the same o and gradients, bit for bit."""
    leaves = _leaves(1, 7, 2, 4, 3, seed=11)
    results = []
    for disable_recompute in (False, True):
        inputs = [leaves[name].detach().clone().requires_grad_() for name in INPUTS]
        o, final_state = chunk_kda(*inputs[:5], scale=1.0, initial_state=inputs[5], output_final_state=True,
                                   disable_recompute=disable_recompute)
        (o.sum() + final_state.square().sum()).backward()
        results.append([o.detach(), *(x.grad for x in inputs)])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_bad_inputs_are_refused_with_clear_errors():
    leaves = _leaves(1, 5, 2, 4, 3, seed=10)
    q, k, v, g, beta, initial_state = (leaves[name].detach() for name in INPUTS)
    cases = [
        ((q.numpy(), k, v, g, beta), {}, TypeError, "q must be a torch.Tensor"),
        ((q, k, v, g, beta[..., None]), {}, ValueError, "beta must have rank 3"),
        ((q, k, v.int(), g, beta), {}, TypeError, "v must have dtype float16 or bfloat16 or float32 or float64"),
        ((q, k, v, g, beta), {"initial_state": initial_state.half()}, TypeError,
         "initial_state must have dtype float32 or float64"),
        ((q, k, v, -g, beta), {}, ValueError, "log gates must be <= 0"),
        ((q, k, v, g, beta + 2), {}, ValueError, r"beta must lie in \[0, 2\]"),
        ((q, k[:, :4], v, g, beta), {}, ValueError, "k must have q's shape"),
        ((q, k, v, g, beta), {"initial_state": initial_state[..., :2]}, ValueError,
         r"initial_state must have shape \(N, HV, K, V\) = \(1, 2, 4, 3\)"),
        ((q, k, v, g, beta.to("meta")), {}, ValueError, "all inputs must be on one device"),
        ((q, k, v, g, beta, initial_state), {}, TypeError, "scale must be a real number or None, got Tensor"),
    ]
    for args, kwargs, error, message in cases:
        with pytest.raises(error, match=message):
            chunk_kda(*args, **kwargs)


def test_the_checks_mode_and_the_form_reach_the_kernels_forward(monkeypatch):
    """The CUDA path hands chunk_kda's checks, its form and the gate's parameters to the forward, which
    computes and checks as they say; checked on the CPU with the forward stubbed, since the path itself
    needs a GPU."""
    from stages.kda.inputs import InputForm

    seen = []
    monkeypatch.setattr(autograd, "resolve_for", lambda device, *shape, **sizes: None)
    monkeypatch.setattr(autograd, "forward_and_prepared",
                        lambda *args, form, A_log, dt_bias: seen.append((args[6], form, A_log)))
    q, A_log = torch.zeros(1, 64, 1, 32), torch.ones(1)
    form = InputForm(gate="softplus", l2_normalize=True)
    for checks in ("device", "host", "off"):
        autograd._cuda_forward(q, q, q, None, None, A_log, None, None, form, 64, checks)
    assert [(checks, form_seen) for checks, form_seen, _ in seen] == [(c, form) for c in ("device", "host", "off")]
    assert all(a is A_log for _, _, a in seen)


def test_non_contiguous_inputs_are_accepted():
    leaves = _leaves(1, 6, 2, 4, 4, seed=11)
    q, k, v, g, beta = (leaves[name].detach() for name in INPUTS[:5])
    q_strided = q.transpose(2, 1).contiguous().transpose(2, 1)  # the same values, other strides
    assert not q_strided.is_contiguous()
    assert torch.equal(chunk_kda(q_strided, k, v, g, beta)[0], chunk_kda(q, k, v, g, beta)[0])


@pytest.mark.gpu
def test_cuda_forward_and_backward_match_fla_chunk_kda():
    """bf16 on CUDA, T not a multiple of 64, initial and final state, FLA's L2 norm and scale: our
    o, S_T and six gradients against the CPU path's float64 (exact, by the tests above), next to FLA's."""
    fla_ops = pytest.importorskip("fla.ops")
    B, T, H, D = 2, 300, 2, 128
    leaves = _leaves(B, T, H, D, D, seed=12, gate_range=(0.5, 0.999))
    rng = np.random.default_rng(13)
    do, d_final_state = (torch.tensor(rng.standard_normal(shape)) for shape in ((B, T, H, D), (B, H, D, D)))
    options = {"output_final_state": True, "use_qk_l2norm_in_kernel": True}

    exact_o, exact_state = chunk_kda(*[leaves[name] for name in INPUTS[:5]], initial_state=leaves["initial_state"],
                                     **options)
    exact = _loss_and_gradients(exact_o, exact_state, leaves, do, d_final_state)

    def on_cuda(kda):
        cuda = {name: leaf.detach().to("cuda", torch.bfloat16 if name in ("q", "k", "v") else torch.float32)
                .requires_grad_() for name, leaf in leaves.items()}
        o, final_state = kda(*cuda.values(), **options)
        gradients = _loss_and_gradients(o.float(), final_state, cuda, do.float().cuda(), d_final_state.float().cuda())
        return dict(gradients, o=o, final_state=final_state)

    ours = on_cuda(lambda q, k, v, g, beta, s0, **kw: chunk_kda(q, k, v, g, beta, initial_state=s0, **kw))
    fla = on_cuda(lambda q, k, v, g, beta, s0, **kw: fla_ops.chunk_kda(q, k, v, g, beta, initial_state=s0, **kw))
    truth = dict(exact, o=exact_o, final_state=exact_state)
    for name in ("o", "final_state", *INPUTS):
        our_error, fla_error = error_report(ours[name], truth[name]), error_report(fla[name], truth[name])
        print(f"{name}: ours {our_error}, FLA {fla_error}, ours vs FLA {error_report(ours[name], fla[name])}")
        assert our_error.rel_l2 <= max(2 * fla_error.rel_l2, 1e-2), name
    kept = on_cuda(lambda q, k, v, g, beta, s0, **kw: chunk_kda(q, k, v, g, beta, initial_state=s0,
                                                               disable_recompute=True, **kw))
    for name in ("o", "final_state", *INPUTS):  # the forward's prepare outputs kept: the same kernels' numbers
        assert torch.equal(kept[name], ours[name]), f"{name} differs with disable_recompute=True"


@pytest.mark.gpu
def test_cuda_backward_takes_strong_gates_as_accurately_as_fla():
    """bf16 on CUDA with FLA's L2 norm and scale, both states, and a real strong-gate layout: a quarter
    of the channels at -50 to -1e4 a token at every token (log-uniform), the others near 0 but for a
    stretch down to -1e4. No value-range refusal; o, S_T and the six gradients finite and within
    twice FLA's error (or 1e-2) from torch.autograd of the float64 token-by-token recurrence (the CPU
    path's anchored reference overflows float64 at these gates); prints both errors."""
    def l2_normalize(x):
        return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)

    fla_ops = pytest.importorskip("fla.ops")
    B, T, H, D = 2, 300, 2, 128
    leaves = _leaves(B, T, H, D, D, seed=14, gate_range=(0.9, 0.999))
    rng = np.random.default_rng(14)
    g = leaves["g"].detach().numpy().copy()
    g[..., :D // 4] = -np.exp(rng.uniform(np.log(50.0), np.log(1e4), g[..., :D // 4].shape))
    g[:, 40:120, :, D // 4:] = -rng.uniform(0.0, 1e4, g[:, 40:120, :, D // 4:].shape)
    leaves["g"] = torch.tensor(g, requires_grad=True)
    do, d_final_state = (torch.tensor(rng.standard_normal(shape)) for shape in ((B, T, H, D), (B, H, D, D)))
    options = {"output_final_state": True, "use_qk_l2norm_in_kernel": True}

    q, k, v, g, beta, initial_state = leaves.values()
    exact_o, exact_state = torch_recurrent(l2_normalize(q) / math.sqrt(D), l2_normalize(k), v, g, beta,
                                           initial_state)
    truth = dict(_loss_and_gradients(exact_o, exact_state, leaves, do, d_final_state), o=exact_o,
                 final_state=exact_state)

    def on_cuda(kda):
        cuda = {name: leaf.detach().to("cuda", torch.bfloat16 if name in ("q", "k", "v") else torch.float32)
                .requires_grad_() for name, leaf in leaves.items()}
        o, final_state = kda(*cuda.values(), **options)
        gradients = _loss_and_gradients(o.float(), final_state, cuda, do.float().cuda(), d_final_state.float().cuda())
        return dict(gradients, o=o, final_state=final_state)

    ours = on_cuda(lambda q, k, v, g, beta, s0, **kw: chunk_kda(q, k, v, g, beta, initial_state=s0, **kw))
    fla = on_cuda(lambda q, k, v, g, beta, s0, **kw: fla_ops.chunk_kda(q, k, v, g, beta, initial_state=s0, **kw))
    for name in ("o", "final_state", *INPUTS):
        assert torch.isfinite(ours[name]).all(), f"{name} is not finite"
        our_error, fla_error = error_report(ours[name], truth[name]), error_report(fla[name], truth[name])
        print(f"strong gates {name}: ours {our_error}, FLA {fla_error}, ours / FLA "
              f"{our_error.rel_l2 / fla_error.rel_l2:.2f}")
        assert our_error.rel_l2 <= max(2 * fla_error.rel_l2, 1e-2), name


@pytest.mark.gpu
def test_chunk_kda_flags_bad_values_on_the_device_through_forward_and_backward():
    """chunk_kda's default (checks="device") on the GPU: a bad g or beta passes the call and the
    backward without a sync and raises at raise_if_flagged, the step's one read; checks="off" flags
    nothing, checks="host" refuses at the call."""
    from stages.common.device_checks import BAD_BETA, BAD_GATE, MESSAGES, raise_if_flagged

    device = torch.device("cuda")
    generator = torch.Generator(device="cuda").manual_seed(3)
    B, T, H, D = 1, 200, 2, 64
    q, k, v = (torch.randn(B, T, H, D, device=device, generator=generator).to(torch.bfloat16) for _ in range(3))
    g = -torch.rand(B, T, H, D, device=device, generator=generator)
    beta = torch.rand(B, T, H, device=device, generator=generator)
    raise_if_flagged(device)
    for name, index, value, kind in (("g", (0, 150, 1, 5), 0.5, BAD_GATE), ("g", (0, 7, 0, 0), float("nan"), BAD_GATE),
                                     ("beta", (0, 199, 1), 1.5, BAD_BETA)):
        bad = {"g": g.clone(), "beta": beta.clone()}
        bad[name][index] = value
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        o, _ = chunk_kda(*leaves, bad["g"], bad["beta"], use_qk_l2norm_in_kernel=True)
        o.float().square().mean().backward()  # no error until the flags are read
        with pytest.raises(ValueError) as raised:
            raise_if_flagged(device)
        assert str(raised.value) == MESSAGES[kind]
        chunk_kda(q, k, v, bad["g"], bad["beta"], use_qk_l2norm_in_kernel=True, checks="off")
        raise_if_flagged(device)
        with pytest.raises(ValueError, match=name):
            chunk_kda(q, k, v, bad["g"], bad["beta"], use_qk_l2norm_in_kernel=True, checks="host")
