"""benchmarks/backward.py on a CPU: its arguments, the ratios it reports from its rows, its CSV, the
kernel digest it records, and a clear refusal without CUDA."""

import dataclasses

import pytest

from benchmarks import backward, bench, fair
from stages.common import program_digest as digests
from stages.common.program_digest import program_digest


def test_arguments_default_to_the_benchmark_shapes_and_three_rounds(tmp_path):
    args = backward.parse_args(["--out", str(tmp_path)])
    assert args.shapes == bench.SHAPES and args.rounds == 3 and args.block_dv is None and args.deadline is None
    assert not args.no_fla
    quick = backward.parse_args(["--out", "x", "--quick", "--block-dv", "16", "--no-fla"])
    assert quick.shapes == backward.QUICK_SHAPES and quick.rounds == backward.QUICK_ROUNDS and quick.block_dv == 16
    assert quick.no_fla
    chosen = backward.parse_args(["--out", "x", "--shapes", "2,1024,4,64", "--rounds", "5"])
    assert chosen.shapes == [(2, 1024, 4, 64)] and chosen.rounds == 5


@pytest.mark.parametrize("argv", [[], ["--out", "x", "--shapes", "1,4096"], ["--out", "x", "--rounds", "0"]])
def test_bad_arguments_are_refused(argv):
    with pytest.raises(SystemExit):
        backward.parse_args(argv)


