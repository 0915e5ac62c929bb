"""Stage 2 library tests: reference A against the quadratic form, the limits g = 0 and alpha near 0, the
decay table, what the proof machinery refutes, the numerics, the kernel. The checks every stage shares
(references B and C against A, the argument checks, the identities, the kernel's compile report and wrapper
checks) are in tests/stages/test_stages.py."""

import numpy as np
import pytest

from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.common.symbolic import Identity
from stages.s01_linear_attention import reference as stage1
from stages.s02_scalar_decay import identities, numerics, reference
from stages.common.oracles import scalar_decay_attention

STRONG_DECAY = (0.5, 0.99)  # alpha^C far from 1 at these chunk sizes, so every decay counts


def test_recurrent_equals_quadratic_form():
    x = make_inputs(2, 30, 3, 8, 5, gate="head", gate_range=STRONG_DECAY, seed=11)
    expected = scalar_decay_attention(x.q, x.k, x.v, x.g)
    assert error_report(reference.recurrent(x.q, x.k, x.v, x.g), expected).rel_l2 <= 1e-12


def test_no_decay_is_stage_1_exactly():
    """g = 0: alpha = e^0 = 1 exactly, so every decay is a multiplication by 1 and the results are
    stage 1's bit for bit."""
    x = make_inputs(2, 20, 2, 8, 6, seed=12)
    no_decay = np.zeros(2)
    assert np.array_equal(reference.recurrent(x.q, x.k, x.v, no_decay), stage1.recurrent(x.q, x.k, x.v))
    for field, stage1_field in zip(reference.chunkwise(x.q, x.k, x.v, no_decay, 8), stage1.chunkwise(x.q, x.k, x.v, 8)):
        assert np.array_equal(field, stage1_field)  # o, the chunk start states and the scores
    assert np.array_equal(reference.kernel_mirror(x.q, x.k, x.v, no_decay, 8, 3),
                          stage1.kernel_mirror(x.q, x.k, x.v, 8, 3))


def test_alpha_near_zero_keeps_only_the_current_token():
    """alpha = e^-50 underflows every power alpha^n, n >= 1, below 1e-21: o_t = (q_t . k_t) v_t."""
    x = make_inputs(1, 12, 2, 4, 3, seed=13)
    expected = np.einsum("bthd,bthd->bth", x.q, x.k)[..., None] * x.v
    g = np.full(2, -50.0)
    for actual in (reference.recurrent(x.q, x.k, x.v, g), reference.chunkwise(x.q, x.k, x.v, g, 4).o,
                   reference.kernel_mirror(x.q, x.k, x.v, g, 4, 1)):
        assert error_report(actual, expected).rel_l2 <= 1e-12


def test_decay_table_is_one_table_for_every_chunk():
    """The table kernel_mirror builds once equals, for a chunk starting at token s, the ratios of the
    cumulative products alpha^(s+i) / alpha^(s+j) counted from the sequence start."""
    alpha, size, start = 0.9, 8, 40
    P = alpha ** np.arange(1, start + size + 1, dtype=float)  # alpha^t, t = 1..
    chunk = P[start:start + size]
    from_sequence_start = np.tril(chunk[:, None] / chunk[None, :])
    np.testing.assert_allclose(reference.decay_table(np.log(alpha), size), from_sequence_start, rtol=1e-12)


def test_identity_check_tells_a_state_decayed_after_the_chunk():
    """The proof machinery rejects a wrong form: decaying the state after adding the chunk."""
    Q, K, V, S0_T = identities._symbols()
    wrong = identities._chunked(Q, K, V, S0_T, identities.C, state_decay_first=False)[0]
    identity = Identity("decay after", "", wrong, identities._recurrence(Q, K, V, S0_T)[0])
    assert any(entry != 0 for entry in identity.difference())  # some entry simplifies to a nonzero expression


# ----------------------------------------------------------------------------- numerics


