"""benchmarks/context_parallel.py and benchmarks/context_parallel_gpus.py: their arguments, the message's
bytes, the refusals without a GPU, the multi-GPU script run over two gloo processes on the CPU (float64,
its check against the references to rounding, a row per rank and call), and on a GPU (`gpu`), the
single-GPU pieces at a small size and the multi-GPU script with two ranks sharing the GPU."""

import csv
import json

import pytest

from benchmarks import context_parallel, context_parallel_gpus

BF16_BOUND = 2e-2  # bf16 kernels against float64: a few times bf16's unit roundoff (2^-8)


def test_arguments_are_read(tmp_path):
    args = context_parallel.parse_args(["--out", str(tmp_path), "--direction", "backward", "--tokens", "4096",
                                        "--ranks", "2,8", "--H", "4", "--d", "64", "--rounds", "2"])
    assert (args.direction, args.tokens, args.ranks, args.H, args.d, args.rounds) == ("backward", 4096, [2, 8], 4, 64, 2)
    defaults = context_parallel.parse_args(["--out", str(tmp_path)])
    assert (defaults.direction, defaults.tokens, defaults.ranks, defaults.H, defaults.d) == ("forward", 2**20, [2, 4, 8], 32, 128)


@pytest.mark.parametrize("ranks", ["1,2", "3", "2,x"])
def test_ranks_that_do_not_split_the_tokens_are_refused(tmp_path, ranks, capsys):
    with pytest.raises(SystemExit):
        context_parallel.parse_args(["--out", str(tmp_path), "--tokens", "64", "--ranks", ranks])
    assert "--ranks" in capsys.readouterr().err


def test_a_message_is_one_fp32_state():
    assert context_parallel.message_bytes(32, 128, 128) == 2 * 2**20
    assert context_parallel.message_bytes(1, 8, 6) == 192


def test_multi_gpu_arguments_are_checked(tmp_path, capsys):
    for argv in (["--ranks", "1"], ["--ranks", "3", "--tokens", "64"], ["--device", "cpu"]):
        with pytest.raises(SystemExit):
            context_parallel_gpus.parse_args(["--out", str(tmp_path), *argv])
    assert "NCCL sends CUDA tensors only" in capsys.readouterr().err


def test_refuse_to_run_without_a_gpu(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        context_parallel.main(["--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="needs CUDA"):
        context_parallel_gpus.main(["--out", str(tmp_path)])


def _rows_and_meta(folder):
    with open(folder / context_parallel_gpus.CSV_NAME) as f:
        rows = list(csv.DictReader(f))
    return rows, json.loads((folder / context_parallel_gpus.META_NAME).read_text())


def test_multi_gpu_script_over_two_gloo_processes_on_the_cpu(tmp_path):
    context_parallel_gpus.main(["--out", str(tmp_path), "--ranks", "2", "--tokens", "40", "--H", "1", "--d", "8",
                                "--check-tokens", "48", "--check-d", "8", "--device", "cpu", "--backend", "gloo",
                                "--rounds", "1", "--repeats", "2", "--limit", "120"])
    rows, meta = _rows_and_meta(tmp_path)
    assert set(meta["check"]) == {"o", "dq", "dk", "dv", "dg", "dbeta"}
    assert max(meta["check"].values()) < 1e-12, meta["check"]
    assert meta["message_ms"] > 0 and meta["fla"].startswith("not run")
    timed = {(row["impl"], row["what"], row["rank"]) for row in rows if row["time_ms"]}
    assert timed == {(impl, what, rank) for impl in ("ours_pass", "ours_gather")
                     for what in ("forward", "forward_backward") for rank in ("0", "1")}
    assert not any(row["error"] for row in rows)


@pytest.mark.gpu
def test_single_gpu_pieces_at_a_small_size(tmp_path):
    args = context_parallel.parse_args(["--out", str(tmp_path), "--tokens", "512", "--ranks", "2", "--H", "2",
                                        "--d", "32", "--rounds", "1"])
    rows = context_parallel.run(args, log=lambda line: None)
    assert {row["what"] for row in rows if row.get("time_ms")} == set(context_parallel.PIECES["forward"])
    meta = json.loads((tmp_path / "context_parallel_forward_meta.json").read_text())
    assert meta["ranks"]["2"]["rel_l2_map"] < context_parallel.MAX_REL_L2


@pytest.mark.gpu
def test_two_ranks_sharing_the_gpu_equal_the_references(tmp_path):
    """bf16 through the fast path, the states passed through the host (gloo): o and every gradient
    within bf16's rounding of the float64 references on the whole sequence."""
    context_parallel_gpus.main(["--out", str(tmp_path), "--ranks", "2", "--tokens", "512", "--H", "2", "--d", "32",
                                "--check-tokens", "512", "--backend", "gloo", "--rounds", "1", "--repeats", "1",
                                "--no-fla", "--limit", "400"])
    _, meta = _rows_and_meta(tmp_path)
    assert max(meta["check"].values()) < BF16_BOUND, meta["check"]
