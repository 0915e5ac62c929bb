"""benchmarks/fair.py on a CPU: its arguments, the rows it writes, the statistics the page reads, and
a clear refusal without CUDA."""

import argparse
import csv

import pytest

from benchmarks import fair
from kdacourse import results


def test_arguments_default_to_the_benchmark_shapes_and_three_rounds(tmp_path):
    args = fair.parse_args(["--out", str(tmp_path)])
    assert args.shapes == fair.SHAPES and (4, 8192, 32, 128) in args.shapes and args.rounds == 3
    assert args.deadline is None and not args.quick
    quick = fair.parse_args(["--out", str(tmp_path), "--quick", "--deadline", "300"])
    assert quick.shapes == fair.QUICK_SHAPES and quick.rounds == fair.QUICK_ROUNDS and quick.deadline == 300
    chosen = fair.parse_args(["--out", "x", "--shapes", "1,4096,32,128;2,1024,4,64", "--rounds", "5"])
    assert chosen.shapes == [(1, 4096, 32, 128), (2, 1024, 4, 64)] and chosen.rounds == 5


@pytest.mark.parametrize("argv", [[], ["--out", "x", "--shapes", "1,4096,32"], ["--out", "x", "--rounds", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        fair.parse_args(argv)


def test_without_cuda_it_says_so_and_writes_nothing(tmp_path, capsys, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert fair.main(["--out", str(tmp_path / "run")]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_spread_is_median_min_max_over_rounds():
    spread = fair.Spread.of([3.0, 1.0, 2.0, None])
    assert (spread.median, spread.low, spread.high, spread.count) == (2.0, 1.0, 3.0, 3)
    assert spread.text("{:.1f}") == "2.0 (1.0 to 3.0)"
    assert fair.Spread.of([1.5]).text("{:.2f}") == "1.50"
    assert fair.Spread.of([None]) is None


def _row(round_number, impl, what, ms, shape=(1, 4096, 32, 128), **extra):
    B, N, H, D = shape
    return dict(round=round_number, B=B, N=N, H=H, D=D, dtype="bfloat16", impl=impl, what=what, method="graph",
                time_ms=f"{ms:.4f}" if ms is not None else "", **extra)


def test_ratios_are_taken_round_by_round(tmp_path):
    rows = []
    for r, (fla_kernels, ours_kernels, fla_call, checked, unchecked) in enumerate(
            [(2.0, 1.0, 3.0, 2.0, 1.5), (2.2, 1.0, 3.3, 2.2, 1.5), (1.8, 1.2, 3.0, 2.5, 1.5)], 1):
        rows += [_row(r, "fla", "kernels", fla_kernels), _row(r, "ours", "kernels", ours_kernels),
                 _row(r, "fla", "call", fla_call), _row(r, "ours", "call", checked),
                 _row(r, "ours", "call_unchecked", unchecked), _row(r, "ours", "value_check", 0.3)]
    rows.append(_row(3, "ours", "prepare", None, error="RuntimeError: boom"))  # a failed row: no time
    path = tmp_path / fair.CSV_NAME
    writer, f = fair.open_writer(path)
    for row in rows:
        writer.writerow(row)
    f.close()
    back = fair.read_rows(path)
    assert list(back[0]) == fair.FIELDS and len(back) == len(rows)
    named = fair.comparisons(back)[(1, 4096, 32, 128)]
    kernels = named["kernels FLA / ours"]
    assert (kernels.median, kernels.low, kernels.high) == pytest.approx((2.0, 1.5, 2.2))
    assert named["call FLA / ours unchecked"].median == pytest.approx(2.0)
    assert named["call FLA / ours checked"].low == pytest.approx(3.0 / 2.5)
    assert named["check cost (call - unchecked)"].median == pytest.approx(0.7)
    assert named["check alone"].median == pytest.approx(0.3)
    summary = fair.summarize(back)[(1, 4096, 32, 128)]
    assert summary[("ours", "kernels")].high == 1.2 and ("ours", "prepare") not in summary


def test_a_pair_without_a_common_round_has_no_ratio():
    rows = [_row(1, "fla", "kernels", 2.0), _row(2, "ours", "kernels", 1.0)]
    assert fair.comparisons(rows)[(1, 4096, 32, 128)]["kernels FLA / ours"] is None


class _Shape(fair.Shape):
    """A Shape without a GPU: fixed callables, no compile."""

    def __init__(self):
        from stages.common.program_cost import Cost

        self.B, self.N, self.H, self.D, self.label = 1, 256, 2, 128, "B=1 N=256 H=2 D=128"
        self.functions = {("ours", "kernels"): lambda: None, ("ours", "prepare"): lambda: None}
        self.methods = {("ours", "kernels"): "graph", ("ours", "prepare"): "events", ("fla", "kernels"): "graph"}
        self.errors = {("fla", "kernels"): "no CUDA graph: RuntimeError: capture"}
        self.costs = {"prepare": Cost(gemm_flops=10, bytes_read=4, bytes_written=2),
                      "recurrence": Cost(gemm_flops=20, bytes_read=8, bytes_written=2)}


def test_a_round_writes_times_errors_and_the_kernels_costs(tmp_path):
    path = tmp_path / fair.CSV_NAME
    writer, f = fair.open_writer(path)
    logged = []
    _Shape().measure(1, writer, logged.append, fair.MEASUREMENTS, timer=lambda function: function() or 0.25)
    f.close()
    rows = {(row["impl"], row["what"]): row for row in csv.DictReader(open(path))}
    assert set(rows) == {("ours", "kernels"), ("ours", "prepare"), ("fla", "kernels")}  # unmeasured keys skipped
    assert rows[("ours", "kernels")]["time_ms"] == "0.2500" and rows[("ours", "kernels")]["method"] == "graph"
    assert rows[("fla", "kernels")]["error"].startswith("no CUDA graph") and not rows[("fla", "kernels")]["time_ms"]
    assert rows[("ours", "prepare")]["gemm_flops"] == "10" and rows[("ours", "prepare")]["bytes_written"] == "2"
    assert results.kernel_costs(list(rows.values())) == {  # what the page reads back
        ((1, 256, 2, 128), "prepare"): dict(gemm_flops=10, elementwise_flops=0, bytes_read=4, bytes_written=2)}
    assert len(logged) == 3 and "round 1 B=1 N=256 H=2 D=128 ours kernels: 0.2500 ms (graph)" in logged


def test_program_costs_count_the_kernels_forward_launches():
    pytest.importorskip("tilelang")
    costs = fair.program_costs(1, 256, 2, 128, num_sms=132)
    tokens = 256 * 2
    assert costs["prepare"].bytes_by_buffer["A_qk"] == tokens * 64 * 2  # bf16, chunk 64: forward's defaults
    assert costs["recurrence"].bytes_by_buffer["O"] == tokens * 128 * 2
    # every program of a (batch, head) reads the whole W: 4 programs of 32 columns here, 2 of 64 at B=8 H=66
    assert costs["recurrence"].bytes_by_buffer["W"] == 4 * tokens * 128 * 2
    wide = fair.program_costs(8, 64, 66, 128, num_sms=132)
    assert wide["recurrence"].bytes_by_buffer["W"] == 2 * 8 * 64 * 66 * 128 * 2


def test_block_dv_is_wide_only_where_nine_sms_in_ten_keep_a_program():
    from stages.kda.config import default_block_dv

    assert default_block_dv(1, 32, 128, 132) == 32  # 64 programs of 64 columns would idle 68 SMs
    assert default_block_dv(8, 16, 128, 132) == 64  # 256 programs of 64
    # the boundary: 120 programs keep 9 SMs in 10 of 132 busy (118.8), 118 do not
    assert default_block_dv(2, 30, 128, 132) == 64 and default_block_dv(1, 59, 128, 132) == 32
    assert default_block_dv(8, 16, 96, 132) == 32  # 64 does not divide d_v


def _committed_run(folder, complete=True, **meta_extra):
    """A fair run's files as committed: two rounds at one shape, the roofs of the run."""
    import json

    from benchmarks.bench import STAGES

    writer, f = fair.open_writer(folder / fair.CSV_NAME)
    costs = {"prepare": dict(gemm_flops=4 * 10 ** 9, elementwise_flops=10 ** 8, bytes_read=6 * 10 ** 7,
                             bytes_written=4 * 10 ** 7),
             "recurrence": dict(gemm_flops=10 ** 10, elementwise_flops=10 ** 7, bytes_read=3 * 10 ** 8,
                                bytes_written=10 ** 8)}
    for r in (1, 2):
        for (impl, what), ms in {("fla", "call"): 2.0, ("ours", "call"): 1.6, ("ours", "call_unchecked"): 1.0,
                                 ("ours", "value_check"): 0.5, ("fla", "kernels"): 1.8, ("ours", "kernels"): 0.9,
                                 ("ours", "prepare"): 0.5, ("ours", "recurrence"): 0.4}.items():
            writer.writerow(_row(r, impl, what, ms * (1 + 0.1 * r), **costs.get(what, {}) if impl == "ours" else {}))
    f.close()
    meta = dict(device="NVIDIA H200", date="2026-12-01", command="python -m benchmarks.fair --out /root/x",
                rounds=2, seconds=100, kernel=STAGES["s05"].kernel_digest(), complete=complete,
                roofs=dict(copy_bytes=1, copy_ms=1.0, bandwidth_bytes_per_s=4e12, gemm_size=8192, gemm_ms=1.0,
                           bf16_flops_per_s=600e12), **meta_extra)
    (folder / fair.META_NAME).write_text(json.dumps(meta))


def test_the_page_says_not_measured_yet_without_a_run(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from kdacourse.pages import fair as page

    monkeypatch.setattr(page, "RESULTS", tmp_path)
    for name, write in page.generated_files().items():
        write(tmp_path / name.split("/")[-1])
    assert (tmp_path / "fair_timings.md").read_text().startswith("Not measured yet")
    assert (tmp_path / "fair_roofline.md").read_text().startswith("Not measured yet")
    assert "not measured yet" in (tmp_path / "fair_roofline.svg").read_text()


def test_the_page_shows_ratios_with_spread_and_each_kernel_on_the_roofline(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from kdacourse.pages import fair as page

    _committed_run(tmp_path)
    monkeypatch.setattr(page, "RESULTS", tmp_path)
    for name, write in page.generated_files().items():
        write(tmp_path / name.split("/")[-1])
    timings = (tmp_path / "fair_timings.md").read_text()
    assert "on the committed kernel" in timings and "`python -m benchmarks.fair --out DIR`" in timings
    # kernels: FLA 1.98 / ours 0.99 and 2.16 / 1.08, both 2.00; call checks off: 2.2 / 1.1 and 2.4 / 1.2
    assert "| 1, 4096, 32, 128 | 2.00 (2.00 to 2.00) | 2.00 (2.00 to 2.00) | 1.25 (1.25 to 1.25) |" in timings
    roofline = (tmp_path / "fair_roofline.md").read_text()
    assert "4.00 TB/s and 600 TFLOP/s bf16, measured by the run" in roofline and "150 FLOP/byte" in roofline
    # prepare: 4 GFLOP over 100 MB is 40 FLOP/byte, at the median 0.575 ms (0.55, 0.6): 6.96 TFLOP/s, 0.17 TB/s;
    # the memory roof at 40 FLOP/byte is 160 TFLOP/s, so 4 % of it
    assert "| prepare | 1, 4096, 32, 128 | 0.575 | 4.0 | 0.10 | 100 | 40.0 | 7.0 | 0.17 | memory | 4% |" in roofline
    svg = (tmp_path / "fair_roofline.svg").read_text()
    assert "prepare" in svg and "recurrence" in svg and "B=1, N=4096, H=32" in svg


def test_a_stopped_run_is_said_so(tmp_path, monkeypatch):
    from kdacourse.pages import fair as page

    _committed_run(tmp_path, complete=False)
    monkeypatch.setattr(page, "RESULTS", tmp_path)
    page.write_timings(tmp_path / "t.md")
    assert "stopped before it finished" in (tmp_path / "t.md").read_text()


@pytest.fixture
def empty_compile_caches():
    """The fast path's compiled-kernel caches emptied before and after a test that fakes compiles."""
    from stages.kda import compiled

    caches = (compiled.compiled_prepare, compiled.compiled_recurrence)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


def test_a_whole_run_on_the_cpu_with_interpreted_kernels(tmp_path, monkeypatch, capsys, empty_compile_caches):
    """main() end to end without a GPU: the tile interpreter stands in for tilelang.compile, a fixed
    timer for do_bench; graphs cannot capture here (events instead) and FLA is missing or cannot run:
    both are recorded, and the rest is measured. The kernels timed alone are the ones forward
    launches: each compiled once (forward's calls find them compiled), with the sizes forward resolves."""
    torch = pytest.importorskip("torch")
    tilelang = pytest.importorskip("tilelang")
    import collections

    from benchmarks import bench
    from stages.common.interpreter import interpret
    from stages.kda import checks, config

    compiles = collections.Counter()

    def compile_on_the_cpu(program, out_idx, target):
        compiles[f"{program.attrs['global_symbol']}/{len(program.params)}"] += 1
        run = interpret(program, out_idx=out_idx)
        return lambda *tensors: [torch.from_numpy(x) for x in run(*tensors)]

    def on_cpu(stage, B, N, H, D, dtype, gate_range):
        assert gate_range == (0.5, 0.9)  # --gate-range reaches the inputs
        generator = torch.Generator().manual_seed(0)
        q, k = (torch.nn.functional.normalize(torch.randn(B, N, H, D, generator=generator), dim=-1).to(dtype)
                for _ in range(2))
        v = torch.randn(B, N, H, D, generator=generator).to(dtype)
        g = torch.log(gate_range[0] + (gate_range[1] - gate_range[0]) * torch.rand(B, N, H, D, generator=generator))
        return [q, k, v, g, 0.1 + 0.8 * torch.rand(B, N, H, generator=generator)]

    for name, value in {"is_available": lambda: True, "get_device_name": lambda *a: "a CPU",
                        "synchronize": lambda *a: None, "empty_cache": lambda: None}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(tilelang, "compile", compile_on_the_cpu)
    monkeypatch.setattr(bench, "make_inputs", on_cpu)
    monkeypatch.setattr(checks, "check_on_cuda", lambda tensors: None)
    monkeypatch.setattr(config, "streaming_multiprocessors", lambda device: 2)  # 64 value columns fill 2 SMs
    monkeypatch.setattr(bench, "fla", lambda stage: (_ for _ in ()).throw(ImportError("no FLA here")))
    monkeypatch.setattr(fair, "make_timer", lambda quick: lambda function: [function(), 1.0][1])
    out = tmp_path / "run"
    assert fair.main(["--out", str(out), "--shapes", "1,128,2,128", "--rounds", "2", "--gate-range", "0.5,0.9"]) == 0
    rows = fair.read_rows(out / fair.CSV_NAME)
    measured = {(row["round"], row["impl"], row["what"]): row for row in rows}
    assert len(rows) == 2 * len(fair.MEASUREMENTS)
    assert all(measured[("2", "ours", what)]["time_ms"] == "1.0000" for what in
               ("kernels", "prepare", "recurrence", "call", "call_unchecked", "value_check", "prepare_flagged"))
    assert measured[("1", "ours", "kernels")]["method"] == "events"  # no graph without CUDA
    assert measured[("1", "fla", "call")]["error"] == "ImportError: no FLA here"
    assert int(measured[("1", "ours", "prepare")]["gemm_flops"]) > 0
    # the prepare with checks off, the default call's (Flags after beta), the recurrence: once each
    assert compiles == {"kda_prepare/11": 1, "kda_prepare/12": 1, "kda_recurrence/9": 1}
    meta = __import__("json").loads((out / fair.META_NAME).read_text())
    assert meta["complete"] and meta["device"] == "a CPU" and "error" in meta["roofs"]
    assert meta["gate_range"] == [0.5, 0.9]
    assert meta["shapes"]["B=1 N=128 H=2 D=128"]["config"] == dict(
        chunk_size=64, block_dv=64, threads=128, num_stages=2, prepare_threads=256, intra_threads=256,
        channel_passes=2, programs_per_sm=1)
    assert "did not capture" in capsys.readouterr().out


def test_a_runs_note_and_the_roofs_source_are_shown(tmp_path, monkeypatch):
    """A meta rebuilt after the run (its roofs measured apart) says so above the table and the roofline."""
    from kdacourse.pages import fair as page

    _committed_run(tmp_path, note="Rebuilt from the log.", roofs_from="measured on an H200 after the run")
    monkeypatch.setattr(page, "RESULTS", tmp_path)
    page.write_timings(tmp_path / "t.md")
    page.write_roofline_table(tmp_path / "r.md")
    assert "on the committed kernel. Rebuilt from the log.\n" in (tmp_path / "t.md").read_text()
    roofline = (tmp_path / "r.md").read_text()
    assert "600 TFLOP/s bf16, measured on an H200 after the run" in roofline and "measured by the run" not in roofline


def test_what_the_flags_and_the_any_gate_branch_cost_is_a_share_of_the_kernels():
    """(prepare with it - prepare without it) / kernels, round by round, in percent."""
    rows = [dict(round=str(r), B="1", N="4096", H="32", D="128", impl="ours", what=what, time_ms=str(ms))
            for r, times in ((1, (2.0, 0.5, 0.52, 0.45)), (2, (2.0, 0.5, 0.51, 0.40)))
            for what, ms in zip(("kernels", "prepare", "prepare_flagged", "prepare_bounded_gate"), times)]
    named = fair.comparisons(rows)[(1, 4096, 32, 128)]
    flags, any_gate = named["flags in the prepare (% of the kernels)"], named["any-gate branch (% of the kernels)"]
    assert (flags.low, flags.high) == pytest.approx((0.5, 1.0))
    assert (any_gate.low, any_gate.high) == pytest.approx((2.5, 5.0))


@pytest.mark.parametrize("text", ["0,0.5", "0.5,0.4", "0.5", "a,b", "0.1,1.5"])
def test_a_gate_range_outside_zero_to_one_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError):
        fair.parse_gate_range(text)
