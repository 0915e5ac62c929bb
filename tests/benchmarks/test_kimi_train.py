"""benchmarks.kimi_train on the CPU: its float64 reference (what every gradient's error is measured
against) agrees with the course's float64 reference path, and its options are checked."""

import pytest

torch = pytest.importorskip("torch")

from benchmarks import kimi_train  # noqa: E402


@pytest.mark.parametrize("gate", list(kimi_train.GATES))
def test_the_float64_step_agrees_with_the_course_s_reference(gate):
    # T = 37: not a multiple of the chunk; the course's CPU path is its float64 chunked reference, an
    # independent derivation of the same o and gradients (stages.kda.autograd, reference_dense)
    inputs = kimi_train.make_inputs(37, 2, seed=3, device="cpu")
    before = {name: tensor.detach().clone() for name, tensor in inputs.items()}
    expected_o, expected_grads = kimi_train.float64_step(inputs, gate)
    o, grads = kimi_train.peer_steps(inputs, gate)[0]["course"]()
    assert expected_o.dtype == torch.float64 and len(expected_grads) == len(kimi_train.GRADIENTS)
    assert kimi_train.relative_l2(o, expected_o) < 1e-2  # o is returned in bf16, as FLA returns it
    for name, grad, expected in zip(kimi_train.GRADIENTS, grads, expected_grads):
        assert expected.abs().max() > 0, name
        assert kimi_train.relative_l2(grad, expected) < 1e-2, name
    for name, tensor in inputs.items():  # the inputs unchanged by either
        assert torch.equal(tensor.detach(), before[name]), name


def test_the_float64_step_moves_with_the_gate():
    # the two gate forms differ: a reference that ignored the form would pass the test above for one
    inputs = kimi_train.make_inputs(20, 1, seed=4, device="cpu")
    bounded, _ = kimi_train.float64_step(inputs, "bounded")
    softplus, _ = kimi_train.float64_step(inputs, "softplus")
    assert kimi_train.relative_l2(bounded, softplus) > 1e-2


@pytest.mark.parametrize("argv, message", [(["--cases", "T99"], "unknown T99"),
                                           (["--gates", "bounded,linear"], "unknown linear"),
                                           (["--profile", "T7"], "unknown T7")])
def test_unknown_cases_and_gates_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        kimi_train.parse_args(["--out", "x", *argv])
    assert message in capsys.readouterr().err
