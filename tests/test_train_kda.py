"""The training demo (benchmarks/train_kda.py) on the CPU: the recall task's batches, the loss falling
below a guess's on a short run, and the command's files."""

import csv
import math

import pytest
import torch

from benchmarks import train_kda

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
