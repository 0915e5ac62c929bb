"""Tests of exercise s05.fused_loads: the gate, the norms and beta's sigmoid computed as a chunk is loaded.

On any machine the program runs through the tile interpreter, and its four outputs are compared with
stages.kda.inputs.activate on the same raw tensors, in float64: both of FLA's gate forms, each with
A_log and a dt_bias that differs from channel to channel, a length that is not a multiple of the chunk
(the rows past it must be zero tokens), gates down to thousands a token and beta logits at which the
sigmoid rounds to 0 and 1, and bf16 tensors as a model passes them. The program must leave its inputs
as they were and give the same outputs twice. With nvcc it compiles for sm_90a without spills; on a
GPU it runs.
"""

import numpy as np
import pytest
import torch

from stages.common.compare import assert_close
from stages.kda.inputs import InputForm, activate
from tests.exercises.kernel_checks import UNIT_ROUNDOFF, build, compile_for_sm90a, run_on_cpu, run_on_gpu

STAGE = "s05_fast_kda"
OUTPUTS = ("q", "k", "g", "beta")
OUT_IDX = [6, 7, 8, 9]  # Q_out, K_out, G_out, Beta_out after the six inputs
C, D_K = 32, 32
# Every value passes through fp32 (the gate's and beta's buffers, the norms' sums): a few roundings of
# 2^-24 each, far below what a wrong formula or a misread parameter gives (order 1)
FP32_BOUND = 16 * UNIT_ROUNDOFF["float64"]
FORMS = {
    # Kimi Linear's default gate, q scaled as FLA's default 1 / sqrt(K) would
    "softplus": InputForm(gate="softplus", l2_normalize=True, beta="sigmoid", scale=D_K ** -0.5),
    # the bounded gate (safe_gate, lower_bound), beta up to 2 (allow_neg_eigval)
    "sigmoid": InputForm(gate="sigmoid", lower_bound=-5.0, l2_normalize=True, beta="sigmoid2"),
}


@pytest.fixture
def fused_loads(target_module):
    return target_module(STAGE, "fused_loads.py").fused_loads


def raw_inputs(B, tokens, H, seed):
    """q, k, the raw gate x (B, tokens, H, D_K), beta's logits (B, tokens, H), A_log (H,) and dt_bias
    (H * D_K,) in float64: unnormalized q and k, a bias that differs from channel to channel."""
    rng = np.random.default_rng(seed)
    q, k, x = (rng.standard_normal((B, tokens, H, D_K)) * 3 for _ in range(3))
    beta = rng.standard_normal((B, tokens, H)) * 2
    A_log = rng.uniform(-2, 1, H)
    dt_bias = rng.standard_normal(H * D_K)
    return [q, k, x, beta, A_log, dt_bias]


def activated(form, q, k, x, beta, A_log, dt_bias):
    """q, k, g and beta as stages.kda.inputs.activate makes them, in float64 NumPy."""
    tensors = (torch.tensor(np.asarray(a, dtype=np.float64)) for a in (q, k, x, beta, A_log, dt_bias))
    return [t.numpy() for t in activate(form, *tensors)]


def run(fused_loads, form, inputs, N, dtype="float64"):
    """The program through the tile interpreter, on inputs of len(x) tokens padded to N rows out."""
    B, tokens, H, _ = inputs[0].shape
    program = build(fused_loads, B, N, H, D_K, C, form=form, dtype=dtype, tokens=tokens)
    return run_on_cpu(program, inputs, out_idx=OUT_IDX)


def assert_activated(outputs, expected, tokens, bound, case, names=OUTPUTS):
    """The outputs' first `tokens` rows within `bound` of activate's; every row after them a zero token."""
    __tracebackhide__ = True
    for name, output, value in zip(names, outputs, expected):
        assert_close(output[:, :tokens], value, rel_l2=bound, name=f"{name} of the interpreted program ({case})")
        past = np.asarray(output[:, tokens:])
        if past.any():
            raise AssertionError(
                f"{name} is not zero in the {past.shape[1]} rows past the last token ({case}): there each output "
                f"must be a zero token (q = k = 0, g = 0, beta = 0), which leaves the state as it was; found "
                f"values up to {np.abs(past).max():.3g}")