def test_without_cuda_it_says_so_and_writes_nothing(tmp_path, capsys, monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert backward.main(["--out", str(tmp_path / "run")]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def _row(round_number, impl, what, ms, shape=(1, 4096, 32, 128), **extra):
    B, N, H, D = shape
    return dict(round=round_number, B=B, N=N, H=H, D=D, dtype="bfloat16", impl=impl, what=what, method="graph",
                time_ms=f"{ms:.4f}" if ms is not None else "", **extra)


def test_ratios_are_taken_round_by_round_from_the_csv(tmp_path):
    rows = []
    for r, (ours_kernels, fla_call, ours_call, fla_backward, ours_backward) in enumerate(
            [(2.0, 6.0, 3.0, 3.0, 1.0), (2.0, 6.0, 2.0, 3.0, 1.5), (3.0, 7.5, 4.0, 3.0, 2.0)], 1):
        rows += [_row(r, "fla", "fwd_bwd_kernels", None, error=backward.FLA_GRAPH_NOT_TRIED),
                 _row(r, "ours", "fwd_bwd_kernels", ours_kernels),
                 _row(r, "fla", "fwd_bwd_call", fla_call), _row(r, "ours", "fwd_bwd_call", ours_call),
                 _row(r, "fla", "backward_call", fla_backward), _row(r, "ours", "backward_kernels", ours_backward)]
    rows.append(_row(3, "ours", "intra", None, error="RuntimeError: boom"))  # a failed row: no time
    writer, f = backward.open_writer(tmp_path / backward.CSV_NAME)
    for row in rows:
        writer.writerow(row)
    f.close()
    named = backward.comparisons(fair.read_rows(tmp_path / backward.CSV_NAME))[(1, 4096, 32, 128)]
    kernels = named["fwd+bwd FLA call / ours kernels"]  # 6 / 2, 6 / 2, 7.5 / 3
    assert (kernels.median, kernels.low, kernels.high, kernels.count) == (3.0, 2.5, 3.0, 3)
    calls = named["fwd+bwd call FLA / ours"]  # 6 / 3, 6 / 2, 7.5 / 4
    assert (calls.median, calls.low, calls.high) == (2.0, 1.875, 3.0)
    assert named["backward FLA call / ours kernels"].median == 2.0
    assert backward.summary(rows)[0] == (
        "B=1 N=4096 H=32 D=128: ours fwd_bwd_kernels 2.000 (2.000 to 3.000) ms, fwd_bwd_call 3.000 (2.000 to 4.000) ms, "
        "backward_kernels 1.500 (1.000 to 2.000) ms; fwd+bwd FLA call / ours kernels 3.00 (2.50 to 3.00); "
        "fwd+bwd call FLA / ours 2.00 (1.88 to 3.00); backward FLA call / ours kernels 2.00 (1.50 to 3.00)")
    ours_alone = [row for row in rows if row["impl"] == "ours"]
    assert backward.summary(ours_alone) == [  # --no-fla: ours' times, no ratio
        "B=1 N=4096 H=32 D=128: ours fwd_bwd_kernels 2.000 (2.000 to 3.000) ms, fwd_bwd_call 3.000 (2.000 to 4.000) ms, "
        "backward_kernels 1.500 (1.000 to 2.000) ms"]


def test_every_measurement_is_timed_once_per_round_in_alternating_order():
    assert len(set(backward.MEASUREMENTS)) == len(backward.MEASUREMENTS)
    assert {what for impl, what in backward.MEASUREMENTS if impl == "ours"} >= set(backward.BACKWARD_KERNELS)
    from stages.kda.backward import BUILDERS

    assert tuple(BUILDERS) == backward.BACKWARD_KERNELS  # every kernel the backward launches is timed alone


def test_kernel_digest_covers_every_builder_a_training_step_runs():
    """The digest of stage 6's kernel module, which names the forward's two builders and the backward's
    four: the one the site compares a result's digest with, and not stage 5's (the forward's alone)."""
    from kdacourse import results

    lines = digests.program_lines(digests._module_source(backward.KERNEL_MODULE))
    for name in ("prepare", "recurrence", "states", "state_gradient", "state_products", "intra"):
        assert any(line.startswith(f"def build_{name}_program(") for line in lines), name
    assert backward.kernel_digest() == digests._digest(lines) == results.current_kernel_digest("s06_backward")
    assert bench.STAGES["s05"].kernel_digest() != backward.kernel_digest()


def test_both_passes_take_64_value_columns_where_that_still_fills_the_sms():
    """H200 (132 SMs): B=8 H=16 gives 256 programs of 64 columns, B=1 H=32 only 64 (32 columns then);
    --block-dv sets the backward's alone, the rest of its config is the forward's."""
    def block_dvs(*arguments, **options):
        forward_config, backward_config = backward.configs(*arguments, **options)
        return forward_config.block_dv, backward_config.block_dv

    assert block_dvs(8, 16, 128, 132) == (64, 64)
    assert block_dvs(1, 32, 128, 132) == (32, 32)
    assert block_dvs(8, 16, 128, 132, backward_block_dv=32) == (64, 32)
    forward_config, backward_config = backward.configs(8, 16, 128, 132, backward_block_dv=32)
    assert dataclasses.replace(backward_config, block_dv=64) == forward_config


def test_compile_all_builds_each_kernel_once_as_the_wrappers_launch_it(monkeypatch):
    """The forward's prepare and recurrence, and the backward's five (its prepare the one with A_kk and T
    as outputs, which forward_and_prepared's kept call shares), with each pass's block_dv, both prepares
    that flag bad values (the default calls'), each by the call the library makes for it (functools.cache
    keys on the arguments as written); a shape whose kernel fails is reported with the kernel's name,
    and the other shapes compile."""
    from stages.kda import compiled

    calls = []

    def recording(name):
        return lambda *arguments, **options: calls.append((name, arguments, options))

    monkeypatch.setattr(compiled, "compiled_prepare", recording("prepare"))
    monkeypatch.setattr(compiled, "compiled_recurrence", recording("recurrence"))

    def backward_kernel(name, *arguments, **options):
        if name == "intra" and arguments[0] == 8:
            raise RuntimeError("No valid warp partition for T.gemm")
        calls.append((name, arguments, options))

    monkeypatch.setattr(compiled, "compiled_backward_kernel", backward_kernel)
    heard = []
    failed = backward.compile_all([(1, 4096, 32, 128), (8, 4096, 16, 128)], None, 132, heard.append)
    assert list(failed) == [(8, 4096, 16, 128)] and "intra at B=8" in failed[(8, 4096, 16, 128)]
    assert "No valid warp partition" in failed[(8, 4096, 16, 128)]
    expected = []
    for B, H, block_dv in ((1, 32, 32), (8, 16, 64)):
        shape = (B, 4096, H, 128, 128, 64)
        off, on = dict(value_flags=False), dict(value_flags=True)
        expected += [("prepare", (*shape, "bfloat16", 256, False), dict(solve_outputs=False)),
                     ("prepare", (*shape, "bfloat16", 256, True), dict(solve_outputs=False)),
                     ("recurrence", (*shape, block_dv, "bfloat16", 2, 128, 1), {}),
                     ("prepare", (*shape, "bfloat16"), off), ("prepare", (*shape, "bfloat16"), on),
                     ("states", (*shape, block_dv, "bfloat16"), off),
                     ("state_gradient", (*shape, block_dv, "bfloat16"), off),
                     ("state_products", (*shape, "bfloat16"), off)]
    expected.append(("intra", (1, 4096, 32, 128, 128, 64, "bfloat16"), dict(value_flags=False)))
    assert sorted(calls, key=str) == sorted(expected, key=str)
    assert len(heard) == 19 and heard[0] == "compiling 18 kernels in threads"


class _FakeShape:
    """Stands in for backward.Shape on a CPU: records what run() asks of it, in order."""

    events = []

    def __init__(self, B, N, H, D, block_dv, log):
        self.label, self.rel_l2_vs_fla = f"B={B}", None
        self.events.append(("setup ours", B))

    def setup_fla(self, log):
        self.events.append(("setup fla", self.label))

    def notes(self):
        return {}

    def measure(self, round_number, writer, log, order, timer):
        self.events.append((round_number, self.label, tuple(sorted({impl for impl, _ in order}))))


@pytest.mark.parametrize("no_fla", [False, True])
def test_ours_is_timed_before_fla_is_set_up_and_no_fla_leaves_fla_out(tmp_path, monkeypatch, no_fla):
    pytest.importorskip("torch")
    from stages.kda import config

    _FakeShape.events = []
    monkeypatch.setattr(backward, "Shape", _FakeShape)
    monkeypatch.setattr(backward, "compile_all", lambda *arguments: {(2, 4096, 16, 128): "RuntimeError: boom"})
    monkeypatch.setattr(config, "streaming_multiprocessors", lambda device: 132)
    monkeypatch.setattr(backward, "make_timer", lambda quick: None)  # triton's do_bench: the fake times nothing
    argv = ["--out", str(tmp_path), "--shapes", "1,4096,32,128;2,4096,16,128", "--rounds", "3"]
    args = backward.parse_args(argv + (["--no-fla"] if no_fla else []))
    notes = backward.run(args, print, 0.0)
    if no_fla:
        assert _FakeShape.events == [("setup ours", 1), (1, "B=1", ("ours",)), (2, "B=1", ("ours",)),
                                     (3, "B=1", ("ours",))]
    else:
        assert _FakeShape.events == [("setup ours", 1), (1, "B=1", ("ours",)), ("setup fla", "B=1"),
                                     (1, "B=1", ("fla",)), (2, "B=1", ("fla", "ours")), (3, "B=1", ("fla", "ours"))]
    assert notes["B=2 N=4096 H=16 D=128"] == {"error": "RuntimeError: RuntimeError: boom"}
    rows = fair.read_rows(tmp_path / backward.CSV_NAME)
    assert [(row["B"], row["what"]) for row in rows] == [("2", "setup")]


@pytest.fixture
def empty_compile_caches():
    """The fast path's compiled-kernel caches emptied before and after a test that fakes compiles."""
    from stages.kda import compiled

    caches = (compiled.compiled_prepare, compiled.compiled_recurrence, compiled.compiled_backward_kernel,
              compiled.compiled_backward_kernels)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


def test_a_run_on_the_cpu_compiles_each_kernel_once_before_it_sets_up(tmp_path, monkeypatch, empty_compile_caches):
    """run() end to end on the CPU: tilelang.compile counted and replaced by the tile interpreter, the
    torch.cuda calls by stand-ins, a GPU of 2 SMs (so both passes take 64 value columns, where the
    wrappers' rule and the benchmark's could part). Every kernel is compiled once (but the one below),
    all before "set up ours" (none in a capture, none in ours' timed call), and each kernel's first call
    (which builds its host library on a GPU) is made and logged before the first capture."""
    torch = pytest.importorskip("torch")
    tilelang = pytest.importorskip("tilelang")
    import collections

    from stages.common.interpreter import interpret
    from stages.kda import checks, config

    heard, compiles, first_calls = [], [], {}

    def compile_on_the_cpu(program, out_idx, target):
        # the forward's prepare and the backward's (with A_kk and T as outputs) share a symbol, not a signature
        name = f"{program.attrs['global_symbol']}/{len(program.params)}"
        compiles.append((name, len(heard)))
        run = interpret(program, out_idx=out_idx)

        def launch(*tensors):
            first_calls.setdefault(name, len(heard))
            return [torch.from_numpy(x) for x in run(*tensors)]
        return launch

    def on_cpu(stage, B, N, H, D, dtype):
        generator = torch.Generator().manual_seed(0)
        q, k = (torch.nn.functional.normalize(torch.randn(B, N, H, D, generator=generator), dim=-1).to(dtype)
                for _ in range(2))
        v = torch.randn(B, N, H, D, generator=generator).to(dtype)
        g = torch.log(0.9 + 0.099 * torch.rand(B, N, H, D, generator=generator))
        return [q, k, v, g, 0.1 + 0.8 * torch.rand(B, N, H, generator=generator)]

    monkeypatch.setattr(tilelang, "compile", compile_on_the_cpu)
    for name, value in {"is_available": lambda: True, "synchronize": lambda *a: None,
                        "empty_cache": lambda: None}.items():
        monkeypatch.setattr(torch.cuda, name, value)
    monkeypatch.setattr(bench, "make_inputs", on_cpu)
    monkeypatch.setattr(checks, "check_on_cuda", lambda tensors: None)
    monkeypatch.setattr(config, "streaming_multiprocessors", lambda device: 2)
    monkeypatch.setattr(backward, "make_timer", lambda quick: lambda function: [function(), 1.0][1])
    args = backward.parse_args(["--out", str(tmp_path), "--shapes", "1,64,2,64", "--rounds", "1", "--no-fla"])
    notes = backward.run(args, heard.append, 0.0)

    assert notes["B=1 N=64 H=2 D=64"]["forward_block_dv"] == notes["B=1 N=64 H=2 D=64"]["backward_block_dv"] == 64
    counted = collections.Counter(name for name, _ in compiles)  # one shape: a kernel's name is its compile
    # the prepare with A_kk and T is asked for by forward_and_prepared (the kept call) and by the backward:
    # one cache entry, so no program is compiled twice
    assert [name for name, count in counted.items() if count > 1] == [], "compiled twice for one shape"
    # the prepares: the forward's and the backward's (A_kk and T too), each also with Flags (the default calls)
    assert sorted(counted) == sorted(["kda_prepare/11", "kda_prepare/12", "kda_prepare/13", "kda_prepare/14",
                                      "kda_recurrence/9", "kda_states/7", "kda_state_gradient/10",
                                      "kda_state_products/10", "kda_intra/19"])
    set_up = heard.index("B=1 N=64 H=2 D=64: set up ours (capture graphs)")
    assert max(position for _, position in compiles) < set_up, "a kernel was compiled after the set-up began"
    first_capture = next(i for i, line in enumerate(heard) if " captured " in line)
    assert sorted(first_calls) == sorted(counted)
    assert all(set_up < position < first_capture for position in first_calls.values()), "a first call in a capture"
    logged = [line.split("first call of ")[1].split()[0] for line in heard[set_up:first_capture]
              if "first call of" in line]
    assert logged == ["forward_prepare", "recurrence", *backward.BACKWARD_KERNELS, "default_calls", "kept_call"]
    rows = fair.read_rows(tmp_path / backward.CSV_NAME)
    assert {row["what"] for row in rows if row["time_ms"] == "1.0000"} == {
        what for impl, what in backward.MEASUREMENTS if impl == "ours"}


def test_kernel_digest_covers_the_macros_a_kernel_builds_with(monkeypatch, tmp_path):
    """An edit of one of the shared macros (stages.kda.tiles) marks the results of every kernel that
    builds with it stale: the digest of the prepare's module, stage 5's and the backward benchmark's
    change; a comment does not."""
    import importlib.util
    from pathlib import Path

    from stages.kda import prepare, tiles

    source = Path(tiles.__file__).read_text()
    line = "                    T_s[p0 + r, c] = -block_row_f[r, c]\n"
    assert source.count(line) == 1
    prepare_source = Path(prepare.__file__).read_text()
    before = (program_digest(prepare_source), bench.STAGES["s05"].kernel_digest(), backward.kernel_digest())
    find_spec = importlib.util.find_spec

    def with_tiles(text):
        (tmp_path / "tiles.py").write_text(text)
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: importlib.util.spec_from_file_location(
            name, tmp_path / "tiles.py") if name == "stages.kda.tiles" else find_spec(name, *args))
        return program_digest(prepare_source), bench.STAGES["s05"].kernel_digest(), backward.kernel_digest()

    assert with_tiles(source.replace(line, line[:-1] + "  # x\n")) == before
    edited = with_tiles(source.replace(line, line.replace("= -", "= ")))
    assert all(after != digest for after, digest in zip(edited, before))


def test_the_default_checks_cost_is_our_default_call_over_our_unchecked_call(tmp_path):
    """Round by round: ours with checks="device" against ours with checks="off", and FLA's call against
    our default call; none where a run did not time the default call."""
    rows = []
    for r, (unchecked, default, fla_call) in enumerate([(2.0, 2.2, 4.0), (2.0, 2.0, 5.0), (4.0, 5.0, 6.0)], 1):
        rows += [_row(r, "ours", "fwd_bwd_call", unchecked), _row(r, "ours", "fwd_bwd_call_default", default),
                 _row(r, "fla", "fwd_bwd_call", fla_call)]
    named = backward.comparisons(rows)[(1, 4096, 32, 128)]
    cost = named["ours fwd+bwd call, default checks / checks off"]  # 1.1, 1.0, 1.25
    assert (cost.median, cost.low, cost.high) == pytest.approx((1.1, 1.0, 1.25))
    against_fla = named["fwd+bwd call FLA / ours, default checks"]  # 4 / 2.2, 5 / 2, 6 / 5
    assert (against_fla.low, against_fla.high) == pytest.approx((1.2, 2.5))
    without = backward.comparisons([row for row in rows if row["what"] != "fwd_bwd_call_default"])
    assert without[(1, 4096, 32, 128)]["ours fwd+bwd call, default checks / checks off"] is None
