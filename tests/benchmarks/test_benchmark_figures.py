"""kdacourse.pages.benchmarks and profile_s05: the tables of the benchmarks page and the stage 5 profile, made from
small results written here (the precision table in stage order, the runs table's kernel check, the ratio
summary's target, the ncu reader); the kernel digest the benchmarks record and the page compares."""

import dataclasses
import json
import re

import pytest

from benchmarks import profile_s05
from benchmarks.bench import STAGES
from benchmarks.merge import write_rows
from stages.common.program_digest import program_digest
from kdacourse import results
from kdacourse.pages import benchmarks as figures
from stages.kda.prepare import build_prepare_program

FIELDS = ["stage", "N", "dtype", "impl", "gate_lower", "gate_upper", "rel_l2_vs_float64", "error"]


def precision_row(stage, N, value, error=""):
    return dict(stage=stage, N=N, dtype="float16", impl="ours", gate_lower="0.9", gate_upper="0.999",
                rel_l2_vs_float64=value, error=error)


def test_precision_table_is_in_stage_order_with_gaps_and_failures_shown(tmp_path, monkeypatch):
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    write_rows(tmp_path / "precision.csv", FIELDS, [
        precision_row("s03_gated_deltanet", 4096, "5e-04"),
        precision_row("s03_gated_deltanet", 65536, "", error="RuntimeError: out of memory"),
        precision_row("s01_linear_attention", 4096, "4e-04"),
        precision_row("s01_linear_attention", 16384, "4e-04"),  # a length the s03 run did not reach
        precision_row("s01_linear_attention", 65536, "5e-04"),
    ])

    figures.write_precision_table(tmp_path / "table.md")

    body = [line.split("|")[1:-1] for line in (tmp_path / "table.md").read_text().splitlines()[2:]]
    cells = [[cell.strip() for cell in line] for line in body]
    assert cells == [
        ["s01 linear attention", "no gates", "float16", "ours", "4e-04", "4e-04", "5e-04"],
        ["s03 Gated DeltaNet", "[0.9, 0.999]", "float16", "ours", "5e-04", "–", "failed"],
    ]


def test_runs_table_flags_results_of_a_kernel_changed_since(tmp_path, monkeypatch):
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    current = STAGES["s05"].kernel_digest()  # what a benchmark run records
    assert current == results.current_kernel_digest("s05_fast_kda")  # what the page compares it with
    run = dict(device="H200", date="d", seconds=1, command="bench", timed=["s05_fast_kda"], precision=[])
    runs = [dict(run, kernels={"s05_fast_kda": current}), dict(run, kernels={"s05_fast_kda": "0" * 12}), run]
    (tmp_path / "meta.json").write_text(json.dumps({"runs": runs}))

    figures.write_meta(tmp_path / "meta.md")

    rows = [line for line in (tmp_path / "meta.md").read_text().splitlines() if line.startswith("| ") and "bench" in line]
    assert [row.split("|")[5].strip() for row in rows] == [
        "as committed", "changed since: s05 fast KDA", "not recorded"]


def test_kernel_digest_follows_the_program_not_the_file(tmp_path, monkeypatch):
    """A stage's digest is its program's code, wherever it is: a module that re-exports a builder
    (as stage 5's kernel module re-exports stages.kda's) has the digest of the builder it imports."""
    def write(program_line, elsewhere):
        (tmp_path / "probe_kernel.py").write_text(
            f"def build_program(n):\n    # a comment\n    {program_line}\n\n\ndef forward(x):\n    {elsewhere}\n")

    monkeypatch.syspath_prepend(str(tmp_path))
    stage = dataclasses.replace(STAGES["s05"], program_modules=("probe_kernel",))
    reexport = "from probe_kernel import build_program, forward\n"
    write("return n + 1", "return x")
    before = stage.kernel_digest()
    assert program_digest(reexport) == before
    write("return n + 1", "return 2 * x")  # the wrapper changes: the kernel is the same
    assert stage.kernel_digest() == before == program_digest(reexport)
    write("return n + 2", "return 2 * x")  # the program changes
    assert stage.kernel_digest() != before and program_digest(reexport) == stage.kernel_digest()
    (tmp_path / "probe_kernel.py").write_text("WIDTH = 1\n")
    with pytest.raises(ValueError, match="build_"):
        stage.kernel_digest()


