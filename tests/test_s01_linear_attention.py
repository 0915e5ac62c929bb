"""Stage 1 library tests: references B and C against A, the identities, the kernel."""


import numpy as np
import pytest

from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.common.symbolic import Identity, causal_mask
from stages.s01_linear_attention import identities, reference

SHAPES = [
    # B, N, H, d_k, d_v, chunk_size, block_dv
    (1, 8, 1, 4, 4, 8, 4),  # one chunk
    (2, 64, 3, 8, 6, 8, 2),  # many chunks, three blocks of value columns
    (2, 45, 2, 16, 8, 16, 4),  # N not a multiple of chunk_size
    (1, 7, 2, 4, 4, 16, 1),  # a chunk longer than the sequence
]


@pytest.mark.parametrize("B, N, H, d_k, d_v, chunk_size, block_dv", SHAPES)
def test_chunkwise_and_kernel_mirror_equal_recurrent(B, N, H, d_k, d_v, chunk_size, block_dv):
    x = make_inputs(B, N, H, d_k, d_v, seed=N)
    expected = reference.recurrent(x.q, x.k, x.v)
    assert error_report(reference.chunkwise(x.q, x.k, x.v, chunk_size), expected).rel_l2 <= 1e-12
    assert error_report(reference.kernel_mirror(x.q, x.k, x.v, chunk_size, block_dv), expected).rel_l2 <= 1e-12


def test_kernel_mirror_independent_of_block_dv():
    x = make_inputs(2, 40, 2, 8, 8, seed=1)
    results = [reference.kernel_mirror(x.q, x.k, x.v, 8, block_dv) for block_dv in (1, 2, 4, 8)]
    for result in results[1:]:
        assert error_report(result, results[0]).rel_l2 <= 1e-14


@pytest.mark.parametrize("function", [reference.recurrent, reference.chunkwise, reference.kernel_mirror])
def test_references_reject_mismatched_shapes(function):
    x = make_inputs(1, 8, 2, 4, 4, seed=2)
    extra = {reference.chunkwise: (4,), reference.kernel_mirror: (4, 2)}.get(function, ())
    with pytest.raises(ValueError, match="k must have q's shape"):
        function(x.q, x.k[:, :, :1], x.v, *extra)
    with pytest.raises(ValueError, match="v must be"):
        function(x.q, x.k, x.v[:, :4], *extra)
    with pytest.raises(ValueError, match="rank 4"):
        function(x.q[0], x.k, x.v, *extra)


def test_kernel_mirror_rejects_bad_block_dv():
    x = make_inputs(1, 8, 1, 4, 6, seed=3)
    with pytest.raises(ValueError, match="block_dv"):
        reference.kernel_mirror(x.q, x.k, x.v, 4, 4)


@pytest.mark.parametrize("build", identities.IDENTITIES, ids=lambda build: build.__name__)
def test_identity_holds(build):
    assert build().holds()


def test_identity_check_tells_a_wrong_mask():
    """The proof machinery rejects a wrong form: the strict mask drops each token's own term."""
    Q, K, V, S0_T = identities._symbols()
    right = identities._chunked(Q, K, V, S0_T, identities.C)[0]
    Qc, Kc, Vc = Q[:2, :], K[:2, :], V[:2, :]
    strict = Qc * S0_T + (Qc * Kc.T).multiply_elementwise(causal_mask(2, include_diagonal=False)) * Vc
    assert not Identity("strict", "", strict, right[:2, :]).holds()


# ----------------------------------------------------------------------------- the kernel


@pytest.mark.compile
def test_kernel_compiles_for_sm90a_without_spills():
    from stages.s01_linear_attention.kernel import compile_report

    report = compile_report(B=2, N=1024, H=4, d_k=128, d_v=128)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.summary()
    assert not report.divergent_barriers, report.divergent_barriers  # a barrier some warps skip hangs the GPU
    assert not report.misplaced_warp_group_operands, report.misplaced_warp_group_operands  # wrong columns read
    assert 0 < report.registers <= 255
    assert report.shared_memory <= 227 * 1024
    assert "linear_attention_fwd" in report.cuda_source or "main_kernel" in report.cuda_source


def _cuda_inputs(x, dtype):
    import torch

    return [torch.tensor(a, dtype=dtype, device="cuda") for a in (x.q, x.k, x.v)]


@pytest.mark.gpu
@pytest.mark.parametrize("B, N, H, D", [(2, 1024, 4, 128), (1, 16384, 2, 128), (1, 1000, 2, 64)])
def test_kernel_matches_reference_fp16(B, N, H, D):
    import torch

    from stages.s01_linear_attention.kernel import forward

    x = make_inputs(B, N, H, D, D, seed=B + N)
    expected = reference.recurrent(x.q, x.k, x.v)
    error = error_report(forward(*_cuda_inputs(x, torch.float16)), expected)
    print(f"s01 kernel fp16 B={B} N={N} H={H} D={D}: {error}")
    assert error.rel_l2 <= 2e-3


def test_kernel_wrapper_rejects_bad_input():
    torch = pytest.importorskip("torch")
    from stages.s01_linear_attention.kernel import forward

    q = torch.zeros(1, 64, 2, 64, dtype=torch.float16)
    cases = [
        ((q, q, q), ValueError, "q must be on a CUDA device"),
        ((q.float(), q, q), TypeError, "q must have dtype float16 or bfloat16, got float32"),
        ((q[0], q, q), ValueError, "q must have rank 4"),
        ((q, np.zeros(3), q), TypeError, "k must be a torch.Tensor"),
        ((q, q[:, :32], q), ValueError, r"k must have the shape of q, \(1, 64, 2, 64\)"),
        ((q, q, q[:, :32]), ValueError, r"v must be \(B, N, H, d_v\) = \(1, 64, 2, d_v\)"),
        ((q, q, q.bfloat16()), ValueError, "v must have the dtype of q"),
        ((q.transpose(1, 2).contiguous().transpose(1, 2), q, q), ValueError, "q must be contiguous"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            forward(*args)
