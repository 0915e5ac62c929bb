"""stages.kda.fla_backend: the verifiers alone (everywhere), and where FLA 0.6.0 imports, FLA's own
chunk_kda and fused_recurrent_kda dispatching to the course through FLA's registry, with FLA's log line
on what is taken and what is refused (on the CPU FLA's Triton kernels do not run, so every call the
course takes is one FLA's own path could not have served here)."""

import logging
import re

import pytest
import torch

from stages.kda import fla_backend
from stages.kda.autograd import chunk_kda
from stages.kda.fused_recurrent import fused_recurrent_kda
from tests.kernels.fla_recurrence import Options
from tests.kernels.test_fla_chunk_kda import BOUNDED, Case, gradients, make_leaves


def _tensors(case, seed=1, N=None, requires_grad=False):
    leaves = make_leaves(case, seed, N=N)
    return {name: None if x is None else x.detach().requires_grad_(requires_grad) for name, x in leaves.items()}


def _fla_arguments(case, leaves):
    return dict(q=leaves["q"], k=leaves["k"], v=leaves["v"], g=leaves["g"], beta=leaves["beta"],
                initial_state=leaves["initial_state"], output_final_state=True, A_log=leaves["A_log"],
                dt_bias=leaves["dt_bias"], state_v_first=case.state_v_first, **case.options.fla_kwargs())


MODEL_CALL = Case(1, 20, 1, 2, 8, 8, Options(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                             use_beta_sigmoid_in_kernel=True, lower_bound=-5.0),
                  safe_gate=True, state_v_first=True)  # KimiDeltaAttention's flags


def test_the_verifier_takes_what_chunk_kda_runs_and_says_why_not():
    """Kimi Linear's call (every in-kernel flag, GVA, V-first states, packed) is taken; a refusal's reason
    is the course's error message, word for word (FLA logs it)."""
    leaves = _tensors(MODEL_CALL, N=2)
    arguments = dict(_fla_arguments(MODEL_CALL, leaves), cu_seqlens=torch.tensor([0, 7, 20]), safe_gate=True)
    assert fla_backend.chunk_kda_verifier(**arguments) == (True, None)
    positional = [arguments.pop(name) for name in ("q", "k", "v", "g", "beta")]  # as FLA's callers may pass them
    assert fla_backend.chunk_kda_verifier(*positional, **arguments) == (True, None)
    refusals = {
        "cp_context": (dict(cp_context=object()), "cp_context: the course's split over ranks runs through"),
        "chunk_size": (dict(chunk_size=16), "`chunk_size` must be either 32 or 64 for KDA, got 16."),
        "A_log": (dict(A_log=None, lower_bound=None, safe_gate=False), "`A_log` must be provided"),
        "device": (dict(q=leaves["q"].to("meta")), "all inputs must be on one device"),
    }
    base = _fla_arguments(MODEL_CALL, leaves)
    for name, (change, message) in refusals.items():
        accepted, reason = fla_backend.chunk_kda_verifier(**{**base, **change})
        assert not accepted and reason.startswith(message), f"{name}: {reason}"


def test_the_decode_verifier_takes_a_pool_and_refuses_beta_per_column():
    case = Case(1, 4, 1, 1, 8, 8, Options())
    leaves = _tensors(case, N=4)
    arguments = dict(q=leaves["q"], k=leaves["k"], v=leaves["v"], g=leaves["g"], beta=leaves["beta"],
                     initial_state=leaves["initial_state"].float(), inplace_final_state=True,
                     cu_seqlens=torch.arange(5), ssm_state_indices=torch.tensor([3, 0, 2, 1]))
    assert fla_backend.fused_recurrent_kda_fwd_verifier(**arguments) == (True, None)
    accepted, reason = fla_backend.fused_recurrent_kda_fwd_verifier(**dict(arguments, beta=torch.rand(1, 4, 1, 8)))
    assert not accepted and "beta of shape (B, T, HV, V)" in reason


def test_on_cuda_float32_is_taken_by_fused_recurrent_and_refused_by_chunk_kda():
    """The CUDA route (stages.kda.on_cpu's stand-in; the verifiers run no kernel): fp32 q, k, v go to the
    decode kernel, which computes in fp32 as FLA's fused_recurrent does; chunk_kda's GEMMs take fp16 and
    bf16 only, so its verifier refuses them and FLA's own kernel runs."""
    from stages.kda.on_cpu import calls_on_cpu, interpreted

    leaves = {name: None if x is None else x.float() for name, x in _tensors(MODEL_CALL).items()}
    with calls_on_cpu(interpreted):
        assert fla_backend.fused_recurrent_kda_fwd_verifier(**_fla_arguments(MODEL_CALL, leaves)) == (True, None)
        accepted, reason = fla_backend.chunk_kda_verifier(**_fla_arguments(MODEL_CALL, leaves), safe_gate=True)
    assert not accepted and reason == ("q must have dtype float16 or bfloat16 (the kernels' inputs on CUDA), got "
                                       "float32")


