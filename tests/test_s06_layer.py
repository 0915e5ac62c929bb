"""Stage 6 KDA layer: the incremental path (pieces with a carried cache equal one call on the whole),
causality, gradients to every parameter, the forget gate's parametrization; on a GPU, the layer on
stage 5/6's kernels against the same layer on FLA's chunk_kda."""

import pytest
import torch

from stages.common.errors import error_report
from stages.s06_backward.autograd import CPU_CHUNK_SIZE
from stages.s06_backward.layer import A_RANGE, DT_RANGE, ForgetGate, KDALayer

C = CPU_CHUNK_SIZE
PIECES = [1, 3, C - 1, C + 5, 2 * C, 1, 1, 1]  # a prefill in pieces, then three decode steps


def _layer(seed=0, dtype=torch.float64, **options):
    torch.manual_seed(seed)
    return KDALayer(d_model=24, n_heads=2, head_dim=8, **options).to(dtype)


def _x(B, T, seed, dtype=torch.float64):
    return torch.randn(B, T, 24, dtype=dtype, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("conv_size", [1, 2, 4])
def test_pieces_with_a_carried_cache_equal_the_whole(conv_size):
    """Prefill in pieces of 1, 3, C - 1, C + 5 and 2C tokens, then decode token by token, each call with
    the cache the one before returned: y and the final cache equal one call on the whole sequence."""
    layer = _layer(conv_size=conv_size)
    x = _x(2, sum(PIECES), seed=conv_size)
    whole, whole_cache = layer(x, use_cache=True)
    cache, pieces, start = None, [], 0
    for length in PIECES:
        y, cache = layer(x[:, start:start + length], cache, use_cache=True)
        pieces.append(y)
        start += length
    assert error_report(torch.cat(pieces, dim=1), whole).rel_l2 <= 1e-12
    for name, expected, actual in zip(whole_cache._fields, whole_cache, cache):
        assert actual.shape == expected.shape, name
        assert error_report(actual, expected).max_abs <= 1e-12, name
    assert cache.conv_q.shape == (2, conv_size - 1, 16) and cache.state.shape == (2, 2, 8, 8)


def test_without_use_cache_no_cache_is_returned_and_a_given_one_is_read():
    layer = _layer()
    x = _x(1, 20, seed=1)
    _, cache = layer(x[:, :12], use_cache=True)
    y, returned = layer(x[:, 12:], cache)
    assert returned is None
    assert error_report(y, layer(x)[0][:, 12:]).rel_l2 <= 1e-12


def test_float32_layer_keeps_a_float32_state():
    layer = _layer(dtype=torch.float32)
    y, cache = layer(_x(2, 5, seed=2, dtype=torch.float32), use_cache=True)
    assert y.dtype == torch.float32 and cache.state.dtype == torch.float32 and cache.conv_v.dtype == torch.float32


def test_the_layer_is_causal():
    """Changing the tokens after t leaves y up to t unchanged (to rounding: t's chunk holds later tokens,
    and the UT transform's inverse is taken by LAPACK as a whole), and y after t changed."""
    layer = _layer()
    x = _x(1, 2 * C + 3, seed=3)
    t = C + 1
    changed = x.clone()
    changed[:, t + 1:] = torch.randn_like(changed[:, t + 1:])
    y, y_changed = layer(x)[0], layer(changed)[0]
    assert error_report(y_changed[:, :t + 1], y[:, :t + 1]).rel_l2 <= 1e-13
    assert error_report(y_changed[:, t + 1:], y[:, t + 1:]).rel_l2 >= 1e-2


def test_gradcheck_through_the_layer_and_gradients_reach_every_parameter():
    layer = _layer(gate_rank=4)
    x = _x(1, 7, seed=4).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: layer(x)[0], (x,))
    layer(x)[0].square().sum().backward()
    for name, parameter in layer.named_parameters():
        assert parameter.grad is not None and torch.isfinite(parameter.grad).all(), name
        assert parameter.grad.abs().max() > 0, f"no gradient reaches {name}"


def test_forget_gate_time_scales_at_init():
    """With the projection at zero, -g / e^{A_log} = softplus(dt_bias) = dt: every channel's step lies
    in DT_RANGE, spread over a decade at least, and each head's rate e^{A_log} in A_RANGE, heads apart."""
    torch.manual_seed(5)
    gate = ForgetGate(d_model=16, n_heads=4, head_dim=32, rank=8).double()
    torch.nn.init.zeros_(gate.up.weight)
    g = gate(torch.randn(1, 3, 16, dtype=torch.float64))
    assert g.shape == (1, 3, 4, 32)
    rate = torch.exp(gate.A_log)
    dt = -g / rate[:, None]
    assert (dt >= DT_RANGE[0] * (1 - 1e-12)).all() and (dt <= DT_RANGE[1] * (1 + 1e-12)).all()
    assert dt.max() / dt.min() >= 10
    assert ((rate >= A_RANGE[0]) & (rate <= A_RANGE[1])).all() and rate.max() / rate.min() >= 1.5


