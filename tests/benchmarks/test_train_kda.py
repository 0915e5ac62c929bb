"""The training demo (benchmarks/train_kda.py) on the CPU: the recall task's batches, the loss falling
below a guess's on a short run, and the command's files."""

import csv
import math

import pytest
import torch

from benchmarks import train_kda
from stages.kda.autograd import chunk_kda

SMALL = ["--batch", "8", "--d-model", "32", "--heads", "2", "--head-dim", "16", "--layers", "1"]


def test_recall_batch_asks_for_the_listed_values():
    tokens, targets = train_kda.recall_batch(torch.Generator().manual_seed(0), batch=5, pairs=6, queries=9, vocab=8)
    assert tokens.shape == targets.shape == (5, 21)
    for row, target in zip(tokens.tolist(), targets.tolist()):
        keys, values = row[0:12:2], row[1:12:2]
        assert len(set(keys)) == 6 and all(0 <= key < 8 for key in keys)
        assert all(8 <= value < 16 for value in values)
        assert target[:12] == [train_kda.IGNORED] * 12
        paired = dict(zip(keys, values))
        assert target[12:] == [paired[key] for key in row[12:]]
    with pytest.raises(ValueError, match="pairs must be at most vocab = 4"):
        train_kda.recall_batch(torch.Generator(), batch=1, pairs=5, queries=1, vocab=4)


def test_the_loss_falls_below_a_guess_on_a_short_cpu_run(tmp_path):
    """Two pairs from four keys and values: a guess among the values scores log 4 = 1.39. Below it,
    the model recalls, which needs chunk_kda's gradients: with a wrong one the loss stays at the guess."""
    result = train_kda.main(["--out", str(tmp_path), "--steps", "60", "--pairs", "2", "--queries", "8", "--vocab",
                             "4", "--lr", "1e-2", *SMALL])
    assert result["last_loss_ours"] < 0.8 * math.log(4) < result["first_loss_ours"]


def test_the_command_writes_its_csv_and_plot(tmp_path):
    train_kda.main(["--out", str(tmp_path / "run"), "--steps", "3", *SMALL])
    with (tmp_path / "run" / "train_kda.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    assert list(rows[0]) == ["step", "loss_ours", "accuracy_ours"]
    assert all(math.isfinite(float(r["loss_ours"])) for r in rows)
    plot = tmp_path / "run" / "train_kda_loss.svg"
    assert plot.read_text().lstrip().startswith("<?xml")
    plot.unlink()
    replotted = train_kda.main(["--out", str(tmp_path / "run"), "--replot"])
    assert plot.is_file() and replotted["last_loss_ours"] == pytest.approx(sum(float(r["loss_ours"]) for r in rows) / 3)


def test_compare_fla_needs_cuda(capsys):
    with pytest.raises(SystemExit):
        train_kda.parse_args(["--out", "x", "--compare-fla"])
    assert "--compare-fla needs --device cuda" in capsys.readouterr().err


def test_the_default_gate_floor_bounds_the_gates(capsys):
    """The demo's gates lie in [LOWER_BOUND, 0] (the ends where the sigmoid saturates). 'none' gives
    the unbounded gate (the kernels take any gate); a floor at or above 0 is no floor."""
    args = train_kda.parse_args(["--out", "x"])
    assert args.lower_bound == train_kda.LOWER_BOUND < 0
    model = train_kda.TinyKDAModel(8, 16, 2, 2, 8, args.lower_bound)
    gates = [block.attention.forget_gate for block in model.blocks]
    assert [gate.lower_bound for gate in gates] == [train_kda.LOWER_BOUND] * 2
    g = gates[0](1e3 * torch.randn(1, 8, 16))  # pushed hard both ways, the sigmoid saturates at the ends
    assert (g >= train_kda.LOWER_BOUND).all() and (g <= 0).all() and g.min() == train_kda.LOWER_BOUND
    assert train_kda.parse_args(["--out", "x", "--lower-bound", "none"]).lower_bound is None
    with pytest.raises(SystemExit):
        train_kda.parse_args(["--out", "x", "--lower-bound", "0"])
    assert "must be a negative log gate or 'none'" in capsys.readouterr().err


def test_nan_trap_saves_the_call_that_went_non_finite(tmp_path, monkeypatch):
    """The trap passes a finite call through unchanged, and stops at a non-finite output (forward,
    here a kernel that writes one NaN), at a call the kernels' value check refuses, or at a
    non-finite gradient (backward), with the call's inputs (and do, and the refusal) saved for a
    replay."""
    import stages.kda.autograd as autograd

    trap = train_kda.NanTrap(tmp_path / "nan_trap.pt")
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 4, generator=generator) for _ in range(3))
    g = -torch.rand(1, 5, 2, 4, generator=generator)
    beta = torch.rand(1, 5, 2, generator=generator)
    o, _ = trap(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    assert torch.equal(o, chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0])
    assert not (tmp_path / "nan_trap.pt").exists()

    def one_nan(*arguments, **options):
        o, final_state = chunk_kda(*arguments, **options)
        o[0, 3, 1, 2] = float("nan")
        return o, final_state

    with pytest.raises(FloatingPointError, match="the forward's output is not finite"):
        train_kda.NanTrap(tmp_path / "nan_trap.pt", one_nan)(q, k, v, g, beta)
    saved = torch.load(tmp_path / "nan_trap.pt")
    assert all(torch.equal(a, b) for a, b in zip(saved["inputs"], (q, k, v, g, beta))) and "do" not in saved

    def refused(*arguments, **options):
        raise ValueError("g sums to -90 over 8 consecutive tokens")

    with pytest.raises(FloatingPointError, match=r"refused the call \(g sums to -90"):
        train_kda.NanTrap(tmp_path / "nan_trap.pt", refused)(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    saved = torch.load(tmp_path / "nan_trap.pt")
    assert saved["refused"] == "g sums to -90 over 8 consecutive tokens"
    assert all(torch.equal(a, b) for a, b in zip(saved["inputs"], (q, k, v, g, beta)))

    backward = autograd._cpu_backward

    def nan_dg(*arguments):
        dq, dk, dv, dg, *rest = backward(*arguments)
        return dq, dk, dv, torch.full_like(dg, float("nan")), *rest

    monkeypatch.setattr(autograd, "_cpu_backward", nan_dg)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    o, _ = trap(*leaves, scale=0.5)
    do = torch.randn(o.shape, generator=generator)
    with pytest.raises(FloatingPointError, match="the gradient of g is not finite"):
        o.backward(do)
    saved = torch.load(tmp_path / "nan_trap.pt")
    assert torch.equal(saved["do"], do) and saved["options"] == {"scale": 0.5}


def test_the_checks_option_reaches_our_kernels(tmp_path, monkeypatch):
    """--checks MODE hands checks=MODE to every call of our chunk_kda ("device" by default)."""
    seen = []

    def recording(*arguments, **options):
        seen.append(options["checks"])
        return chunk_kda(*arguments, **options)

    monkeypatch.setattr(train_kda, "chunk_kda", recording)
    tiny = ["--steps", "1", "--batch", "2", "--pairs", "2", "--queries", "2", "--vocab", "4", "--d-model", "16",
            "--heads", "1", "--head-dim", "8"]
    for flags, expected in (([], "device"), (["--checks", "off"], "off"), (["--checks", "host", "--nan-trap"], "host")):
        seen.clear()
        train_kda.train(train_kda.parse_args(["--out", str(tmp_path), *tiny, *flags]))
        assert seen == [expected] * 2  # one call per layer