@pytest.mark.parametrize("gate", list(FORMS))
def test_float64_program_equals_activate(fused_loads, gate):
    """83 tokens in three chunks of 32 (the last one short), two heads, each with its own A_log and a
    dt_bias that differs by channel: the outputs are activate's within fp32's rounding, the rows past the
    last token zero tokens, the inputs unchanged, and a second run gives the same outputs."""
    form, tokens, N = FORMS[gate], 83, 96
    inputs = raw_inputs(1, tokens, 2, seed=1 + len(gate))
    before = [a.copy() for a in inputs]
    outputs = run(fused_loads, form, inputs, N)
    assert_activated(outputs, activated(form, *inputs), tokens, FP32_BOUND, f"the {gate} gate")
    assert all(np.array_equal(a, b) for a, b in zip(inputs, before)), "the program changed one of its inputs"
    again = run(fused_loads, form, inputs, N)
    assert all(np.array_equal(a, b) for a, b in zip(again, outputs)), "a second run gave other outputs"


def test_strong_gates_and_saturated_logits(fused_loads):
    """The default gate at exp(A_log) = 50 on raw gates up to 100 (past SOFTPLUS_THRESHOLD, and past
    where e^x overflows fp32): log gates of -5000 a token, every one finite; beta logits of +-100, where
    the sigmoid is 1 and 0 in fp32. Two chunks, whole."""
    form, tokens = FORMS["softplus"], 64
    q, k, x, beta, A_log, dt_bias = raw_inputs(1, tokens, 2, seed=4)
    x[0, ::3, :, ::2] = 100.0
    x[0, 1::3, :, 1::2] = -100.0
    beta[0, ::4] = 100.0
    beta[0, 1::4] = -100.0
    A_log[:] = np.log(50.0)
    inputs = [q, k, x, beta, A_log, dt_bias]
    outputs = run(fused_loads, form, inputs, tokens)
    expected = activated(form, *inputs)
    assert expected[2].min() < -4000  # the gates the case is about
    assert np.isfinite(outputs[2]).all(), "g has inf or NaN where the raw gate is large: softplus(y) is y above the threshold"
    assert_activated(outputs, expected, tokens, FP32_BOUND, "strong gates, saturated beta logits")


def test_bfloat16_tensors_as_a_model_passes_them(fused_loads):
    """q, k, the raw gate and beta's logits in bf16, the bounded gate: q and k within one bf16 rounding of
    activate's on the same bf16 values, g and beta (fp32 outputs) within fp32's."""
    form, tokens, N = FORMS["sigmoid"], 50, 64
    inputs = raw_inputs(1, tokens, 2, seed=5)
    inputs[:4] = [torch.tensor(a).to(torch.bfloat16).double().numpy() for a in inputs[:4]]
    outputs = run(fused_loads, form, inputs, N, dtype="bfloat16")
    expected = activated(form, *inputs)
    assert_activated(outputs[:2], expected[:2], tokens, 2 * UNIT_ROUNDOFF["bfloat16"], "bf16 inputs", OUTPUTS[:2])
    assert_activated(outputs[2:], expected[2:], tokens, FP32_BOUND, "bf16 inputs", OUTPUTS[2:])


@pytest.mark.compile
def test_compiles_for_sm90a_without_spills(fused_loads):
    compile_for_sm90a(build(fused_loads, 1, 4096, 8, 128))


@pytest.mark.gpu
def test_runs_on_gpu(fused_loads):
    form, tokens, N, H = FORMS["softplus"], 1000, 1024, 4
    B, d_k = 2, 128
    rng = np.random.default_rng(6)
    q, k, x = (rng.standard_normal((B, tokens, H, d_k)) for _ in range(3))
    beta, A_log, dt_bias = rng.standard_normal((B, tokens, H)), rng.uniform(-2, 1, H), rng.standard_normal(H * d_k)
    inputs = [torch.tensor(a).to(torch.bfloat16).double().numpy() for a in (q, k, x, beta)] + [A_log, dt_bias]
    program = build(fused_loads, B, N, H, d_k, 64, form=form, tokens=tokens)
    outputs = run_on_gpu(program, inputs, OUT_IDX, ["bfloat16"] * 4 + ["float32"] * 2)
    expected = activated(form, *inputs)
    assert_activated(outputs[:2], expected[:2], tokens, 2 * UNIT_ROUNDOFF["bfloat16"], "on the GPU", OUTPUTS[:2])
    # the GPU's exp2, log2 and rsqrt are approximations of a few ulps
    assert_activated(outputs[2:], expected[2:], tokens, 64 * UNIT_ROUNDOFF["float64"], "on the GPU", OUTPUTS[2:])
