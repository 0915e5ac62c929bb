"""Stage 3 library tests: reference A against the prediction-error form, the independent reductions (g = 0
is DeltaNet, small beta is gated linear attention), what the proof machinery refutes, the numerics, the
kernel. The checks every stage shares (references B and C against A, the argument checks, the identities,
the kernel's compile report and wrapper checks) are in tests/stages/test_stages.py."""

import numpy as np
import pytest

from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.common.symbolic import Identity, counterexample
from stages.s03_gated_deltanet import identities, numerics, reference
from stages.common.oracles import delta_rule, token_gated_linear_attention


def _inputs(B, N, H, d_k, d_v, seed, gate_range=(0.9, 0.999)):
    return make_inputs(B, N, H, d_k, d_v, gate="token", gate_range=gate_range, beta_range=(0.1, 0.9), seed=seed)


def test_recurrent_matches_the_prediction_error_form():
    x = _inputs(2, 30, 2, 8, 5, seed=2, gate_range=(0.5, 0.99))
    expected = delta_rule(x.q, x.k, x.v, x.beta, x.g)
    assert error_report(reference.recurrent(x.q, x.k, x.v, x.g, x.beta), expected).rel_l2 <= 1e-12


@pytest.mark.parametrize("function", ["recurrent", "chunkwise", "kernel_mirror"])
def test_g_zero_is_deltanet(function):
    x = _inputs(2, 24, 2, 8, 4, seed=3)
    extra = {"chunkwise": (8,), "kernel_mirror": (8, 2)}.get(function, ())
    actual = _output(getattr(reference, function)(x.q, x.k, x.v, np.zeros_like(x.g), x.beta, *extra))
    assert error_report(actual, delta_rule(x.q, x.k, x.v, x.beta)).rel_l2 <= 1e-12


def test_beta_zero_writes_nothing():
    x = _inputs(1, 20, 2, 4, 4, seed=4)
    zero = np.zeros_like(x.beta)
    assert not np.any(reference.recurrent(x.q, x.k, x.v, x.g, zero))
    assert not np.any(reference.kernel_mirror(x.q, x.k, x.v, x.g, zero, 8, 2))


def small_beta_error(scale, seed=5):
    """Relative L2 error of o(scale * beta) / scale against gated linear attention with values
    beta_j v_j: the delete term is O(beta^2), so the error is O(scale)."""
    x = _inputs(2, 32, 2, 8, 4, seed=seed, gate_range=(0.8, 0.99))
    actual = reference.chunkwise(x.q, x.k, x.v, x.g, scale * x.beta, 8).o / scale
    return error_report(actual, token_gated_linear_attention(x.q, x.k, x.beta[..., None] * x.v, x.g)).rel_l2


def test_small_beta_is_gated_linear_attention_to_first_order():
    errors = [small_beta_error(scale) for scale in (1e-2, 1e-3, 1e-4)]
    assert errors[-1] <= 1e-3
    for larger, smaller in zip(errors, errors[1:]):
        assert 8 <= larger / smaller <= 12.5, errors  # ten times smaller beta, ten times smaller error


# ----------------------------------------------------------------------------- identities


def test_mixed_beta_pairing_is_refuted_and_hides_when_beta_is_equal():
    mixed = identities.mixed_beta_pairing()
    assert counterexample(mixed) is not None
    betas = identities.sp.symbols(f"b0:{identities.C}", real=True)
    all_equal = {b: identities.sp.Symbol("b", real=True) for b in betas}
    assert Identity("equal beta", "", mixed.lhs.subs(all_equal), mixed.rhs.subs(all_equal)).holds()


def test_identity_check_tells_a_wrong_mask():
    """The proof machinery rejects a wrong form: A_qk with a strict mask drops each token's own term."""
    sp, C, decay = identities.sp, identities.C, identities._decay
    Q, K, V, gates, betas, S0_T = identities._symbols()
    W, A_hat = identities._ut_transform(K, gates, betas)
    strict_A_qk = sp.Matrix(C, C, lambda c, j: decay(gates, j, c) * (Q[c, :] * K[j, :].T)[0] if j < c else 0)
    Q_decayed = sp.diag(*[decay(gates, -1, r) for r in range(C)]) * Q
    wrong = Q_decayed * S0_T + strict_A_qk * (A_hat * V - W * S0_T)
    right = identities._recurrence(Q, K, V, gates, betas, S0_T)[0]
    assert counterexample(Identity("strict A_qk", "", wrong, right)) is not None


