"""Stage 5 library tests: references B and C against A, the block inverse, the anchored scores in
fp16, the state carried across calls, the identities, the kernels (compile-only here, on a GPU with
the gpu marker)."""


import numpy as np
import pytest

from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.s05_fast_kda import identities, reference
from tests.exercises.s05_fast_kda.oracle import decayed_scores, kda_delta_rule

GATES, BETAS = (0.9, 0.999), (0.1, 0.9)

SHAPES = [
    # B, N, H, d_k, d_v, chunk_size, block_dv, sub_block
    (1, 16, 1, 4, 4, 16, 4, 4),  # one chunk
    (2, 64, 2, 8, 6, 16, 2, 4),  # many chunks, three blocks of value columns
    (2, 45, 2, 16, 8, 16, 4, 8),  # N not a multiple of chunk_size
    (1, 128, 1, 16, 16, 64, 8, 16),  # the kernel's chunk and sub-block
    (1, 7, 2, 4, 4, 8, 1, 1),  # a chunk longer than the sequence, one-row sub-blocks
]


def _inputs(B, N, H, d_k, d_v, seed, gate_range=GATES):
    return make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=gate_range, beta_range=BETAS, seed=seed)


@pytest.mark.parametrize("B, N, H, d_k, d_v, chunk_size, block_dv, sub_block", SHAPES)
def test_chunkwise_and_kernel_mirror_equal_recurrent(B, N, H, d_k, d_v, chunk_size, block_dv, sub_block):
    x = _inputs(B, N, H, d_k, d_v, seed=N)
    expected = reference.recurrent(x.q, x.k, x.v, x.g, x.beta)
    assert error_report(reference.chunkwise(x.q, x.k, x.v, x.g, x.beta, chunk_size), expected).rel_l2 <= 1e-12
    actual = reference.kernel_mirror(x.q, x.k, x.v, x.g, x.beta, chunk_size, block_dv, sub_block)
    assert error_report(actual, expected).rel_l2 <= 1e-12


def test_kernel_mirror_matches_the_delta_rule_oracle_with_strong_gates():
    """Gates down to 0.3: the anchors keep every factor bounded, float64 shows no difference."""
    x = _inputs(1, 96, 2, 16, 8, seed=4, gate_range=(0.3, 0.999))
    expected, _ = kda_delta_rule(x.q, x.k, x.v, x.g, x.beta)
    assert error_report(reference.kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 32, 4, 8), expected).rel_l2 <= 1e-12


def test_kernel_mirror_independent_of_block_dv():
    x = _inputs(2, 40, 2, 8, 8, seed=1)
    results = [reference.kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 8, block_dv, 4) for block_dv in (1, 2, 4, 8)]
    for result in results[1:]:
        assert error_report(result, results[0]).rel_l2 <= 1e-14


def test_recurrence_carries_the_state_across_calls():
    """Two halves, the first half's final state passed as the second's initial state, give the whole."""
    x = _inputs(2, 64, 2, 8, 6, seed=5)
    expected, expected_state = kda_delta_rule(x.q, x.k, x.v, x.g, x.beta)
    halves = [slice(0, 32), slice(32, 64)]
    state, outputs = None, []
    for rows in halves:
        tensors = reference.prepare(x.q[:, rows], x.k[:, rows], x.v[:, rows], x.g[:, rows], x.beta[:, rows], 16, 4)
        o, state = reference.recurrence(tensors, 3, initial_state=state)
        outputs.append(o)
    assert error_report(np.concatenate(outputs, axis=1), expected).rel_l2 <= 1e-12
    assert error_report(state, expected_state).rel_l2 <= 1e-12


@pytest.mark.parametrize("C, block", [(64, 16), (48, 16), (12, 3), (8, 1)])
def test_block_inverse_equals_the_inverse(C, block):
    rng = np.random.default_rng(C + block)
    L = np.tril(rng.uniform(-0.5, 0.5, (C, C)), -1)
    expected = np.linalg.inv(np.eye(C) + L)
    assert np.max(np.abs(reference.block_inverse(L, block) - expected)) <= 1e-12 * np.max(np.abs(expected))


@pytest.mark.parametrize("sub_block", [16, 8, 4, 1])
def test_intra_chunk_scores_equal_the_definition(sub_block):
    x = _inputs(1, 64, 1, 16, 4, seed=sub_block, gate_range=(0.5, 0.999))
    Q, K = x.q[0, :, 0], x.k[0, :, 0]
    gamma = np.cumsum(x.g[0, :, 0], axis=0)
    for actual, expected in zip(reference.intra_chunk_scores(Q, K, gamma, sub_block), decayed_scores(Q, K, gamma)):
        assert np.max(np.abs(actual - expected)) <= 1e-13


