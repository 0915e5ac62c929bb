"""The backward's activation kernels (stages.kda.activation) through the tile interpreter on the CPU,
against torch's autograd over stages.kda.inputs.activate, the one definition of the transforms, in
float64: every form FLA's flags make, grouped value heads, a length that is not a multiple of the
kernels' block of rows, strong gates; the inputs unchanged and a second call equal."""

import pytest
import torch

from stages.kda.activation import ROWS, activation_outputs, build_activate_program, build_activation_gradients_program
from stages.kda.inputs import InputForm, activate
from stages.kda.on_cpu import interpreted

N = ROWS + 5  # a second block of rows, five long
D = 32

FORMS = {
    "kimi-softplus": InputForm(gate="softplus", l2_normalize=True, beta="sigmoid", scale=D ** -0.5),
    "kimi-bounded": InputForm(gate="sigmoid", lower_bound=-5.0, l2_normalize=True, beta="sigmoid", scale=D ** -0.5),
    "log-gate-sigmoid2": InputForm(beta="sigmoid2", scale=0.5),
    "grouped-plain": InputForm(),
}
GROUPS = {"kimi-softplus": 1, "kimi-bounded": 2, "log-gate-sigmoid2": 1, "grouped-plain": 2}


def raw_inputs(form, group, H=4, seed=0):
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16).float()

    q, k = normal(2, N, H // group, D, scale=3.0), normal(2, N, H // group, D)
    if form.raw_gate:
        g = normal(2, N, H, D, scale=4.0)  # raw x: softplus and sigmoid both saturate somewhere
    else:
        g = -torch.rand(2, N, H, D, generator=generator) * 50  # log gates down to -50 a token
    beta = normal(2, N, H, scale=3.0) if form.beta != "value" else torch.rand(2, N, H, generator=generator)
    beta[0, :3] = 0.0 if form.beta == "value" else beta[0, :3]
    A_log = torch.rand(H, generator=generator) if form.raw_gate else None
    dt_bias = torch.rand(H, D, generator=generator) if form.raw_gate else None
    return q, k, g, beta, A_log, dt_bias


def expected(form, group, q, k, g, beta, A_log, dt_bias, dq_a, dk_a, dg_a, dbeta_a):
    """The activated tensors per value head and the raw gradients, by autograd in float64."""
    leaves = [None if x is None else x.double().requires_grad_() for x in (q, k, g, beta, A_log, dt_bias)]
    q_a, k_a, g_a, beta_a = activate(form, *leaves[:4], leaves[4], None if dt_bias is None else leaves[5].reshape(-1))
    q_a, k_a = (x.repeat_interleave(group, dim=2) for x in (q_a, k_a))
    wanted = [x for x in leaves if x is not None]
    grads = torch.autograd.grad((q_a, k_a, g_a, beta_a), wanted, (dq_a.double(), dk_a.double(), dg_a.double(),
                                                                   dbeta_a.double()))
    return [x.detach() for x in (q_a, k_a, g_a, beta_a)], grads


def relative(actual, wanted):
    return ((actual.double() - wanted).norm() / wanted.norm()).item()


@pytest.mark.parametrize("name", list(FORMS))
def test_the_activation_kernels_agree_with_autograd(name):
    form, group = FORMS[name], GROUPS[name]
    q, k, g, beta, A_log, dt_bias = raw_inputs(form, group)
    H = g.shape[2]
    parameters = (A_log, dt_bias) if form.raw_gate else ()
    sizes = (2, N, H, D, "float32", form, group, "float32", "float32")
    activate_outputs, gradients_outputs = activation_outputs(form)
    activate_kernel = interpreted(build_activate_program(*sizes), out_idx=activate_outputs)
    gradients_kernel = interpreted(build_activation_gradients_program(*sizes), out_idx=gradients_outputs)
    before = [x.clone() for x in (q, k, g, beta, *parameters)]

    generator = torch.Generator().manual_seed(1)
    d_activated = [torch.randn(2, N, H, D, generator=generator) for _ in range(3)] + [
        torch.randn(2, N, H, generator=generator)]
    wanted_activated, wanted_grads = expected(form, group, q, k, g, beta, A_log, dt_bias, *d_activated)

    activated = activate_kernel(q, k, g, beta, *parameters)
    for label, actual, wanted in zip(("q_a", "k_a", "g_a", "beta_a"), activated, wanted_activated):
        assert relative(actual, wanted) < 1e-5, label  # fp32 arithmetic against float64

    dq, dk, dg, dbeta, dA, *dt_bias_blocks = gradients_kernel(q, k, g, beta, *parameters, *d_activated)
    if group > 1:
        dq, dk = (x.view(2, N, H // group, group, D).sum(3) for x in (dq, dk))
    found = [dq, dk, dg, dbeta]
    if form.raw_gate:  # dA_log and ddt_bias as calls.backward sums them
        found += [dA.sum((0, 1)), dt_bias_blocks[0].sum((0, 1))]
    else:
        assert not dt_bias_blocks
    assert len(found) == len(wanted_grads)
    for label, actual, wanted in zip(("dq", "dk", "dg", "dbeta", "dA_log", "ddt_bias"), found, wanted_grads):
        assert wanted.abs().max() > 0, label
        assert relative(actual, wanted.view(actual.shape)) < 1e-4, label
    assert all(torch.equal(x, y) for x, y in zip((q, k, g, beta, *parameters), before))  # inputs untouched
    again = gradients_kernel(q, k, g, beta, *parameters, *d_activated)
    assert all(torch.equal(x, y) for x, y in zip(again[2:], (dg, dbeta, dA, *dt_bias_blocks)))  # the same bits


@pytest.mark.parametrize("name", ["kimi-softplus", "kimi-bounded"])
def test_gradients_come_rounded_once_to_their_inputs_dtypes(name):
    """With bf16 tensors as a model passes them, dq, dk, dx and dbeta leave the kernel in bf16 (x's gradient
    in x's dtype, beta's in its logits'), each the fp32 kernel's value rounded once; dt_bias's block sums
    are taken before that rounding (the fp32 kernel's, bit for bit); with grouped value heads dq and dk
    stay fp32 for the caller's sum."""
    form, group = FORMS[name], GROUPS[name]
    q, k, g, beta, A_log, dt_bias = raw_inputs(form, group)
    H = g.shape[2]
    generator = torch.Generator().manual_seed(2)
    d_activated = [torch.randn(2, N, H, D, generator=generator) for _ in range(3)] + [
        torch.randn(2, N, H, generator=generator)]
    found = {}
    for dtype in ("float32", "bfloat16"):
        sizes = (2, N, H, D, dtype, form, group, dtype, dtype)
        kernel = interpreted(build_activation_gradients_program(*sizes), out_idx=activation_outputs(form)[1])
        torch_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
        found[dtype] = kernel(*(x.to(torch_dtype) for x in (q, k, g, beta)), A_log, dt_bias, *d_activated)
    wide, narrow = found["float32"], found["bfloat16"]
    qk_dtype = torch.bfloat16 if group == 1 else torch.float32
    for label, w, n, dtype in zip(("dq", "dk", "dx", "dbeta"), wide, narrow,
                                  (qk_dtype, qk_dtype, torch.bfloat16, torch.bfloat16)):
        assert n.dtype == dtype, label
        assert torch.equal(n, w.to(dtype)), label
    assert torch.equal(narrow[4], wide[4]) and torch.equal(narrow[5], wide[5])  # dA and dt_bias's sums, fp32
