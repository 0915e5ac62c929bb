"""Stage 6 KDA layer: the incremental path (pieces with a carried cache equal one call on the whole),
packed sequences of unequal lengths (cu_seqlens) against each sequence alone, causality, gradients to
every parameter, the forget gate's parametrization; on a GPU, the layer on stage 5/6's kernels against
the same layer on FLA's chunk_kda."""

import pytest
import torch

from stages.common.errors import error_report
from stages.kda.autograd import CPU_CHUNK_SIZE
from stages.kda.layer import A_RANGE, DT_RANGE, ForgetGate, KDALayer

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


def _served_by_stage_7(q, k, v, g, beta, initial_state=None, output_final_state=False,
                       use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """chunk_kda's calling convention with FLA's cu_seqlens (no autograd), on stage 7's reference C: the
    packed batch in one pass, one state per sequence."""
    import numpy as np

    from stages.kda.inputs import InputForm, activate
    from stages.s07_serving.reference import kernel_mirror

    form = InputForm(l2_normalize=use_qk_l2norm_in_kernel, scale=q.shape[-1] ** -0.5)
    q, k, g, beta = activate(form, q, k, g, beta)
    o, states = kernel_mirror(*(t.numpy() for t in (q, k, v, g, beta)), C, 4, np.asarray(cu_seqlens),
                              None if initial_state is None else initial_state.numpy(), output_final_state=True,
                              sub_block=4)
    return torch.from_numpy(o), torch.from_numpy(states) if output_final_state else None


FIRST_LENGTHS, SECOND_LENGTHS = [5, 0, 1, C + 3, 3], [3, 4, 2, 1, C + 1]  # two packed prefills of 5 sequences


def test_packed_sequences_of_unequal_lengths_equal_each_sequence_alone():
    """Two packed calls (cu_seqlens) of five sequences of unequal lengths, empty and one-token pieces
    among them, the second from the first's cache: each sequence's y and its row of the cache (the
    convolutions' last inputs, the state) equal the sequence run alone through the layer in one call.
    A convolution over the packed row would read the end of the sequence before."""
    layer = _layer(seed=12)
    totals = [a + b for a, b in zip(FIRST_LENGTHS, SECOND_LENGTHS)]
    alone = [_x(1, total, seed=20 + i) for i, total in enumerate(totals)]
    expected = [layer(x, use_cache=True) for x in alone]
    with torch.no_grad():
        layer.kernel = _served_by_stage_7
        cache, ys = None, []
        for first, lengths in ((True, FIRST_LENGTHS), (False, SECOND_LENGTHS)):
            pieces = [x[:, :n] if first else x[:, FIRST_LENGTHS[i]:] for i, (x, n) in enumerate(zip(alone, lengths))]
            cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
            y, cache = layer(torch.cat(pieces, dim=1), cache, use_cache=True, cu_seqlens=cu_seqlens)
            ys.append(y.split(lengths, dim=1))
    for i, (y_alone, cache_alone) in enumerate(expected):
        assert error_report(torch.cat([ys[0][i], ys[1][i]], dim=1), y_alone).rel_l2 <= 1e-12, i
        for name, whole, packed in zip(cache_alone._fields, cache_alone, cache):
            assert packed.shape[0] == len(totals), name
            assert error_report(packed[i:i + 1], whole).max_abs <= 1e-12, (i, name)


def test_packed_convolution_refuses_offsets_that_do_not_cover_the_row():
    layer = _layer()
    for bad in ([0, 3, 2, 7], [0, 3, 6], [1, 7]):
        with pytest.raises(ValueError, match="cu_seqlens must run from 0 to T = 7"):
            layer.q_conv(torch.zeros(1, 7, 16, dtype=torch.float64), None, torch.tensor(bad))


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
    """The layer hands the kernel FLA's arguments: beta in (0, 1), g <= 0, the L2 norm asked of it, and
    its own checks and disable_recompute when given."""
    calls = []

    def recording_kernel(q, k, v, g, beta, **options):
        calls.append(options)
        assert (beta > 0).all() and (beta < 1).all() and (g <= 0).all()
        from stages.kda.autograd import chunk_kda
        return chunk_kda(q, k, v, g, beta, **options)

    layer = _layer(kernel=recording_kernel)
    layer(_x(1, 4, seed=7))
    assert calls == [{"initial_state": None, "output_final_state": False, "use_qk_l2norm_in_kernel": True}]
    for checks in ("device", "host", "off"):  # the layer's checks, handed to the kernel as chunk_kda's
        calls.clear()
        _layer(kernel=recording_kernel, checks=checks)(_x(1, 4, seed=7))
        assert calls == [{"initial_state": None, "output_final_state": False, "use_qk_l2norm_in_kernel": True,
                          "checks": checks}]
    calls.clear()  # FLA's option, asked of the kernel only when set (the CPU path recomputes whatever it is)
    _layer(kernel=recording_kernel, disable_recompute=True)(_x(1, 4, seed=7))
    assert calls == [{"initial_state": None, "output_final_state": False, "use_qk_l2norm_in_kernel": True,
                      "disable_recompute": True}]


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
