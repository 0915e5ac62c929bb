"""Stage 4 library tests: the references at a realistic size, the three degenerate checks, sub-chunks,
the refuted forms, the numerics, the kernel. The checks every stage shares (references B and C against A,
among them at the seed's consistency shape, the argument checks, the identities, the kernel's compile report
and wrapper checks) are in tests/stages/test_stages.py."""

import importlib.util
import math

import numpy as np
import pytest

from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.s04_kda import identities, numerics, reference
from stages.common.oracles import channel_gated_linear_attention, delta_rule, kda_delta_rule
from stages.common.symbolic import counterexample


def _inputs(B, N, H, d_k, d_v, seed, gate_range=(0.9, 0.999)):
    return make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=gate_range, beta_range=(0.1, 0.9), seed=seed)


def test_references_agree_at_a_realistic_size():
    """One head of d_k = d_v = 64, chunks of 64 and a padded last chunk; gates down to 0.5."""
    x = _inputs(1, 200, 2, 64, 64, seed=10, gate_range=(0.5, 0.999))
    expected = reference.recurrent(x.q, x.k, x.v, x.g, x.beta)
    assert error_report(reference.chunkwise(x.q, x.k, x.v, x.g, x.beta, 64).o, expected).rel_l2 <= 1e-13
    assert error_report(reference.kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 64, 16), expected).rel_l2 <= 1e-13


@pytest.mark.parametrize("sub_chunk_size", [8, 16, 32, 64])
def test_sub_chunks_equal_recurrent(sub_chunk_size):
    """C = 128 cut into sub-chunks, gamma restarted in each: the same output as token by token."""
    x = _inputs(1, 256, 1, 16, 8, seed=12, gate_range=(0.5, 0.999))
    expected = reference.recurrent(x.q, x.k, x.v, x.g, x.beta)
    actual = reference.kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 128, 8, sub_chunk_size=sub_chunk_size)
    assert error_report(actual, expected).rel_l2 <= 1e-13


def test_recurrent_matches_the_prediction_error_form():
    x = _inputs(2, 30, 2, 8, 5, seed=2, gate_range=(0.5, 0.99))
    expected = kda_delta_rule(x.q, x.k, x.v, x.g, x.beta)
    assert error_report(reference.recurrent(x.q, x.k, x.v, x.g, x.beta), expected).rel_l2 <= 1e-13


# ------------------------------------------------------------------- the three degenerate checks


def _equal_channels(x):
    """The same inputs with every key channel given the gate of channel 0: a scalar gate."""
    return np.repeat(x.g[..., :1], x.g.shape[-1], axis=-1)


@pytest.mark.parametrize("function", ["recurrent", "chunkwise", "kernel_mirror"])
def test_equal_channels_are_gated_deltanet(function):
    x = _inputs(2, 24, 2, 8, 4, seed=3, gate_range=(0.5, 0.999))
    extra = {"chunkwise": (8,), "kernel_mirror": (8, 2)}.get(function, ())
    actual = _output(getattr(reference, function)(x.q, x.k, x.v, _equal_channels(x), x.beta, *extra))
    assert error_report(actual, delta_rule(x.q, x.k, x.v, x.beta, x.g[..., 0])).rel_l2 <= 1e-14


@pytest.mark.skipif(importlib.util.find_spec("stages.s03_gated_deltanet.reference") is None,
                    reason="stage 3 is not in this tree")
def test_equal_channels_equal_stage_3():
    from stages.s03_gated_deltanet import reference as stage_3

    x = _inputs(2, 24, 2, 8, 4, seed=3, gate_range=(0.5, 0.999))
    expected = stage_3.kernel_mirror(x.q, x.k, x.v, x.g[..., 0], x.beta, 8, 2)
    actual = reference.kernel_mirror(x.q, x.k, x.v, _equal_channels(x), x.beta, 8, 2)
    assert error_report(actual, expected).rel_l2 <= 1e-14


@pytest.mark.parametrize("function", ["recurrent", "chunkwise", "kernel_mirror"])
def test_g_zero_is_deltanet(function):
    x = _inputs(2, 24, 2, 8, 4, seed=4)
    extra = {"chunkwise": (8,), "kernel_mirror": (8, 2)}.get(function, ())
    actual = _output(getattr(reference, function)(x.q, x.k, x.v, np.zeros_like(x.g), x.beta, *extra))
    assert error_report(actual, delta_rule(x.q, x.k, x.v, x.beta)).rel_l2 <= 1e-14


def test_beta_zero_writes_nothing():
    x = _inputs(1, 20, 2, 4, 4, seed=5)
    zero = np.zeros_like(x.beta)
    assert not np.any(reference.recurrent(x.q, x.k, x.v, x.g, zero))
    assert not np.any(reference.kernel_mirror(x.q, x.k, x.v, x.g, zero, 8, 2))


