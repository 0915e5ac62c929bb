"""Stage 3 library tests: references B and C against A, the independent reductions (g = 0 is DeltaNet,
small beta is gated linear attention), the identities, the numerics, the kernel."""


import numpy as np
import pytest

from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.common.symbolic import Identity, counterexample
from stages.s03_gated_deltanet import identities, numerics, reference
from stages.common.oracles import delta_rule, token_gated_linear_attention

SHAPES = [
    # B, N, H, d_k, d_v, chunk_size, block_dv
    (1, 8, 1, 4, 4, 8, 4),  # one chunk
    (2, 64, 3, 8, 6, 8, 2),  # many chunks, three blocks of value columns
    (2, 45, 2, 16, 8, 16, 4),  # N not a multiple of chunk_size: B ragged, C padded
    (1, 7, 2, 4, 4, 16, 1),  # a chunk longer than the sequence
]


def _inputs(B, N, H, d_k, d_v, seed, gate_range=(0.9, 0.999)):
    return make_inputs(B, N, H, d_k, d_v, gate="token", gate_range=gate_range, beta_range=(0.1, 0.9), seed=seed)


@pytest.mark.parametrize("B, N, H, d_k, d_v, chunk_size, block_dv", SHAPES)
def test_chunkwise_and_kernel_mirror_equal_recurrent(B, N, H, d_k, d_v, chunk_size, block_dv):
    x = _inputs(B, N, H, d_k, d_v, seed=N)
    expected = reference.recurrent(x.q, x.k, x.v, x.g, x.beta)
    assert error_report(reference.chunkwise(x.q, x.k, x.v, x.g, x.beta, chunk_size), expected).rel_l2 <= 1e-12
    mirror = reference.kernel_mirror(x.q, x.k, x.v, x.g, x.beta, chunk_size, block_dv)
    assert error_report(mirror, expected).rel_l2 <= 1e-12


def test_kernel_mirror_independent_of_block_dv():
    x = _inputs(2, 40, 2, 8, 8, seed=1)
    results = [reference.kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 8, block_dv) for block_dv in (1, 2, 4, 8)]
    for result in results[1:]:
        assert error_report(result, results[0]).rel_l2 <= 1e-14


def test_recurrent_matches_the_prediction_error_form():
    x = _inputs(2, 30, 2, 8, 5, seed=2, gate_range=(0.5, 0.99))
    expected = delta_rule(x.q, x.k, x.v, x.beta, x.g)
    assert error_report(reference.recurrent(x.q, x.k, x.v, x.g, x.beta), expected).rel_l2 <= 1e-12


@pytest.mark.parametrize("function", ["recurrent", "chunkwise", "kernel_mirror"])
def test_g_zero_is_deltanet(function):
    x = _inputs(2, 24, 2, 8, 4, seed=3)
    extra = {"chunkwise": (8,), "kernel_mirror": (8, 2)}.get(function, ())
    actual = getattr(reference, function)(x.q, x.k, x.v, np.zeros_like(x.g), x.beta, *extra)
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
    actual = reference.chunkwise(x.q, x.k, x.v, x.g, scale * x.beta, 8) / scale
    return error_report(actual, token_gated_linear_attention(x.q, x.k, x.beta[..., None] * x.v, x.g)).rel_l2


def test_small_beta_is_gated_linear_attention_to_first_order():
    errors = [small_beta_error(scale) for scale in (1e-2, 1e-3, 1e-4)]
    assert errors[-1] <= 1e-3
    for larger, smaller in zip(errors, errors[1:]):
        assert 8 <= larger / smaller <= 12.5, errors  # ten times smaller beta, ten times smaller error