def test_factorized_table_overflows_fp16_where_the_ratio_does_not():
    """The seed's NaN: at C = 64 the factor alpha^(-j) leaves fp16 for alpha < 65504^(-1/64)."""
    C = 64
    threshold = np.float64(np.finfo(np.float16).max) ** (-1 / C)
    assert abs(numerics.overflow_threshold(C, np.float16) - threshold) < 1e-4
    for alpha in (0.85, 0.9):
        assert np.isfinite(numerics.factorized_decay_table(np.log(alpha), C, np.float16)).all()
    for alpha in (0.84, 0.8, 0.5):
        assert not np.isfinite(numerics.factorized_decay_table(np.log(alpha), C, np.float16)).all()
        assert np.isfinite(reference.decay_table(np.log(alpha), C, np.float16)).all()


def test_fp16_intra_chunk_term_is_nan_with_the_factorized_table_only():
    by_alpha = {row["alpha"]: row for row in numerics.factorized_vs_ratio(alphas=[0.9, 0.8])}
    assert np.isnan(by_alpha[0.8]["factorized_error"])
    assert by_alpha[0.9]["factorized_error"] < 2e-3
    assert all(row["ratio_error"] < 2e-3 for row in by_alpha.values())


def test_chunk_reset_bounds_the_cumulative_product():
    rows = numerics.cumulative_product_range(lengths=[64, 4096], alphas=[0.99])
    short, long = rows
    assert short["per_chunk_smallest"] == long["per_chunk_smallest"] == pytest.approx(0.99 ** 64)
    assert short["smallest_fp16"] > 0 and np.isfinite(short["largest_fp16"])
    assert long["smallest_fp16"] == 0 and np.isinf(long["largest_fp16"])  # alpha^4096 ~ 1e-18


# ----------------------------------------------------------------------------- the kernel


@pytest.mark.compile
def test_kernel_decays_with_exp2_only():
    """Every decay is a power of two (exp2), none a natural exponential; tests/stages/test_stages.py checks the
    rest of the report."""
    from kdacourse.pages.s02_scalar_decay import COMPILE_SHAPE
    from stages.s02_scalar_decay.kernel import compile_report

    # called as the page's report calls it, so that one nvcc run (cached) serves both
    report = compile_report(**COMPILE_SHAPE, chunk_size=64, block_dv=32, threads=128)
    assert "exp2" in report.cuda_source and "expf(" not in report.cuda_source


def _cuda_inputs(x, dtype):
    import torch

    q, k, v = (torch.tensor(a, dtype=dtype, device="cuda") for a in (x.q, x.k, x.v))
    return q, k, v, torch.tensor(x.g, dtype=torch.float32, device="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize(
    "B, N, H, D, gate_range",
    [
        (2, 1024, 4, 128, (0.9, 0.999)),
        (1, 16384, 2, 128, (0.9, 0.999)),  # long: the state carries 256 chunks
        (1, 1000, 2, 64, (0.5, 0.999)),  # padded last chunk; strong decay the ratio form keeps finite
    ],
)
def test_kernel_matches_reference_fp16(B, N, H, D, gate_range):
    import torch

    from stages.s02_scalar_decay.kernel import forward

    x = make_inputs(B, N, H, D, D, gate="head", gate_range=gate_range, seed=B + N)
    expected = reference.recurrent(x.q, x.k, x.v, x.g)
    error = error_report(forward(*_cuda_inputs(x, torch.float16)), expected)
    print(f"s02 kernel fp16 B={B} N={N} H={H} D={D} gates {gate_range}: {error}")
    assert error.rel_l2 <= 2e-3


def test_kernel_wrapper_rejects_bad_gate():
    """The wrapper's checks of g; tests/stages/test_stages.py checks those of q, k and v."""
    torch = pytest.importorskip("torch")
    from stages.s02_scalar_decay.kernel import forward

    q = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    g = torch.full((2,), -0.1)
    cases = [
        ((q, q, q, g.double()), TypeError, "g must have dtype float32, got float64"),
        ((q, q, q, g[None]), ValueError, "g must have rank 1"),
        ((q, q, q, g[:1]), ValueError, r"g must have shape \(H,\) = \(2,\)"),
        ((q, q, q, torch.tensor([-0.1, 0.2])), ValueError, r"g must be finite and <= 0 .* largest entry is 0.2"),
        ((q, q, q, torch.tensor([-0.1, -float("inf")])), ValueError, r"g must be finite .* -inf makes exp2\(0 \* -inf\) = NaN"),
        ((q, q, q, torch.tensor([-0.1, float("nan")])), ValueError, "g must be finite and <= 0 .* largest entry is nan"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            forward(*args)