def test_anchored_scores_survive_fp16_where_the_chunk_start_anchor_overflows():
    """Gates near 0.5: e^{-gamma} from the chunk start reaches 2^63, far past fp16's 65504; the
    anchored operands stay <= 1 off the diagonal blocks and <= 2^8 on them."""
    x = _inputs(1, 64, 1, 32, 4, seed=6, gate_range=(0.5, 0.55))
    Q, K = x.q[0, :, 0], x.k[0, :, 0]
    gamma = np.cumsum(x.g[0, :, 0], axis=0)
    assert np.max(np.exp(-gamma)) > np.finfo(np.float16).max
    expected = decayed_scores(Q, K, gamma)
    for actual, exact in zip(reference.intra_chunk_scores(Q, K, gamma, 16, np.float16), expected):
        assert np.all(np.isfinite(actual))
        assert error_report(actual, exact).rel_l2 <= 2e-3


def test_prepare_rounds_like_the_kernel_in_fp16():
    """The fp16 mirror of the prepare kernel stays within fp16's rounding of the float64 result."""
    x = _inputs(1, 128, 2, 32, 16, seed=7, gate_range=(0.5, 0.999))
    expected, _ = kda_delta_rule(x.q, x.k, x.v, x.g, x.beta)
    o, _ = reference.recurrence(reference.prepare(x.q, x.k, x.v, x.g, x.beta, 64, 16, np.float16), 8)
    assert error_report(o, expected).rel_l2 <= 3e-3


@pytest.mark.parametrize("function", [reference.chunkwise, reference.kernel_mirror, reference.prepare])
def test_references_reject_mismatched_shapes(function):
    x = _inputs(1, 8, 2, 4, 4, seed=2)
    extra = {reference.kernel_mirror: (4, 2)}.get(function, (4,))
    with pytest.raises(ValueError, match="k must have q's shape"):
        function(x.q, x.k[:, :, :1], x.v, x.g, x.beta, *extra)
    with pytest.raises(ValueError, match="v must be"):
        function(x.q, x.k, x.v[:, :4], x.g, x.beta, *extra)
    with pytest.raises(ValueError, match="g must have shape"):
        function(x.q, x.k, x.v, x.g[..., 0], x.beta, *extra)
    with pytest.raises(ValueError, match="beta must have shape"):
        function(x.q, x.k, x.v, x.g, x.beta[:, :4], *extra)


def test_prepare_rejects_a_sub_block_that_does_not_divide_the_chunk():
    x = _inputs(1, 8, 1, 4, 4, seed=3)
    with pytest.raises(ValueError, match="sub_block"):
        reference.prepare(x.q, x.k, x.v, x.g, x.beta, 8, 3)


@pytest.mark.parametrize("build", identities.IDENTITIES, ids=lambda build: build.__name__)
def test_identity_holds(build):
    assert build().holds()


# ----------------------------------------------------------------------------- the kernels


@pytest.mark.compile
@pytest.mark.parametrize("dtype_name, low, high", [("bfloat16", 2e-3, 6e-3), ("float16", 2e-3 / 8, 6e-3 / 8)])
def test_rounding_floor_is_the_dtypes_own(dtype_name, low, high):
    """The floor the GPU tests hold the kernels to lies where the dtype's precision puts it:
    bf16 keeps 8 significant bits (2^-9 relative rounding), fp16 11 (2^-12), so fp16's window is bf16's
    divided by 8. Rounding only the output, not q, k, v, gives about half the floor: below both windows."""
    x = _inputs(2, 256, 2, 64, 64, seed=14)
    assert low <= _rounding_floor(x, dtype_name) <= high


@pytest.mark.parametrize("kernel, value_flags", [("prepare", False), ("prepare", True), ("recurrence", False)])
def test_kernels_compile_for_sm90a_without_spills(kernel, value_flags):
    """Both kernels, the prepare also as forward's default builds it (value_flags: Flags written by
    the lanes that find a bad value, none of them in a branch some warps skip at a barrier)."""
    from stages.kda.compiled import compile_report

    report = compile_report(kernel, B=2, N=1024, H=4, d_k=128, d_v=128, value_flags=value_flags)
    assert report.spill_stores == 0 and report.spill_loads == 0, report.summary()
    assert not report.divergent_barriers, report.divergent_barriers  # a barrier some warps skip hangs the GPU
    assert not report.misplaced_warp_group_operands, report.misplaced_warp_group_operands  # wrong columns read
    assert 0 < report.registers <= 255
    assert report.shared_memory <= 227 * 1024
    assert f"kda_{kernel}" in report.cuda_source or "main_kernel" in report.cuda_source


def _cuda_inputs(x, dtype):
    import torch

    q, k, v = (torch.tensor(a, dtype=dtype, device="cuda") for a in (x.q, x.k, x.v))
    g, beta = (torch.tensor(a, dtype=torch.float32, device="cuda") for a in (x.g, x.beta))
    return q, k, v, g, beta