BENCH_FIELDS = ["stage", "B", "N", "H", "D", "dtype", "impl", "time_ms", "memory_bound_ms"]


def timing(stage, N, impl, ms):
    return dict(stage=stage, B=1, N=N, H=32, D=128, dtype="bfloat16", impl=impl, time_ms=ms, memory_bound_ms="0.1")


def test_ratio_summary_checks_the_target_at_every_shape(tmp_path, monkeypatch):
    monkeypatch.setattr(figures, "RESULTS", tmp_path)
    write_rows(tmp_path / "bench.csv", BENCH_FIELDS, [
        timing("s02_scalar_decay", 4096, "fla", "1.0"), timing("s02_scalar_decay", 4096, "ours", "0.5"),
        timing("s02_scalar_decay", 16384, "fla", "1.0"), timing("s02_scalar_decay", 16384, "ours", "2.0"),
        timing("s04_kda", 4096, "fla", "1.0"), timing("s04_kda", 4096, "ours", "10.0"),
        timing("s04_kda", 4096, "torch", "50.0"),
    ])

    figures.write_ratio_summary(tmp_path / "summary.md")

    rows = [[cell.strip() for cell in line.split("|")[1:-1]]
            for line in (tmp_path / "summary.md").read_text().splitlines()[2:]]
    assert rows == [
        ["s02 scalar decay", "0.50x to 2.00x", "–", "5.0% to 20.0%", "missed at 2 shapes"],
        ["s04 KDA", "0.10x to 0.10x", "5.0x to 5.0x", "1.0% to 1.0%", "not targeted"],
    ]


NCU_TEXT = """\
==PROF== Connected to process 1
  kda_prepare_kernel (256, 32, 1)x(256, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    ----------------------- ----------- ------------
    Metric Name             Metric Unit Metric Value
    Elapsed Cycles                cycle    2,000,000
    Memory Throughput                 %        50.00
    Duration                         ms         1.25
    Block Size                                                   256
    Block Limit Registers                 block            2
    Block Limit Shared Mem                block            1
    Memory Throughput                 %        99.00
"""


def test_ncu_text_is_read_metric_by_metric(tmp_path):
    (tmp_path / "ncu.txt").write_text(NCU_TEXT)
    metrics = results.read_ncu(tmp_path / "ncu.txt")
    assert metrics[("Elapsed Cycles", "cycle")] == 2_000_000
    assert metrics[("Block Size", "")] == 256
    assert metrics[("Memory Throughput", "%")] == 50  # the first value of a metric printed twice
    rows = dict((row[0], row[1]) for row in figures.profile_rows([metrics]))
    assert rows["blocks per SM"] == 1  # the tightest of the block limits
    assert rows["duration"] == "1.25 ms"
    assert rows["shared-memory pipe busy"] == "–"  # a profile without the L1 breakdown


def test_ncu_command_filters_on_the_prepare_kernels_name():
    """ncu profiles the kernel whose name matches -k: renaming the prim_func must not leave it profiling nothing."""
    kernel_filter = re.search(r"-k regex:(\S+)", profile_s05.NCU_COMMAND).group(1)
    assert re.search(kernel_filter, str(build_prepare_program(1, 128, 1, 64, 64).attrs["global_symbol"]))
    assert profile_s05.NCU_COMMAND.endswith("python -m benchmarks.profile_s05")


def test_the_page_and_the_benchmark_name_the_same_kernel_module_for_every_stage():
    """The page reads a stage's committed kernel from kdacourse.results.kernel_module, the benchmark
    digests the programs of STAGES' program_modules (or kernel_module): the digests compared must be of
    one module."""
    assert {stage.name: stage.program_modules or (stage.kernel_module,) for stage in STAGES.values()} == {
        stage.name: (results.kernel_module(stage.name),) for stage in STAGES.values()}


def test_the_profile_table_has_a_column_per_committed_ncu_output():
    assert all((results.RESULTS / name).exists() for _, name in figures.PROFILES)
