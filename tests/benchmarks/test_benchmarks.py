"""The benchmark's plain-torch forwards equal each stage's reference A (they are the float64
reference of the precision study), and accept the half-precision inputs the benchmark times."""

import pytest
import torch

from benchmarks import plain_torch
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.common.oracles import causal_linear_attention, delta_rule, kda_delta_rule, scalar_decay_attention

B, N, H, D, C = 2, 48, 2, 8, 16


def _torch(*arrays):
    return [torch.tensor(a) for a in arrays]


def test_linear_attention():
    x = make_inputs(B, N, H, D, D, seed=1)
    actual = plain_torch.linear_attention(*_torch(x.q, x.k, x.v), chunk_size=C)
    assert error_report(actual, causal_linear_attention(x.q, x.k, x.v)).rel_l2 <= 1e-12


def test_scalar_decay():
    x = make_inputs(B, N, H, D, D, gate="head", gate_range=(0.7, 0.99), seed=2)
    actual = plain_torch.scalar_decay(*_torch(x.q, x.k, x.v, x.g), chunk_size=C)
    assert error_report(actual, scalar_decay_attention(x.q, x.k, x.v, x.g)).rel_l2 <= 1e-12


def test_gated_deltanet():
    x = make_inputs(B, N, H, D, D, gate="token", beta_range=(0.1, 0.9), seed=3)
    actual = plain_torch.gated_deltanet(*_torch(x.q, x.k, x.v, x.g, x.beta), chunk_size=C)
    assert error_report(actual, delta_rule(x.q, x.k, x.v, x.beta, x.g)).rel_l2 <= 1e-12


def test_kda():
    x = make_inputs(B, N, H, D, D, gate="channel", beta_range=(0.1, 0.9), seed=4)
    actual = plain_torch.kda(*_torch(x.q, x.k, x.v, x.g, x.beta), chunk_size=C)
    assert error_report(actual, kda_delta_rule(x.q, x.k, x.v, x.g, x.beta)).rel_l2 <= 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kda_takes_half_precision_inputs(dtype):
    x = make_inputs(1, 64, 2, 16, 16, gate="channel", beta_range=(0.1, 0.9), seed=5)
    q, k, v, g, beta = _torch(x.q, x.k, x.v, x.g, x.beta)
    actual = plain_torch.kda(q.to(dtype), k.to(dtype), v.to(dtype), g.float(), beta.float(), chunk_size=C)
    assert actual.dtype == dtype
    assert error_report(actual, kda_delta_rule(x.q, x.k, x.v, x.g, x.beta)).rel_l2 <= 2e-2


def test_chunks_must_divide_the_sequence():
    x = make_inputs(1, 20, 1, 4, 4, seed=6)
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        plain_torch.linear_attention(*_torch(x.q, x.k, x.v), chunk_size=8)


@pytest.mark.parametrize("program", ["bench", "backward", "fair", "kimi_call", "kimi_train"])
def test_a_benchmark_without_cuda_says_so_and_writes_nothing(program, tmp_path, capsys, monkeypatch):
    """Each timing benchmark stops before its first file, naming itself, where torch sees no GPU."""
    import importlib

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    main = importlib.import_module(f"benchmarks.{program}").main
    assert main(["--out", str(tmp_path / "run")]) == 2
    assert f"benchmarks.{program} needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_the_kimi_prepare_profile_takes_one_case_and_needs_cuda(capsys, monkeypatch):
    """benchmarks.profile_kimi_prepare, which Nsight Compute runs: a case of benchmarks.kimi_call's or
    its usage, and where torch sees no GPU it says so before making any tensor."""
    from benchmarks import profile_kimi_prepare

    for argv in ([], ["T8192_H96", "8x1024_H96"], ["no_such_case"]):
        assert profile_kimi_prepare.main(argv) == 2
        assert "usage: python -m benchmarks.profile_kimi_prepare CASE" in capsys.readouterr().err
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert profile_kimi_prepare.main(["8x1024_H96"]) == 2
    assert "benchmarks.profile_kimi_prepare needs a CUDA device" in capsys.readouterr().err


def test_a_run_records_its_machine_its_packages_and_its_command(monkeypatch):
    """bench.run_meta, which every timing benchmark's meta JSON starts from: a package that is missing
    says so instead of failing the run; the command is the one typed."""
    from benchmarks import bench

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a test GPU")
    import numpy

    meta = bench.run_meta("benchmarks.fair", ["--out", "x"], ("numpy", "no_such_package_here"))
    assert meta["device"] == "a test GPU" and meta["torch"] == torch.__version__ and meta["numpy"] == numpy.__version__
    assert meta["no_such_package_here"] == "not installed"
    assert meta["started"].startswith(meta["date"] + "T")  # the moment, which orders two runs of one day
    assert meta["command"] == "python -m benchmarks.fair --out x"