def _rounding_floor(x, dtype_name):
    """The error an exact computation has from the dtype alone: q, k, v rounded to the kernel's input
    dtype, the recurrence run in float64, the output rounded to that dtype, against the unrounded
    float64 output. No kernel in that dtype can be below it (bf16: about 3.3e-3 at B=2, N=1024, H=4,
    D=128; fp16: about 4.2e-4); the kernels are held to twice it."""
    import torch

    from benchmarks.plain_torch import kda

    dtype = getattr(torch, dtype_name)
    exact_inputs = [torch.tensor(a) for a in (x.q, x.k, x.v, x.g, x.beta)]
    rounded = [a.to(dtype).double() if i < 3 else a for i, a in enumerate(exact_inputs)]
    chunk = next(c for c in (64, 8, 1) if x.q.shape[1] % c == 0)  # plain_torch.kda's chunks must divide N
    exact, from_rounded = kda(*exact_inputs, chunk_size=chunk), kda(*rounded, chunk_size=chunk)
    return error_report(from_rounded.to(dtype), exact).rel_l2


def _float64_on_gpu(args):
    """FLA-free float64 reference for long sequences: the chunked plain-torch forward on the GPU."""
    from benchmarks.plain_torch import kda

    return kda(*[a.double() for a in args])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("B, N, H, D", [(2, 1024, 4, 128), (1, 1000, 2, 64)])
def test_kernels_match_reference(dtype_name, B, N, H, D):
    import torch

    from stages.kda.calls import forward

    x = _inputs(B, N, H, D, D, seed=B + N)
    expected = reference.recurrent(x.q, x.k, x.v, x.g, x.beta)
    error = error_report(forward(*_cuda_inputs(x, getattr(torch, dtype_name)))[0], expected)
    floor = _rounding_floor(x, dtype_name)
    print(f"s05 kernels {dtype_name} B={B} N={N} H={H} D={D}: {error} (rounding floor {floor:.2e})")
    assert error.rel_l2 <= 2 * floor


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_kernels_match_float64_on_a_long_sequence(dtype_name):
    import torch

    from stages.kda.calls import forward

    x = _inputs(1, 16384, 2, 128, 128, seed=11)
    args = _cuda_inputs(x, getattr(torch, dtype_name))
    exact = [torch.tensor(a, dtype=torch.float64, device="cuda") for a in (x.q, x.k, x.v, x.g, x.beta)]
    error = error_report(forward(*args)[0], _float64_on_gpu(exact))
    floor = _rounding_floor(x, dtype_name)
    print(f"s05 kernels {dtype_name} B=1 N=16384 H=2 D=128: {error} (rounding floor {floor:.2e})")
    assert error.rel_l2 <= 2 * floor


@pytest.mark.gpu
def test_kernels_carry_the_state_across_calls():
    import torch

    from stages.kda.calls import forward

    x = _inputs(2, 512, 2, 128, 64, seed=12)
    expected, expected_state = kda_delta_rule(x.q, x.k, x.v, x.g, x.beta)
    args = _cuda_inputs(x, torch.bfloat16)
    first = [a[:, :256] for a in args]
    second = [a[:, 256:].contiguous() for a in args]
    o1, state = forward(*[a.contiguous() for a in first], output_final_state=True)
    o2, final_state = forward(*second, initial_state=state, output_final_state=True)
    error, state_error = error_report(torch.cat([o1, o2], dim=1), expected), error_report(final_state, expected_state)
    floor = _rounding_floor(x, "bfloat16")
    print(f"s05 kernels bf16, two calls: output {error}, final state {state_error} (rounding floor {floor:.2e})")
    assert error.rel_l2 <= 2 * floor and state_error.rel_l2 <= 2 * floor


@pytest.mark.gpu
def test_kernels_match_fla_chunk_kda():
    import torch

    fla_ops = pytest.importorskip("fla.ops")
    from stages.kda.calls import forward

    x = _inputs(2, 1024, 4, 128, 128, seed=13)
    args = _cuda_inputs(x, torch.bfloat16)
    expected = reference.recurrent(x.q, x.k, x.v, x.g, x.beta)
    ours, fla = forward(*args)[0], fla_ops.chunk_kda(*args, scale=1.0)[0]
    ours_error, fla_error = error_report(ours, expected), error_report(fla, expected)
    print(f"bf16 vs float64: ours {ours_error}, FLA chunk_kda {fla_error}; ours vs FLA {error_report(ours, fla)}")
    assert ours_error.rel_l2 <= max(2 * fla_error.rel_l2, 1e-3)


