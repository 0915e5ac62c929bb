"""benchmarks/varlen.py on the CPU: its arguments, its mixes of lengths, its summary, and its refusal
without a GPU."""

import numpy as np
import pytest

from benchmarks import varlen


def test_arguments_are_read(tmp_path):
    args = varlen.parse_args(["--out", str(tmp_path), "--mix", "chat", "--rounds", "2", "--H", "4", "--d", "64",
                              "--dtype", "float16", "--seed", "5"])
    assert (args.mix, args.rounds, args.H, args.d, args.dtype, args.seed) == (["chat"], 2, 4, 64, "float16", 5)
    assert varlen.parse_args(["--out", str(tmp_path)]).mix == list(varlen.MIXES)


def test_an_unknown_mix_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        varlen.parse_args(["--out", str(tmp_path), "--mix", "chat,huge"])
    assert "unknown mix ['huge']" in capsys.readouterr().err


@pytest.mark.parametrize("name", list(varlen.MIXES))
def test_mix_lengths_lie_in_their_bounds_and_vary(name):
    count, shortest, longest = varlen.MIXES[name]
    lengths = varlen.mix_lengths(name, seed=0)
    assert len(lengths) == count and all(shortest <= n <= longest for n in lengths)
    assert max(lengths) > 4 * min(lengths), "a mix of lengths that hardly differ"
    assert lengths == varlen.mix_lengths(name, seed=0) and lengths != varlen.mix_lengths(name, seed=1)


def test_summary_takes_the_median_over_rounds_and_the_ratio_of_the_calls():
    rows = [dict(mix="chat", impl=impl, what="call", time_ms=str(time))
            for impl, times in (("ours", (1.0, 3.0, 2.0)), ("fla", (4.0, 5.0, 9.0))) for time in times]
    (line,) = varlen.summary(rows)
    assert "ours call 2.000 ms" in line and "fla call 5.000 ms" in line
    assert np.isclose(float(line.rsplit(" ", 1)[1]), 2.5)


def test_refuses_to_run_without_a_gpu(tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA device"):
        varlen.main(["--out", str(tmp_path)])