def small_beta_error(scale, seed=6):
    """Relative L2 error of o(scale * beta) / scale against per-channel gated linear attention with
    values beta_j v_j: the delete term is O(beta^2), so the error is O(scale)."""
    x = _inputs(2, 32, 2, 8, 4, seed=seed, gate_range=(0.8, 0.99))
    actual = reference.kernel_mirror(x.q, x.k, x.v, x.g, scale * x.beta, 8, 2) / scale
    return error_report(actual, channel_gated_linear_attention(x.q, x.k, x.beta[..., None] * x.v, x.g)).rel_l2


def test_small_beta_is_per_channel_gated_linear_attention_to_first_order():
    errors = [small_beta_error(scale) for scale in (1e-2, 1e-3, 1e-4)]
    assert errors[-1] <= 1e-3
    for larger, smaller in zip(errors, errors[1:]):
        assert 8 <= larger / smaller <= 12.5, errors  # ten times smaller beta, ten times smaller error


# ----------------------------------------------------------------------------- bad input


def test_kernel_mirror_rejects_bad_sub_chunk_size():
    x = _inputs(1, 8, 1, 4, 6, seed=8)
    with pytest.raises(ValueError, match="sub_chunk_size must be a positive divisor of chunk_size = 4, got 3"):
        reference.kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 4, 2, sub_chunk_size=3)


# ----------------------------------------------------------------------------- identities


@pytest.mark.parametrize("build", identities.REFUTED, ids=lambda build: build.__name__)
def test_refuted_forms_differ_and_hide_when_channels_or_betas_are_equal(build):
    assert counterexample(build()) is not None
    assert build(True).holds()


def test_counterexample_finds_nothing_in_an_identity():
    assert counterexample(identities.exponent_split()) is None


# ----------------------------------------------------------------------------- numerics


def test_sampling_reproduces_the_seed_tables():
    """Every number of the seed's four numerics tables lies within the 5-95% band of its statistic
    over DRAWS chunks of 128 channels: one sampled chunk is what the seed measured."""
    samples = [s for _, s in numerics.gate_bound_rows()] + [s for _, s in numerics.spread_rows()]
    samples += [s for _, s in numerics.sub_chunk_rows()] + [s for _, s, _ in numerics.lower_bound_rows()]
    samples += [s for _, value, zeroed in numerics.underflow_rows() for s in (value, zeroed)]
    outside = [s for s in samples if not s.seed_within_band]
    assert not outside, outside


def test_sub_chunks_bound_e_minus_gamma_by_their_own_length():
    rows = dict(numerics.sub_chunk_rows())
    assert rows[16].high < rows[32].low and rows[32].high < rows[64].low and rows[64].high < rows[128].low


def test_fp16_emulation_is_fine_within_the_bound_and_breaks_beyond_it():
    from stages.s04_kda.numerics import MAX_LOG_DECAY

    rows = numerics.fp16_error_rows(lower_bounds=(0.9, 0.5))
    (_, worst_safe, safe), (_, worst_unsafe, unsafe) = rows
    assert worst_safe <= MAX_LOG_DECAY["float16"] < worst_unsafe
    assert safe.rel_l2 <= 2e-3 and not math.isfinite(unsafe.rel_l2)


# ----------------------------------------------------------------------------- the kernel


def test_kernel_respects_the_ordering_constraints():
    from stages.common.ordering import ordering_constraints
    from stages.s04_kda.kernel import build_program

    facts = ordering_constraints(build_program(1, 256, 2, 64, 64))
    assert [number for number, _, _ in facts] == [1, 2, 7]
    assert all(holds for _, _, holds in facts), facts


def _cuda_inputs(x, dtype):
    import torch

    q, k, v = (torch.tensor(a, dtype=dtype, device="cuda") for a in (x.q, x.k, x.v))
    g, beta = (torch.tensor(a, dtype=torch.float32, device="cuda") for a in (x.g, x.beta))
    return q, k, v, g, beta


@pytest.mark.gpu
@pytest.mark.parametrize("B, N, H, D", [(2, 1024, 4, 128), (1, 1000, 2, 64)])
def test_kernel_matches_reference_fp16(B, N, H, D):
    import torch

    from stages.s04_kda.kernel import forward

    x = _inputs(B, N, H, D, D, seed=B + N)
    expected = reference.recurrent(x.q, x.k, x.v, x.g, x.beta)
    error = error_report(forward(*_cuda_inputs(x, torch.float16)), expected)
    print(f"s04 kernel fp16 B={B} N={N} H={H} D={D}: {error}")
    assert error.rel_l2 <= 5e-3


@pytest.mark.gpu
def test_kernel_matches_reference_at_the_benchmark_shape():
    """B = 1, N = 4096, H = 8, D = 128 in fp16 against reference C in float64 (A would take minutes)."""
    import torch

    from stages.s04_kda.kernel import forward

    x = _inputs(1, 4096, 8, 128, 128, seed=13)
    expected = reference.kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 64, 128)
    error = error_report(forward(*_cuda_inputs(x, torch.float16)), expected)
    print(f"s04 kernel fp16 B=1 N=4096 H=8 D=128: {error}")
    assert error.rel_l2 <= 5e-3


