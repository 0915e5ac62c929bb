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
    assert meta["map_check"]["rel_l2"] < context_parallel.MAX_REL_L2 and meta["ranks"]["2"]["tokens_per_rank"] == 256


@pytest.mark.gpu
def test_two_ranks_sharing_the_gpu_equal_the_references(tmp_path):
    """bf16 through the fast path, the states passed through the host (gloo): o and every gradient
    within bf16's rounding of the float64 references on the whole sequence."""
    context_parallel_gpus.main(["--out", str(tmp_path), "--ranks", "2", "--tokens", "512", "--H", "2", "--d", "32",
                                "--check-tokens", "512", "--backend", "gloo", "--rounds", "1", "--repeats", "1",
                                "--no-fla", "--limit", "400"])
    _, meta = _rows_and_meta(tmp_path)
    assert max(meta["check"].values()) < BF16_BOUND, meta["check"]


def test_the_page_reads_a_committed_run(tmp_path, monkeypatch):
    """Stage 8's page from a run written here: the medians over rounds, the critical paths worked out by
    hand (R = 4: the chain's start 1 ms, two middle ranks at max(1 + 0, 1 + 1) + 0.01 and then + 0.01,
    the end's 1 ms: 3.02 ms against 4 x 1 ms; the prepare kept: max(1, 1 + 0.4) + 0.01 + 0.01 + 0.4 =
    1.82 ms), and no messages' share without a multi-GPU run."""
    from kdacourse import results
    from kdacourse.pages import s08_context_parallel as page

    times = {"forward_from_zero": (1.0, 1.0, 3.0), "forward_map": (1.0, 0.5, 1.0), "pass_step": (0.01, 0.01, 0.02),
             "forward_from_state": (1.0, 2.0, 1.0), "recurrence_from_state": (0.4, 0.4, 0.3)}
    with open(tmp_path / "context_parallel_forward.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=context_parallel.FIELDS)
        writer.writeheader()
        writer.writerows(dict(ranks=4, tokens=64, tokens_per_rank=16, H=1, D=8, dtype="bfloat16", round=r + 1, what=what,
                              time_ms=t) for what, by_round in times.items() for r, t in enumerate(by_round))
    (tmp_path / "context_parallel_forward_meta.json").write_text(json.dumps(
        dict(command="python -m benchmarks.context_parallel --out x", device="a GPU", H=1, D=8, dtype="bfloat16",
             tokens=64)))
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    assert results.context_parallel_times(results.read_rows(tmp_path / "context_parallel_forward.csv"))[4][
        "forward_map"] == {1: 1.0, 2: 0.5, 3: 1.0}
    page.write_rank_times(tmp_path / "out.md")
    text = (tmp_path / "out.md").read_text()
    assert "| 4 | 16 | 1.000 | 1.000 | 0.010 | 1.000 | 0.400 | 3.02 (1.32x) | 1.82 (2.20x) | 4.00 | - |" in text, text
    assert "No backward run committed" in text and "none is committed" in text


def test_the_page_says_which_rank_counts_were_not_timed(tmp_path, monkeypatch):
    """A rank count whose pieces failed (its part past the GPU's memory) is left out of the table and
    named below it with its error; the others stay in the table."""
    from kdacourse import results
    from kdacourse.pages import s08_context_parallel as page

    rows = [dict(ranks=ranks, tokens=64, tokens_per_rank=64 // ranks, H=1, D=8, dtype="bfloat16", round=1, what=what,
                 time_ms="" if ranks == 2 and what != "pass_step_backward" else "1.0",
                 error="MemoryError: CUDA out of memory. Tried" if ranks == 2 and what != "pass_step_backward" else "")
            for ranks in (2, 4) for what in context_parallel.PIECES["backward"]]
    with open(tmp_path / "context_parallel_backward.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=context_parallel.FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (tmp_path / "context_parallel_backward_meta.json").write_text(json.dumps(
        dict(command="python -m benchmarks.context_parallel --direction backward --out /x", device="a GPU", H=1, D=8,
             dtype="bfloat16", tokens=64)))
    monkeypatch.setattr(results, "RESULTS", tmp_path)
    page.write_rank_times(tmp_path / "out.md")
    text = (tmp_path / "out.md").read_text()
    assert "R = 2 (32 tokens a rank) was not timed on this GPU: MemoryError: CUDA out of memory." in text, text
    assert "| 4 | 16 |" in text and "| 2 | 32 |" not in text and "--out DIR" in text
