"""benchmarks/decode.py on the CPU: its arguments, its byte count, its float64 torch step against the
stage 7 reference, and its refusal without a GPU."""

import numpy as np
import pytest
import torch

from benchmarks import decode
from stages.common.errors import error_report
from stages.common.inputs import l2_normalize
from stages.s07_serving.reference import decode_step


def test_defaults_are_the_issue_shape(tmp_path):
    args = decode.parse_args(["--out", str(tmp_path)])
    assert (args.B, args.H, args.d, args.pool, args.dtype) == (64, 32, 128, 256, "bfloat16")
    assert args.block_dv == (16, 32, 64) and args.out == tmp_path


def test_arguments_are_read(tmp_path):
    args = decode.parse_args(["--out", str(tmp_path), "--B", "8", "--H", "4", "--d", "64", "--pool", "9",
                              "--block-dv", "32", "--dtype", "float16", "--seed", "3"])
    assert (args.B, args.H, args.d, args.pool, args.block_dv, args.dtype, args.seed) == (8, 4, 64, 9, (32,), "float16", 3)


@pytest.mark.parametrize("argv, message", [
    ([], "--out"),
    (["--B", "0"], "expected a positive integer"),
    (["--B", "64", "--pool", "32"], "--pool must be at least --B"),
    (["--block-dv", "48"], "--block-dv 48 does not divide --d = 128"),
    (["--block-dv", "32,x"], "expected a positive integer"),
    (["--dtype", "float32"], "invalid choice"),
])
def test_bad_arguments_are_refused(tmp_path, capsys, argv, message):
    argv = argv if argv == [] else ["--out", str(tmp_path), *argv]
    with pytest.raises(SystemExit):
        decode.parse_args(argv)
    assert message in capsys.readouterr().err


def test_bytes_moved_at_the_issue_shape():
    total, state = decode.bytes_moved(64, 32, 128, 128, 2)
    assert state == 2 * 64 * 32 * 128 * 128 * 4 == 256 * 2**20  # each 64 KiB state read and written
    assert total - state == 64 * 32 * (4 * 128 * 2 + 128 * 4 + 4) + 64 * 4  # q, k, v, o; g; beta; slots


def test_torch_step_is_the_reference_step():
    rng = np.random.default_rng(0)
    B, H, d_k, d_v, P = 3, 2, 8, 4, 5
    q, k = (l2_normalize(rng.standard_normal((B, H, d_k))) for _ in range(2))
    v, g, beta = rng.standard_normal((B, H, d_v)), np.log(rng.uniform(0.3, 1, (B, H, d_k))), rng.uniform(0, 1, (B, H))
    pool, slots = rng.standard_normal((P, H, d_k, d_v)), np.array([4, 1, 2])
    states = torch.tensor(pool[slots])
    expected_o = decode_step(q, k, v, g, beta, pool, slots)
    o, new_states = decode.torch_decode_step(*(torch.tensor(a) for a in (q, k, v, g, beta)), states)
    assert error_report(o, expected_o).rel_l2 <= 1e-14
    assert error_report(new_states, pool[slots]).rel_l2 <= 1e-14


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present: the benchmark would run")
def test_without_cuda_it_says_so(tmp_path):
    with pytest.raises(SystemExit, match="torch sees no CUDA device"):
        decode.main(["--out", str(tmp_path)])
    assert not (tmp_path / "decode.csv").exists()


def test_a_run_on_the_cpu_checks_and_times_each_block_and_the_default_calls(tmp_path, monkeypatch):
    """run() end to end without a GPU: the tile interpreter stands in for tilelang.compile, a fixed
    spread for do_bench; graphs cannot capture here (events instead) and FLA is missing. Every block
    size's kernel agrees with the float64 step, and the default calls are timed at decode's own block."""
    tilelang = pytest.importorskip("tilelang")
    from stages.common.interpreter import interpret
    from stages.kda import checks, compiled

    def compile_on_the_cpu(program, out_idx, target):
        assert out_idx == [len(program.params) - 1]  # o, after the pool (and the flags)
        run = interpret(program)  # in place: what it writes lands in the torch tensors given

        def launch(*tensors):
            o = torch.empty_like(tensors[2])  # (B, H, d_v) in v's dtype
            run(*tensors, o)
            return o
        return launch

    def on_cpu(B, H, d, P, dtype, seed):
        generator = torch.Generator().manual_seed(seed)
        q, k = (torch.nn.functional.normalize(torch.randn(B, H, d, generator=generator), dim=-1) for _ in range(2))
        v = torch.randn(B, H, d, generator=generator)
        g = (0.9 + 0.099 * torch.rand(B, H, d, generator=generator)).log()
        beta = 0.1 + 0.8 * torch.rand(B, H, generator=generator)
        pool = 0.1 * torch.randn(P, H, d, d, generator=generator)
        slots = torch.randperm(P, generator=generator)[:B].to(torch.int32)
        return q.to(dtype), k.to(dtype), v.to(dtype), g, beta, pool, slots

    compiled.compiled_decode.cache_clear()
    monkeypatch.setattr(tilelang, "compile", compile_on_the_cpu)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(checks, "check_on_cuda", lambda tensors: None)
    monkeypatch.setattr(decode, "make_inputs", on_cpu)
    monkeypatch.setattr(decode, "spread", lambda function: [function(), (1.0, 0.9, 1.1)][1])
    args = decode.parse_args(["--out", str(tmp_path), "--B", "2", "--H", "1", "--d", "32", "--pool", "3",
                              "--block-dv", "16,32"])
    try:
        rows = decode.run(args, log=lambda message: None)
    finally:
        compiled.compiled_decode.cache_clear()
    ours = {(row["what"], row["block_dv"]): row for row in rows if row["impl"] == "ours"}
    assert set(ours) == {("kernel", 16), ("kernel", 32), ("call", 32), ("call_host_checks", 32), ("call_graph", 32),
                         ("call_unchecked_graph", 32)}  # decode_block_dv(32) = 32: 64 does not divide d
    assert all(not row.get("error") and row["time_ms"] == "1.00000" for row in ours.values())
    for block_dv in (16, 32):
        assert float(ours[("kernel", block_dv)]["rel_l2_o"]) < 1e-2  # bf16 inputs against the float64 step
        assert float(ours[("kernel", block_dv)]["rel_l2_state"]) < 1e-5  # the states stay fp32
    assert ours[("call_graph", 32)]["method"] == "events"  # no graph without CUDA
    assert [row["error"].split(":")[0] for row in rows if row["impl"] == "fla"] == ["ModuleNotFoundError"]
    assert (tmp_path / "decode.csv").exists()