@pytest.mark.parametrize("lower_bound", [None, -5.0])
def test_forget_gate_stays_a_decay_for_any_input(lower_bound):
    """g < 0 for inputs of any size (softplus > 0); with lower_bound, g in (lower_bound, 0)."""
    torch.manual_seed(6)
    gate = ForgetGate(d_model=16, n_heads=2, head_dim=8, rank=4, lower_bound=lower_bound).double()
    for size in (1e-3, 1.0, 1e3):
        g = gate(size * torch.randn(2, 50, 16, dtype=torch.float64))
        assert (g <= 0).all() and torch.isfinite(g).all()
        if lower_bound is not None:
            assert (g >= lower_bound).all()
    with pytest.raises(ValueError, match="lower_bound must be a negative log gate, got 5"):
        ForgetGate(16, 2, 8, 4, lower_bound=5)


def test_beta_is_a_sigmoid_and_the_kernel_is_called_as_fla_s():
    """The layer hands the kernel FLA's arguments: beta in (0, 1), g <= 0, the L2 norm asked of it."""
    calls = []

    def recording_kernel(q, k, v, g, beta, **options):
        calls.append(options)
        assert (beta > 0).all() and (beta < 1).all() and (g <= 0).all()
        from stages.s06_backward.autograd import chunk_kda
        return chunk_kda(q, k, v, g, beta, **options)

    layer = _layer(kernel=recording_kernel)
    layer(_x(1, 4, seed=7))
    assert calls == [{"initial_state": None, "output_final_state": False, "use_qk_l2norm_in_kernel": True}]


@pytest.mark.gpu
def test_layer_on_our_kernels_matches_the_layer_on_fla():
    """One layer, bf16 autocast on CUDA, T not a multiple of 64: y and every parameter's gradient with
    stage 5/6's kernels and with FLA's chunk_kda (same weights), each against the same layer in
    float64 on the CPU (the references, exact by test_s06_autograd)."""
    import copy

    fla_ops = pytest.importorskip("fla.ops")
    torch.manual_seed(8)
    layer = KDALayer(d_model=256, n_heads=2, head_dim=128)
    x = torch.randn(2, 300, 256, generator=torch.Generator().manual_seed(9))

    def run(kernel, device, dtype):
        copied = copy.deepcopy(layer).to(device, dtype)
        if kernel is not None:
            copied.kernel = kernel
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
            y = copied(x.to(device, dtype))[0]
        y.double().square().mean().backward()
        return {"y": y.double().cpu(), **{name: p.grad.double().cpu() for name, p in copied.named_parameters()}}

    truth = run(None, "cpu", torch.float64)
    ours, fla = run(None, "cuda", torch.float32), run(fla_ops.chunk_kda, "cuda", torch.float32)
    for name in truth:
        our_error, fla_error = error_report(ours[name], truth[name]), error_report(fla[name], truth[name])
        print(f"{name}: ours {our_error}, FLA {fla_error}")
        assert our_error.rel_l2 <= max(2 * fla_error.rel_l2, 1e-2), name


@pytest.mark.gpu
def test_pieces_with_a_carried_cache_equal_the_whole_on_cuda():
    """The incremental path on stage 5's kernels (bf16 autocast): pieces of 1, 3, 63, 69 and 128 tokens,
    then three decode steps, against one call on the whole, both against the float64 layer on the CPU."""
    torch.manual_seed(11)
    layer = KDALayer(d_model=256, n_heads=2, head_dim=128)
    lengths = [1, 3, 63, 69, 128, 1, 1, 1]
    x = torch.randn(2, sum(lengths), 256, generator=torch.Generator().manual_seed(12))
    truth = layer.double()(x.double())[0]
    layer, x = layer.float().cuda(), x.cuda()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        whole = layer(x)[0]
        cache, pieces, start = None, [], 0
        for length in lengths:
            y, cache = layer(x[:, start:start + length], cache, use_cache=True)
            pieces.append(y)
            start += length
    assert cache.state.dtype == torch.float32
    whole_error, pieces_error = error_report(whole, truth), error_report(torch.cat(pieces, dim=1), truth)
    print(f"layer on CUDA vs float64: whole {whole_error}, in pieces {pieces_error}")
    assert pieces_error.rel_l2 <= max(2 * whole_error.rel_l2, 1e-2)