def test_the_kernels_size_rules_are_checked_on_the_padded_sizes():
    """K and V are padded to 32 for the kernels: any head dim FLA's tests use passes the size rules."""
    for K in (60, 64, 100, 128, 256):
        fla_backend.check_kernel_sizes(K, K, 64)
    with pytest.raises(ValueError, match="chunk_size must be 32 or 64"):
        fla_backend.check_kernel_sizes(64, 64, 16)


@pytest.fixture
def fla_registry():
    """FLA's registries as the backend module left them, their log memory cleared (FLA logs a
    (function, backend) pair once a process)."""
    pytest.importorskip("fla.backends")
    from fla.backends import _function_registries, _get_operation_registry
    from fla.ops.kda.chunk import chunk_kda as fla_chunk_kda
    from inspect import unwrap

    assert fla_backend.REGISTERED
    registries = (_function_registries[unwrap(fla_chunk_kda)], _get_operation_registry("kda"))
    for registry in registries:
        assert fla_backend.BACKEND_TYPE in registry._backends
        registry._logged.clear()
    return registries


def test_fla_s_chunk_kda_runs_the_course_s_and_logs_it(fla_registry, caplog):
    """FLA's chunk_kda, called as KimiDeltaAttention calls it, gives the course's o, final states and
    gradients bit for bit, and FLA's log says which backend ran it."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    leaves = _tensors(MODEL_CALL, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="fla.backends"):
        theirs = fla_chunk_kda(**_fla_arguments(MODEL_CALL, leaves), safe_gate=True)
    ours = chunk_kda(**_fla_arguments(MODEL_CALL, leaves), safe_gate=True)
    assert torch.equal(theirs[0], ours[0]) and torch.equal(theirs[1], ours[1])
    their_grads, our_grads = gradients(*theirs, leaves, 2), gradients(*ours, leaves, 2)
    assert all(torch.equal(their_grads[name], our_grads[name]) for name in our_grads)
    assert "[FLA Backend] fla.ops.kda.chunk.chunk_kda -> kdacourse" in caplog.text


def test_a_refused_call_falls_back_to_fla_with_fla_s_log_line(fla_registry, caplog):
    """chunk_size 16: the verifier refuses, FLA logs why, and FLA's own function raises its own error."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    leaves = _tensors(Case(1, 8, 1, 1, 8, 8))
    with caplog.at_level(logging.INFO, logger="fla.backends"), pytest.raises(ValueError, match="`chunk_size`"):
        fla_chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], chunk_size=16)
    assert re.search(r"\[FLA Backend\] fla\.ops\.kda\.chunk\.chunk_kda -> kdacourse rejected: `chunk_size` must be "
                     r"either 32 or 64", caplog.text)


def test_fla_s_fused_recurrent_kda_runs_the_course_s(fla_registry, caplog):
    """FLA's public fused_recurrent_kda calls fused_recurrent_kda_fwd, which FLA dispatches: the course's
    answer, and FLA's log line for the 'kda' operations."""
    from fla.ops.kda import fused_recurrent_kda as fla_fused_recurrent_kda

    case = Case(1, 6, 1, 2, 8, 8, BOUNDED, state_v_first=True)
    leaves = _tensors(case)
    arguments = {name: value for name, value in _fla_arguments(case, leaves).items()}
    with caplog.at_level(logging.INFO, logger="fla.backends"):
        theirs = fla_fused_recurrent_kda(**arguments)
    ours = fused_recurrent_kda(**arguments)
    assert torch.equal(theirs[0], ours[0]) and torch.equal(theirs[1], ours[1])
    assert "[FLA Backend] kda.fused_recurrent_kda_fwd -> kdacourse" in caplog.text


def test_switched_off_by_its_environment_variable(fla_registry, monkeypatch):
    """FLA_KDACOURSE=0: FLA does not ask the course (its own path then runs, which has no CPU kernels)."""
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    asked = []
    monkeypatch.setattr(fla_backend, "chunk_kda_verifier", lambda *a, **k: asked.append(1) or (True, None))
    monkeypatch.setenv(fla_backend.ENV_VAR, "0")
    leaves = _tensors(Case(1, 8, 1, 1, 8, 8))
    with pytest.raises(Exception):  # noqa: B017 - FLA's Triton path, whatever it raises without a GPU
        fla_chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"])
    assert not asked
    monkeypatch.setenv(fla_backend.ENV_VAR, "1")
    fla_chunk_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"])
    assert asked