@pytest.mark.parametrize("function", [reference.recurrent, reference.chunkwise, reference.kernel_mirror])
def test_references_reject_mismatched_shapes(function):
    x = _inputs(1, 8, 2, 4, 4, seed=6)
    extra = {reference.chunkwise: (4,), reference.kernel_mirror: (4, 2)}.get(function, ())
    with pytest.raises(ValueError, match="k must have q's shape"):
        function(x.q, x.k[:, :, :1], x.v, x.g, x.beta, *extra)
    with pytest.raises(ValueError, match="v must be"):
        function(x.q, x.k, x.v[:, :4], x.g, x.beta, *extra)
    with pytest.raises(ValueError, match="rank 4"):
        function(x.q[0], x.k, x.v, x.g, x.beta, *extra)
    with pytest.raises(ValueError, match=r"g must have shape \(1, 8, 2\)"):
        function(x.q, x.k, x.v, x.g[..., None], x.beta, *extra)
    with pytest.raises(ValueError, match=r"beta must have shape \(B, N, H\)"):
        function(x.q, x.k, x.v, x.g, x.beta[:, :4], *extra)


def test_kernel_mirror_rejects_bad_block_dv():
    x = _inputs(1, 8, 1, 4, 6, seed=7)
    with pytest.raises(ValueError, match="block_dv"):
        reference.kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 4, 4)


# ----------------------------------------------------------------------------- identities


@pytest.mark.parametrize("build", identities.IDENTITIES, ids=lambda build: build.__name__)
def test_identity_holds(build):
    assert build().holds()


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


@pytest.mark.compile
def test_kernel_compiles_for_sm90a_without_spills():
    from stages.s03_gated_deltanet.kernel import compile_report

    report = compile_report(B=2, N=1024, H=4, d_k=128, d_v=128)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.summary()
    assert not report.divergent_barriers, report.divergent_barriers  # a barrier some warps skip hangs the GPU
    assert not report.misplaced_warp_group_operands, report.misplaced_warp_group_operands  # wrong columns read
    assert 0 < report.registers <= 255
    assert report.shared_memory <= 227 * 1024
    assert "gated_deltanet_fwd" in report.cuda_source


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


def test_kernel_wrapper_rejects_bad_input():
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
        ((q, q, q, g, beta), ValueError, "q must be on a CUDA device"),
        ((q.float(), q, q, g, beta), TypeError, "q must have dtype float16 or bfloat16, got float32"),
        ((q[0], q, q, g, beta), ValueError, "q must have rank 4"),
        ((q, np.zeros(3), q, g, beta), TypeError, "k must be a torch.Tensor"),
        ((q, q, q, g.half(), beta), TypeError, "g must have dtype float32, got float16"),
        ((q, q, q, g, beta[..., None]), ValueError, "beta must have rank 3"),
        ((q, q[:, :32], q, g, beta), ValueError, r"k must have the shape of q, \(1, 64, 2, 64\)"),
        ((q, q, q[:, :32], g, beta), ValueError, r"v must be \(B, N, H, d_v\) = \(1, 64, 2, d_v\)"),
        ((q, q, q, g[:, :32], beta), ValueError, r"g must have shape \(B, N, H\) = \(1, 64, 2\)"),
        ((q, q, q, g, beta[:, :, :1].contiguous()), ValueError, r"beta must have shape \(B, N, H\) = \(1, 64, 2\)"),
        ((q, q, q.bfloat16(), g, beta), ValueError, "v must have the dtype of q"),
        ((q.transpose(1, 2).contiguous().transpose(1, 2), q, q, g, beta), ValueError, "q must be contiguous"),
        ((q, q, q, positive_gate, beta), ValueError, r"g must be finite and <= 0 .* largest entry is 0.2"),
        ((q, q, q, g - float("inf"), beta), ValueError, "g must be finite and <= 0"),
        ((q, q, q, g, large_beta), ValueError, r"beta must lie in \[0, 1\]; its entries span \[0.5, 1.5\]"),
        ((q, q, q, g, negative_beta), ValueError, r"beta must lie in \[0, 1\]; its entries span \[-0.1"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            forward(*args)