# ----------------------------------------------------------------------------- numerics


def test_unit_keys_keep_the_system_well_conditioned():
    row = numerics.study(64, key_norm=1.0, samples=4)
    # cond_inf: about 3.5 with unit keys, about 22 with keys of norm 2 (the next test's regime)
    assert row.condition < 5 and row.largest_entry_of_T <= 1 + 1e-12


def test_large_keys_make_the_system_grow_with_the_chunk():
    conditions = [numerics.study(C, key_norm=4.0, samples=4).condition for C in (8, 32)]
    assert conditions[1] > 10 * conditions[0] > 10


# ----------------------------------------------------------------------------- the kernel


def _cuda_inputs(x, dtype):
    import torch

    q, k, v = (torch.tensor(a, dtype=dtype, device="cuda") for a in (x.q, x.k, x.v))
    g, beta = (torch.tensor(a, dtype=torch.float32, device="cuda") for a in (x.g, x.beta))
    return q, k, v, g, beta


@pytest.mark.gpu
@pytest.mark.parametrize("B, N, H, D", [(2, 1024, 4, 128), (1, 8192, 2, 128), (1, 1000, 2, 64)])
def test_kernel_matches_reference_fp16(B, N, H, D):
    import torch

    from stages.s03_gated_deltanet.kernel import forward

    x = _inputs(B, N, H, D, D, seed=B + N)
    expected = reference.recurrent(x.q, x.k, x.v, x.g, x.beta)
    error = error_report(forward(*_cuda_inputs(x, torch.float16)), expected)
    print(f"s03 kernel fp16 B={B} N={N} H={H} D={D}: {error}")
    assert error.rel_l2 <= 2e-3


@pytest.mark.gpu
def test_kernel_block_dv_and_bf16():
    """block_dv = 64 gives the same output as the default; bf16 runs, with its 8 bits of mantissa."""
    import torch

    from stages.s03_gated_deltanet.kernel import forward

    x = _inputs(1, 512, 2, 128, 128, seed=11)
    expected = reference.recurrent(x.q, x.k, x.v, x.g, x.beta)
    wide = error_report(forward(*_cuda_inputs(x, torch.float16), block_dv=64), expected)
    bf16 = error_report(forward(*_cuda_inputs(x, torch.bfloat16)), expected)
    print(f"s03 kernel block_dv=64 fp16: {wide}; bf16: {bf16}")
    assert wide.rel_l2 <= 2e-3 and bf16.rel_l2 <= 2e-2


def test_kernel_wrapper_rejects_bad_gate_and_beta():
    """The wrapper's checks of g and beta; tests/stages/test_stages.py checks those of q, k and v."""
    torch = pytest.importorskip("torch")
    from stages.s03_gated_deltanet.kernel import forward

    q = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    g = torch.full((1, 64, 2), -0.1)
    beta = torch.full((1, 64, 2), 0.5)
    positive_gate, large_beta, negative_beta = g.clone(), beta.clone(), beta.clone()
    positive_gate[0, 3, 1] = 0.2
    large_beta[0, 5, 0] = 1.5
    negative_beta[0, 0, 0] = -0.1
    cases = [
        ((q, q, q, g.half(), beta), TypeError, "g must have dtype float32, got float16"),
        ((q, q, q, g, beta[..., None]), ValueError, "beta must have rank 3"),
        ((q, q, q, g[:, :32], beta), ValueError, r"g must have shape \(B, N, H\) = \(1, 64, 2\)"),
        ((q, q, q, g, beta[:, :, :1].contiguous()), ValueError, r"beta must have shape \(B, N, H\) = \(1, 64, 2\)"),
        ((q, q, q, positive_gate, beta), ValueError, r"g must be finite and <= 0 .* largest entry is 0.2"),
        ((q, q, q, g - float("inf"), beta), ValueError, "g must be finite and <= 0"),
        ((q, q, q, g, large_beta), ValueError, r"beta must lie in \[0, 1\]; its entries span \[0.5, 1.5\]"),
        ((q, q, q, g, negative_beta), ValueError, r"beta must lie in \[0, 1\]; its entries span \[-0.1"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            forward(*args)


def _output(result):
    """o of a reference's result: reference B returns it in its ChunkwiseOutput."""
    return getattr(result, "o", result)