@pytest.mark.gpu
def test_kernel_block_dv_bf16_and_chunk_32():
    """block_dv = 64 and C = 32 give the default's output; bf16 runs, with its 8 bits of mantissa."""
    import torch

    from stages.s04_kda.kernel import forward

    x = _inputs(1, 512, 2, 128, 128, seed=11)
    expected = reference.recurrent(x.q, x.k, x.v, x.g, x.beta)
    wide = error_report(forward(*_cuda_inputs(x, torch.float16), block_dv=64), expected)
    short = error_report(forward(*_cuda_inputs(x, torch.float16), chunk_size=32), expected)
    bf16 = error_report(forward(*_cuda_inputs(x, torch.bfloat16)), expected)
    print(f"s04 kernel block_dv=64 fp16: {wide}; C=32 fp16: {short}; bf16: {bf16}")
    assert wide.rel_l2 <= 5e-3 and short.rel_l2 <= 5e-3 and bf16.rel_l2 <= 3e-2


@pytest.mark.gpu
def test_kernel_below_the_gate_bound_is_refused_and_would_be_garbage():
    """Gates in [0.5, 1] at C = 64 decay by up to e^-24 in a chunk: the wrapper refuses; forced
    with max_log_decay = inf, the fp16 kernel's e^{-gamma} overflows and the output is not usable."""
    import torch

    from stages.s04_kda.kernel import forward

    x = _inputs(1, 256, 2, 64, 64, seed=14, gate_range=(0.5, 1.0))
    inputs = _cuda_inputs(x, torch.float16)
    with pytest.raises(ValueError, match="g decays by"):
        forward(*inputs)
    forced = error_report(forward(*inputs, max_log_decay=math.inf), reference.recurrent(x.q, x.k, x.v, x.g, x.beta))
    print(f"s04 kernel fp16 gates in [0.5, 1], guard overridden: {forced}")
    assert not forced.rel_l2 <= 5e-3


def test_kernel_wrapper_rejects_bad_gate_beta_and_options():
    """The wrapper's checks of g, beta and the options; tests/stages/test_stages.py checks those of q, k and v."""
    torch = pytest.importorskip("torch")
    from stages.s04_kda.kernel import forward

    q = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    g = torch.full((1, 64, 2, 64), -0.01)
    beta = torch.full((1, 64, 2), 0.5)
    positive_gate, large_beta, negative_beta, fast_gate = g.clone(), beta.clone(), beta.clone(), g.clone()
    positive_gate[0, 3, 1, 7] = 0.2
    large_beta[0, 5, 0] = 1.5
    negative_beta[0, 0, 0] = -0.1
    fast_gate[0, :, 1, 9] = math.log(0.5)  # one channel of one head halves every token: e^-44 per chunk
    cases = [
        ((q, q, q, g.half(), beta), {}, TypeError, "g must have dtype float32, got float16"),
        ((q, q, q, g[..., 0], beta), {}, ValueError, "g must have rank 4"),
        ((q, q, q, g, beta[..., None]), {}, ValueError, "beta must have rank 3"),
        ((q, q, q, g[:, :32], beta), {}, ValueError, r"g must have shape \(B, N, H, d_k\) = \(1, 64, 2, 64\)"),
        ((q, q, q, g, beta[:, :, :1].contiguous()), {}, ValueError, r"beta must have shape \(B, N, H\) = \(1, 64, 2\)"),
        ((q, q, q, g, beta), {"chunk_size": 40}, ValueError, "chunk_size must be a multiple of 16, got 40"),
        ((q, q, q, positive_gate, beta), {}, ValueError, r"g must be finite and <= 0 .* largest entry is 0.2"),
        ((q, q, q, g - float("inf"), beta), {}, ValueError, "g must be finite and <= 0"),
        ((q, q, q, g, large_beta), {}, ValueError, r"beta must lie in \[0, 1\]; its entries span \[0.5, 1.5\]"),
        ((q, q, q, g, negative_beta), {}, ValueError, r"beta must lie in \[0, 1\]; its entries span \[-0.1"),
        ((q, q, q, fast_gate, beta), {}, ValueError, r"g decays by e\^-44.4 within one chunk of 64 tokens, "
                                                     r"beyond e\^-9.7.*a >= 0.859 always passes"),
        ((q, q, q, fast_gate, beta), {"chunk_size": 16}, ValueError, r"g decays by e\^-11.1 within one chunk of 16"),
        ((q.bfloat16(), q.bfloat16(), q.bfloat16(), fast_gate, beta), {}, ValueError, "q must be on a CUDA device"),
        ((q, q, q, fast_gate, beta), {"max_log_decay": math.inf}, ValueError, "q must be on a CUDA device"),
    ]
    for args, options, error, message in cases:
        with pytest.raises(error, match=message):
            forward(*args, **options)


def _output(result):
    """o of a reference's result: reference B returns it in its ChunkwiseOutput."""
    return getattr(result, "o", result)