def test_kernel_wrapper_rejects_bad_input():
    torch = pytest.importorskip("torch")
    from stages.kda.calls import forward
    from stages.kda.config import KernelConfig

    q = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    g = -torch.ones(1, 64, 2, 64)
    beta = torch.full((1, 64, 2), 0.5)
    cases = [
        ((q, q, q, g, beta), {}, ValueError, "q must be on a CUDA device"),
        ((q.float(), q, q, g, beta), {}, TypeError, "q must have dtype float16 or bfloat16, got float32"),
        ((q[0], q, q, g, beta), {}, ValueError, "q must have rank 4"),
        ((q, np.zeros(3), q, g, beta), {}, TypeError, "k must be a torch.Tensor"),
        ((q, q[:, :32], q, g, beta), {}, ValueError, r"k must have the shape of q, \(1, 64, 2, 64\)"),
        ((q, q, q[:, :32], g, beta), {}, ValueError, r"v must be \(B, N, H, d_v\) = \(1, 64, H, d_v\) with H a multiple"),
        ((q, q, q.half(), g, beta), {}, ValueError, "v must have the dtype of q"),
        ((q, q, q, g.bfloat16(), beta), {}, TypeError, "g must have dtype float32"),
        ((q, q, q, g[..., :32].contiguous(), beta), {}, ValueError, r"g must have shape \(B, N, H, d_k\) = \(1, 64, 2, 64\)"),
        ((q, q, q, g, beta[:, :32]), {}, ValueError, r"beta must have shape \(B, N, H\) = \(1, 64, 2\)"),
        ((q, q, q, g, beta), {"initial_state": torch.zeros(1, 2, 64, 32)}, ValueError,
         r"initial_state must have shape \(B, H, d_k, d_v\) = \(1, 2, 64, 64\)"),
        ((q, q, q, g, beta), {"config": KernelConfig(chunk_size=128)}, ValueError, "chunk_size must be 32 or 64"),
        ((q, q, q, g, beta), {"config": KernelConfig(block_dv=24)}, ValueError, "block_dv must be a multiple of 16"),
        ((q, q, q, g, beta), {"config": {"chunk_size": 32}}, TypeError, "config must be a stages.kda.config.KernelConfig"),
        ((q[..., :48].contiguous(), q[..., :48].contiguous(), q, g[..., :48].contiguous(), beta), {}, ValueError,
         "d_k must be a multiple of 32"),
        ((q, q, q, -g, beta), {"checks": "host"}, ValueError, r"g must be finite and <= 0 .* largest entry is 1"),
        ((q, q, q, g, beta + 1), {"checks": "host"}, ValueError, r"beta must lie in \[0, 1\]"),
        # checks="device", the default: the values are the kernel's to flag, none is read here
        ((q, q, q, -g, beta + 1), {}, ValueError, "q must be on a CUDA device"),
        ((q.transpose(1, 2).contiguous().transpose(1, 2), q, q, g, beta), {}, ValueError, "q must be contiguous"),
        # any gate: fp16 gates far past the diagonal operands' range pass the value checks (the kernel
        # takes those sub-blocks term by term), and CPU tensors stop at the device check
        ((q.half(), q.half(), q.half(), 1e4 * g, beta), {}, ValueError, "q must be on a CUDA device"),
    ]
    for args, keywords, error, message in cases:
        with pytest.raises(error, match=message):
            forward(*args, **keywords)


# ------------------------------------------------------------------------------------------ any gate

# the interpreter's shapes: three chunks of 32 (two sub-blocks each), d_k in two 16-wide channel passes
ANY_GATE_SHAPE, ANY_GATE_C, ANY_GATE_BLOCK_DV = (1, 83, 2, 32, 32), 32, 16  # N = 83: the last chunk short
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
TF32_FLOOR = 2.0**-13  # a float64 program: its block-inverse merges are TF32 GEMMs (tests/stages/test_interpreter.py)


def _any_gate_inputs(seed=3):
    """Gentle gates (a in [0.5, 1]) with a stretch of gates from 0 down to -1e4 (8-token sums in the
    tens of thousands), one channel block at -200 a token; beta in [0, 1] with entries exactly 0 and 1."""
    B, N, H, d_k, d_v = ANY_GATE_SHAPE
    x = make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=(0.5, 1.0), beta_range=(0.0, 1.0), seed=seed)
    rng = np.random.default_rng(seed)
    x.g[:, 3:40] = -rng.uniform(0.0, 1e4, x.g[:, 3:40].shape)
    x.g[:, 50:60, :, :5] = -200.0
    x.beta[:, 3::7], x.beta[:, 5::7] = 0.0, 1.0
    return x


def _fp32_cumulative_gates(g, C):
    """The log gates whose float64 cumulative sums are the kernels' fp32 ones: a chunk's gamma summed
    in fp32, row by row (cumulative_gates_macro), and differenced back."""
    held = np.empty_like(g)
    for start in range(0, g.shape[1], C):
        gamma = np.cumsum(g[:, start:start + C].astype(np.float32), axis=1, dtype=np.float32)
        held[:, start:start + C] = np.diff(gamma.astype(np.float64), axis=1, prepend=0.0)
    return held


