"""checks="off" in every stage's forward skips the value checks, nothing else.

On a CPU the device check comes after the value checks, so a forward given bad gate values on CPU
tensors fails on the values with checks="host" and on the device with checks="off". Stages 2-4's
kernels carry no value flags, so "host" is their default and "device" is refused; stage 5's default,
checks="device", reads no value on the host (the kernel flags them: tests/stages/test_s05_fast_kda.py).
"""

import pytest

STAGES = ["s02_scalar_decay", "s03_gated_deltanet", "s04_kda"]


def _inputs(stage, torch):
    q = torch.zeros(1, 64, 2, 64, dtype=torch.bfloat16)
    beta = torch.full((1, 64, 2), 0.5)
    gate_shape = {"s02_scalar_decay": (2,), "s03_gated_deltanet": (1, 64, 2)}.get(stage, (1, 64, 2, 64))
    growing = torch.full(gate_shape, 0.2)  # g > 0: a growth, refused by the value check
    return (q, q, q, growing) if stage == "s02_scalar_decay" else (q, q, q, growing, beta + 1)


@pytest.mark.parametrize("stage", STAGES)
def test_checks_off_skips_only_the_value_checks(stage):
    torch = pytest.importorskip("torch")
    import importlib

    forward = importlib.import_module(f"stages.{stage}.kernel").forward
    args = _inputs(stage, torch)
    for host in ({}, {"checks": "host"}):  # the default checks on the host
        with pytest.raises(ValueError, match="g must be finite and <= 0"):
            forward(*args, **host)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        forward(*args, checks="off")
    with pytest.raises(TypeError, match="g must have dtype float32"):  # the other checks stay
        forward(*args[:3], args[3].double(), *args[4:], checks="off")


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("checks", ["device", True, False])
def test_stages_without_value_flags_refuse_other_modes(stage, checks):
    """"device" would promise flags these kernels do not set; a boolean is the old vocabulary."""
    torch = pytest.importorskip("torch")
    import importlib

    forward = importlib.import_module(f"stages.{stage}.kernel").forward
    with pytest.raises(ValueError, match=f"checks must be one of 'host', 'off', got {checks!r}"):
        forward(*_inputs(stage, torch), checks=checks)


def test_s05_checks_on_the_host_or_leaves_the_values_to_the_device():
    """checks="host" refuses the bad values before the device check; "device" (the default) and
    "off" read none on the host, and reach the device check; the other checks stay in every mode."""
    torch = pytest.importorskip("torch")
    from stages.kda.calls import forward

    args = _inputs("s05_fast_kda", torch)
    with pytest.raises(ValueError, match="g must be finite and <= 0"):
        forward(*args, checks="host")
    for checks in ("device", "off"):
        with pytest.raises(ValueError, match="q must be on a CUDA device"):
            forward(*args, checks=checks)
        with pytest.raises(TypeError, match="g must have dtype float32"):
            forward(*args[:3], args[3].double(), *args[4:], checks=checks)
    with pytest.raises(ValueError, match="q must be on a CUDA device"):
        forward(*args)
    with pytest.raises(ValueError, match="checks must be one of 'device', 'host', 'off', got True"):
        forward(*args, checks=True)


def test_s05_zero_state_is_made_once_per_shape_and_device():
    torch = pytest.importorskip("torch")
    from stages.kda.calls import zero_state

    first = zero_state(1, 2, 16, 32, torch.device("cpu"))
    assert first.shape == (1, 2, 16, 32) and first.dtype == torch.float32 and not first.any()
    assert zero_state(1, 2, 16, 32, torch.device("cpu")) is first
    assert zero_state(2, 2, 16, 32, torch.device("cpu")) is not first
    with torch.inference_mode():
        made_under_inference = zero_state(3, 2, 16, 32, torch.device("cpu"))
    assert not made_under_inference.is_inference()


@pytest.mark.parametrize(
    "name, index, value",
    [("g", (0, 1, 0), float("nan")), ("g", (0, 2, 1), 0.5), ("g", (0, 0, 0), float("-inf")),
     ("g", (0, 3, 1), float("inf")), ("beta", (0, 1, 0), float("nan")), ("beta", (0, 2, 1), -0.1),
     ("beta", (0, 0, 1), 1.1)],
)
def test_value_check_refuses_each_bad_value(name, index, value):
    """One pass per tensor (min and max): a single bad entry anywhere, NaN included, is refused."""
    import torch

    from stages.common.torch_checks import check_gate_values

    tensors = {"g": torch.full((1, 4, 2), -0.1), "beta": torch.full((1, 4, 2), 0.5)}
    check_gate_values(tensors["g"], tensors["beta"])  # the good ones pass
    tensors[name][index] = value
    with pytest.raises(ValueError, match=name):
        check_gate_values(tensors["g"], tensors["beta"])
