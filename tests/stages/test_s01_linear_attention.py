"""Stage 1 library tests: what the proof machinery refutes, the kernel on the GPU. The checks every stage
shares (references B and C against A, the argument checks, the identities, the kernel's compile report and
wrapper checks) are in tests/stages/test_stages.py."""

import pytest

from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.common.symbolic import Identity, causal_mask
from stages.s01_linear_attention import identities, reference


def test_identity_check_tells_a_wrong_mask():
    """The proof machinery rejects a wrong form: the strict mask drops each token's own term."""
    Q, K, V, S0_T = identities._symbols()
    right = identities._chunked(Q, K, V, S0_T, identities.C)[0]
    Qc, Kc, Vc = Q[:2, :], K[:2, :], V[:2, :]
    strict = Qc * S0_T + (Qc * Kc.T).multiply_elementwise(causal_mask(2, include_diagonal=False)) * Vc
    assert not Identity("strict", "", strict, right[:2, :]).holds()


# ----------------------------------------------------------------------------- the kernel


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