def _interpreted_forward(x, dtype):
    """Stage 5's prepare and recurrence through the tile interpreter, on the inputs zero-padded to whole
    chunks as forward pads them; o cut back to N."""
    from stages.common.interpreter import interpret
    from stages.kda.prepare import build_prepare_program
    from stages.kda.recurrence import build_recurrence_program

    B, N, H, d_k, d_v = ANY_GATE_SHAPE
    N_padded = -(-N // ANY_GATE_C) * ANY_GATE_C
    padded = [np.pad(a, [(0, 0), (0, N_padded - N)] + [(0, 0)] * (a.ndim - 2)) for a in (x.q, x.k, x.v, x.g, x.beta)]
    prepare = interpret(build_prepare_program(B, N_padded, H, d_k, d_v, ANY_GATE_C, dtype=dtype),
                        out_idx=[5, 6, 7, 8, 9, 10])
    recurrence = interpret(build_recurrence_program(B, N_padded, H, d_k, d_v, ANY_GATE_C, ANY_GATE_BLOCK_DV,
                                                    dtype=dtype), out_idx=[7, 8])
    o, _ = recurrence(*prepare(*padded), np.zeros((B, H, d_k, d_v)))
    return o[:, :N]


@pytest.mark.parametrize("dtype", ["float64", "float16", "bfloat16"])
def test_kernels_take_any_gate(dtype):
    """Gates down to -1e4 a token: the sub-blocks past the anchored operands' range are taken term by
    term, and the output is finite. float64: within the TF32 floor of reference A fed the gates the
    kernel's fp32 cumulative sums hold (the rest is those sums' rounding, ulp(4e4) = 0.004 of an
    e-fold, which FLA's fp32 chunk-local cumsum shares); fp16 / bf16: within 4u of reference A.
    The inputs are unchanged and a second call gives the same output."""
    x = _any_gate_inputs()
    before = [a.copy() for a in (x.q, x.k, x.v, x.g, x.beta)]
    o = _interpreted_forward(x, dtype)
    assert np.all(np.isfinite(o))
    if dtype == "float64":
        expected = reference.recurrent(x.q, x.k, x.v, _fp32_cumulative_gates(x.g, ANY_GATE_C), x.beta)
        assert error_report(o, expected).rel_l2 <= TF32_FLOOR
    else:
        expected = reference.recurrent(x.q, x.k, x.v, x.g, x.beta)
        assert error_report(o, expected).rel_l2 <= 4 * UNIT_ROUNDOFF[dtype]
    for given, kept in zip((x.q, x.k, x.v, x.g, x.beta), before):
        assert np.array_equal(given, kept), "the kernels changed an input"
    assert np.array_equal(_interpreted_forward(x, dtype), o), "a second call gave another answer"


def test_fast_span_keeps_the_anchored_factors_in_range():
    """FAST_SPAN_LOG: a factor e^span times an entry <= 1 stays below the type's largest value, and
    e^-span above its smallest normal number, for each diagonal operand type (bf16: stage 6's)."""
    torch = pytest.importorskip("torch")
    from stages.s05_fast_kda.numerics import FAST_SPAN_LOG

    for dtype, span in FAST_SPAN_LOG.items():
        info = torch.finfo(getattr(torch, dtype))
        assert np.exp(span) < info.max and np.exp(-span) > info.smallest_normal


def test_a_state_stored_exactly_is_the_recurrence_and_a_stored_one_lies_on_its_types_grid():
    """forward_with_stored_state: stored in float64 it is reference A (N = 83 in chunks of 32, the last
    short; sub-blocks as wide as the chunk allows); stored in bf16 its final state is bf16 values."""
    from stages.common.interpreter import round_to_dtype
    from stages.s05_fast_kda.numerics import forward_with_stored_state

    x = make_inputs(1, 83, 2, 16, 8, gate="channel", gate_range=(0.3, 0.999), beta_range=(0.0, 1.0), seed=6)
    o, _ = forward_with_stored_state(x.q, x.k, x.v, x.g, x.beta, 32, "float64")
    assert error_report(o, reference.recurrent(x.q, x.k, x.v, x.g, x.beta)).rel_l2 <= 1e-12
    o_bf16, state = forward_with_stored_state(x.q, x.k, x.v, x.g, x.beta, 32, "bfloat16")
    assert np.array_equal(round_to_dtype(state, "bfloat16"), state) and error_report(o_bf16, o).rel_l2 > 1e-5


def test_a_bf16_state_costs_what_the_state_remembers_and_more_with_more_stores():
    """The stage 5 page's claims on a state stored in bf16 between chunks (FlashKDA's), at d = 32,
    N = 1024: its error is far above an fp32 state's at every gate and chunk size; where the state
    remembers long it grows over the first windows of tokens, it is larger with four times the stores
    (chunks of 16 against 64), and much larger than where the gates forget within a few tokens."""
    from stages.s05_fast_kda.numerics import stored_state_study

    found = stored_state_study(N=1024, d=32, window=128)
    long_memory, strong = "a in [0.999, 1]: long memory", "g in [-20, 0]: stronger"

    def mean(gates, chunk_size, dtype):
        return np.mean(found[gates, chunk_size, dtype][0])

    for gates in {gates for gates, _, _ in found}:
        assert mean(gates, 64, "float32") < 2.0**-20
        assert min(mean(gates, 64, "bfloat16"), mean(gates, 16, "bfloat16")) > 100 * mean(gates, 64, "float32")
    windows = found[long_memory, 64, "bfloat16"][0]
    assert windows[-1] > 1.3 * windows[0]
    assert mean(long_memory, 16, "bfloat16") > 1.5 * mean(long_memory, 64, "bfloat16")
    assert mean(long_memory, 16, "bfloat16") > 10 * mean(strong, 16, "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_kernels_take_any_gate_as_accurately_as_fla(dtype_name):
    """Gates down to -1e4 a token, and a stretch at -5 (8-token sums of -40: past fp16's anchored range,
    inside fp32's), no value-range refusal: finite, and within 1.1x FLA's chunk_kda error against
    float64 (reference A, token by token); prints both, and the forward's time on these gates and on
    gentle ones (the any-gate branch is taken only on the former)."""
    import torch

    fla_ops = pytest.importorskip("fla.ops")
    from stages.kda.calls import forward

    x = _inputs(1, 1000, 2, 128, 128, seed=15)
    gentle = _cuda_inputs(x, getattr(torch, dtype_name))
    rng = np.random.default_rng(15)
    x.g[:, 100:300] = -rng.uniform(0.0, 1e4, x.g[:, 100:300].shape)
    x.g[:, 500:700, :, :64] = -5.0
    args = _cuda_inputs(x, getattr(torch, dtype_name))
    expected = reference.recurrent(x.q, x.k, x.v, x.g, x.beta)
    ours, fla = forward(*args)[0], fla_ops.chunk_kda(*args, scale=1.0)[0]
    assert torch.isfinite(ours).all()
    ours_error, fla_error = error_report(ours, expected), error_report(fla, expected)

    def median_ms(inputs):
        times = []
        for _ in range(20):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            forward(*inputs, checks="off")
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]

    print(f"any gate, {dtype_name}: ours {ours_error}, FLA {fla_error}; forward {median_ms(args):.3f} ms on these "
          f"gates, {median_ms(gentle):.3f} ms on gentle ones")
    assert ours_error.rel_l2 <= 1.1 * fla_error.rel_l2


# ------------------------------------------------------------------------------------------ value flags

# forward's default call on the CPU: the device check skipped, both kernels run by the tile
# interpreter. N not a multiple of the chunk, so the wrapper pads the last chunk with zero tokens
FLAG_SHAPE, FLAG_C, FLAG_BLOCK_DV = (1, 45, 2, 32, 32), 32, 16
BAD_VALUES = [  # (tensor, index, value, flag): in the middle, in the padded last chunk, at the first token
    ("g", (0, 22, 1, 5), 0.25, "gate"), ("g", (0, 44, 0, 31), np.nan, "gate"), ("g", (0, 0, 1, 0), -np.inf, "gate"),
    ("g", (0, 33, 0, 7), np.inf, "gate"),
    ("beta", (0, 22, 0), -0.01, "beta"), ("beta", (0, 44, 1), 1.5, "beta"), ("beta", (0, 0, 0), np.nan, "beta"),
]


@pytest.fixture
def cpu_forward(monkeypatch):
    """stage 5's forward on CPU torch tensors (fp16, gates fp32), its kernels interpreted: the prepare
    run in place, so that the Flags tensor it is given is written as on the GPU. The CPU's flags are
    clear before and after."""
    torch = pytest.importorskip("torch")
    from stages.common.device_checks import flags_for
    from stages.common.interpreter import interpret
    from stages.kda import calls, checks
    from stages.kda.config import KernelConfig
    from stages.kda.prepare import build_prepare_program
    from stages.kda.recurrence import build_recurrence_program

    def interpreted_prepare(B, N, H, d_k, d_v, C, dtype, threads, value_flags, solve_outputs=False, channel_passes=2):
        run = interpret(build_prepare_program(B, N, H, d_k, d_v, C, dtype, threads, channel_passes=channel_passes,
                                              value_flags=value_flags))

        def prepare(q, k, v, g, beta, *flags):
            operand = torch.float16
            outputs = [torch.empty(B, N, H, d_k, dtype=operand), torch.empty(B, N, H, d_v, dtype=operand),
                       torch.empty(B, N, H, d_k, dtype=operand), torch.empty(B, N, H, d_k, dtype=operand),
                       torch.empty(B, N, H, C, dtype=operand), torch.empty(B, N // C, H, d_k)]
            run(q, k, v, g, beta, *flags, *outputs)
            return outputs
        return prepare

    def compiled_recurrence(*arguments):
        run = interpret(build_recurrence_program(*arguments), out_idx=[7, 8])
        return lambda *tensors: [torch.from_numpy(x) for x in run(*tensors)]

    monkeypatch.setattr(checks, "check_on_cuda", lambda tensors: None)
    monkeypatch.setattr(calls, "compiled_prepare", interpreted_prepare)
    monkeypatch.setattr(calls, "compiled_recurrence", compiled_recurrence)
    flags_for("cpu").zero_()

    def forward(x, checks="device"):
        tensors = [torch.tensor(a, dtype=torch.float16) for a in (x.q, x.k, x.v)]
        tensors += [torch.tensor(a, dtype=torch.float32) for a in (x.g, x.beta)]
        config = KernelConfig(chunk_size=FLAG_C, block_dv=FLAG_BLOCK_DV, prepare_threads=128)
        return calls.forward(*tensors, checks=checks, config=config)[0]

    yield forward
    flags_for("cpu").zero_()


def _flag_inputs(change=None):
    """Good inputs at the edges of the range: g down to -50 and -1e4, g = 0, beta exactly 0 and 1;
    then, with change = (tensor, index, value), one entry changed."""
    x = make_inputs(*FLAG_SHAPE, gate="channel", gate_range=GATES, beta_range=BETAS, seed=5)
    x.g[0, 10:20, 1] = -50.0
    x.g[0, 20, 0, :4], x.g[0, 21, 1, 3] = -1e4, 0.0
    x.beta[0, 3], x.beta[0, 44] = 0.0, 1.0
    if change is not None:
        name, index, value = change
        getattr(x, name)[index] = value
    return x


@pytest.mark.parametrize("name, index, value, flag", BAD_VALUES)
def test_the_default_forward_flags_a_bad_value_and_raises_where_the_caller_syncs(cpu_forward, name, index, value,
                                                                                 flag):
    """A bad g (above 0, NaN, -inf, +inf) or beta (below 0, above 1, NaN), anywhere: the call returns,
    raise_if_flagged raises that kind's message alone, and clears the flags."""
    from stages.common.device_checks import BAD_BETA, BAD_GATE, MESSAGES, raise_if_flagged

    cpu_forward(_flag_inputs((name, index, value)))  # no host read, no error here
    with pytest.raises(ValueError) as raised:
        raise_if_flagged("cpu")
    assert str(raised.value) == MESSAGES[BAD_GATE if flag == "gate" else BAD_BETA]
    raise_if_flagged("cpu")  # cleared


def test_good_values_and_the_padding_flag_nothing(cpu_forward):
    """The edges (g to -1e4, g = 0, beta 0 and 1) and the zero tokens the wrapper pads with set no
    flag, and the flagged kernel's output is the unflagged one's, bit for bit."""
    import torch

    from stages.common.device_checks import flags_for

    x = _flag_inputs()
    flagged = cpu_forward(x)
    assert not flags_for("cpu").any(), flags_for("cpu")
    assert torch.equal(flagged, cpu_forward(x, checks="off"))


def test_checks_off_flags_nothing_and_host_refuses_before_the_kernels(cpu_forward, monkeypatch):
    """checks="off" runs the kernel without Flags: a bad value sets nothing. checks="host" raises at
    the call, before any kernel is built."""
    from stages.common.device_checks import flags_for
    from stages.kda import calls

    bad = _flag_inputs(("g", (0, 22, 1, 5), 0.25))
    cpu_forward(bad, checks="off")
    assert not flags_for("cpu").any()
    monkeypatch.setattr(calls, "compiled_prepare", lambda *arguments, **options: pytest.fail("a kernel was built"))
    with pytest.raises(ValueError, match="g must be finite and <= 0"):
        cpu_forward(bad, checks="host")
    with pytest.raises(ValueError, match=r"beta must lie in \[0, 1\]"):
        cpu_forward(_flag_inputs(("beta", (0, 44, 1), 1.5)), checks="host")


@pytest.mark.parametrize("dtype", ["float64", "bfloat16"])
def test_the_solve_outputs_are_the_forwards_a_kk_and_t(dtype):
    """solve_outputs=True (what stage 6's backward runs): the six outputs the forward reads are the same,
    bit for bit, as without it; A_kk and T are their definitions' within the TF32 floor
    (float64, on the gates the fp32 cumulative sums hold) or four roundings of the operands (bf16),
    on gates down to -1e4 (flagged sub-blocks, taken term by term), beta at 0 (where L's column is
    zero and A_kk's is not: L written for A_kk fails) and 1, and a short last chunk. Inputs unchanged, a second call equal."""
    from stages.common.interpreter import interpret
    from stages.kda.prepare import build_prepare_program, prepare_outputs

    x = _any_gate_inputs()
    B, N, H, d_k, d_v = ANY_GATE_SHAPE
    N_padded = -(-N // ANY_GATE_C) * ANY_GATE_C
    padded = [np.pad(a, [(0, 0), (0, N_padded - N)] + [(0, 0)] * (a.ndim - 2)) for a in (x.q, x.k, x.v, x.g, x.beta)]
    before = [a.copy() for a in padded]
    shape = (B, N_padded, H, d_k, d_v, ANY_GATE_C)
    forward = interpret(build_prepare_program(*shape, dtype=dtype), out_idx=prepare_outputs())(*padded)
    solve = interpret(build_prepare_program(*shape, dtype=dtype, solve_outputs=True),
                      out_idx=prepare_outputs(solve_outputs=True))
    backward = solve(*padded)
    for a, b in zip(forward, backward[:6]):
        assert np.array_equal(a, b), "solve_outputs changed an output the forward reads"
    gates = _fp32_cumulative_gates(padded[3], ANY_GATE_C) if dtype == "float64" else padded[3]
    expected = _solve_by_definition(padded[1], gates, padded[4], ANY_GATE_C)
    floor = TF32_FLOOR if dtype == "float64" else 4 * UNIT_ROUNDOFF[dtype]
    for name, actual, wanted in zip(("A_kk", "T"), backward[6:], expected):
        assert np.all(np.isfinite(actual)), name
        assert error_report(actual, wanted).rel_l2 <= floor, name
    for given, kept in zip(padded, before):
        assert np.array_equal(given, kept), "the kernel changed an input"
    for a, b in zip(backward, solve(*padded)):
        assert np.array_equal(a, b), "a second call gave another answer"


def _solve_by_definition(k, g, beta, C):
    """Every chunk's A_kk (decayed_scores: each decay taken whole, so any gate) and T = (I + A_kk
    diag(beta))^{-1} (numpy's inverse), row r of a chunk in token r's row: (B, N, H, C) each."""
    B, N, H, _ = k.shape
    a_kk, t = np.zeros((B, N, H, C)), np.zeros((B, N, H, C))
    for start in range(0, N, C):
        rows = slice(start, start + C)
        for b in range(B):
            for h in range(H):
                K = k[b, rows, h]
                A_kk, _ = decayed_scores(K, K, np.cumsum(g[b, rows, h], axis=0))
                a_kk[b, rows, h] = A_kk
                t[b, rows, h] = np.linalg.inv(np.eye(C) + A_kk * beta[b, rows, h][None, :])
    return a_kk, t


def test_only_the_flagged_prepare_takes_flags():
    """value_flags=False builds the program stage 5's exercise builds (no Flags); True adds Flags after
    Beta, and nothing else of the signature moves."""
    from stages.kda.prepare import build_prepare_program

    def names(program):
        return [program.buffer_map[p].name for p in program.params]

    plain, flagged = (build_prepare_program(1, 64, 2, 32, 32, 32, value_flags=flags) for flags in (False, True))
    assert "Flags" not in names(plain)
    assert names(flagged) == names(plain)[:5] + ["Flags"] + names(plain)[5:]


@pytest.mark.gpu
def test_the_default_forward_flags_bad_values_on_the_gpu_and_captures_in_a_cuda_graph():
    """checks="device" on the GPU: the default call has no host sync, so it captures in a CUDA graph,
    whose replays equal the eager call and flag nothing on good values (g down to -1e4, beta 0 and 1);
    a bad g or beta, eager or replayed, raises at raise_if_flagged (not at the call), and checks="off"
    flags nothing. prefill with cu_seqlens reads them to the host and cannot be captured (its GPU tests
    are in tests/kernels/test_s07_prefill.py)."""
    import torch

    from stages.common.device_checks import BAD_BETA, BAD_GATE, MESSAGES, raise_if_flagged
    from stages.kda.calls import forward

    device = torch.device("cuda")
    x = _inputs(1, 1000, 2, 128, 128, seed=16)
    x.g[0, 100:110, 1] = -1e4
    x.beta[0, 3], x.beta[0, 9] = 0.0, 1.0
    q, k, v, g, beta = _cuda_inputs(x, torch.bfloat16)
    raise_if_flagged(device)
    eager, _ = forward(q, k, v, g, beta)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured, _ = forward(q, k, v, g, beta)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    raise_if_flagged(device)  # good values: quiet

    for name, index, value, flag in BAD_VALUES:
        index = (index[0], index[1] + 955, *index[2:])  # near the end of the 1000 tokens, most in the padded chunk
        bad = {"g": g.clone(), "beta": beta.clone()}
        bad[name][index] = value
        forward(q, k, v, bad["g"], bad["beta"], checks="off")
        raise_if_flagged(device)  # "off": nothing flagged
        forward(q, k, v, bad["g"], bad["beta"])  # no error here
        with pytest.raises(ValueError) as raised:
            raise_if_flagged(device)
        assert str(raised.value) == MESSAGES[BAD_GATE if flag == "gate" else BAD_BETA]
    g[0, 500, 0, 0] = 0.5  # the captured graph reads g in place: its next replay sees the bad gate
    graph.replay()
    with pytest.raises(ValueError, match="g must be finite and <= 0"):
        raise_if_flagged(device)
