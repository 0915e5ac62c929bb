"""kdacourse.results, the site's one reader of committed results, and the tables the pages make from
what it reads: small result files written here, values worked out by hand; then the committed files
themselves, which every page reads (the archived studies' among them)."""

import csv

import pytest

from kdacourse import results
from kdacourse.pages import s05_fast_kda, s06_backward


def _write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def test_spread_is_the_median_with_the_lowest_and_highest():
    spread = results.Spread.of([3.0, None, 1.0, 2.0])
    assert (spread.median, spread.low, spread.high, spread.count) == (2.0, 1.0, 3.0, 3)
    assert spread.text() == "2.000 (1.000 to 3.000)" and results.Spread.of([0.5]).text("{:.1f}") == "0.5"
    assert results.Spread.of([None]) is None


def test_a_ratio_is_taken_round_by_round_then_summarized():
    """Ours 9, 1, 4, 2 ms in rounds 1-4, FLA 2, 4, 6 ms in rounds 2-4 (none in round 1): the ratios of
    rounds 2-4 are 2, 1, 3, median 2; the ratio of the medians would be 4 / 3."""
    rows = [dict(round=r, B=1, N=64, H=2, D=32, impl=impl, what="call", time_ms=ms)
            for impl, times in (("fla", ("", "2", "4", "6")), ("ours", ("9", "1", "4", "2"))) for r, ms in
            enumerate(times, 1)]
    measured = results.times(rows)[(1, 64, 2, 32)]
    assert measured[("ours", "call")] == {1: 9.0, 2: 1.0, 3: 4.0, 4: 2.0} and 1 not in measured[("fla", "call")]
    spread = results.paired(measured, ("fla", "call"), ("ours", "call"), results.ratio)
    assert (spread.median, spread.low, spread.high, spread.count) == (2.0, 1.0, 3.0, 3)
    assert results.paired(measured, ("fla", "call"), ("ours", "kernels"), results.ratio) is None
    assert results.summarize(rows)[(1, 64, 2, 32)][("ours", "call")].median == 3.0


def test_a_missing_or_empty_run_reads_as_none(tmp_path):
    assert results.committed_run("fair.csv", "fair_meta.json", tmp_path) == (None, None)
    (tmp_path / "fair.csv").write_text("round,B\n")
    (tmp_path / "fair_meta.json").write_text("{}")
    assert results.committed_run("fair.csv", "fair_meta.json", tmp_path) == (None, None)
    _write_csv(tmp_path / "fair.csv", [{"round": "1", "B": "2"}])
    assert results.committed_run("fair.csv", "fair_meta.json", tmp_path) == ([{"round": "1", "B": "2"}], {})
    assert results.shown_command("python -m benchmarks.fair --out /root/x --deadline 3") == \
        "python -m benchmarks.fair --out DIR --deadline 3"


def test_a_training_run_reads_its_vocabulary_and_summarizes_first_and_last_steps(tmp_path):
    rows = [dict(step=step, loss_ours=10 - step, loss_fla=10 - step + (0.5 if step == 3 else 0.0),
                 accuracy_ours=step / 10, accuracy_fla=0.0) for step in range(1, 5)]
    _write_csv(tmp_path / "train_kda.csv", rows)
    (tmp_path / "train_kda.log").write_text("python -m benchmarks.train_kda --steps 4 --vocab 64\n")
    read, vocab = results.training_run(tmp_path)
    assert vocab == 64 and read[0]["step"] == 1 and isinstance(read[0]["step"], int)
    summary = results.training_summary(read, window=2)
    assert summary["first_loss_ours"] == 8.5 and summary["last_loss_ours"] == 6.5  # (9 + 8) / 2, (7 + 6) / 2
    assert summary["last_accuracy_ours"] == pytest.approx(0.35)
    assert summary["max_loss_gap"] == 0.5 and summary["mean_loss_gap"] == 0.125
    (tmp_path / "train_kda.log").write_text("python -m benchmarks.train_kda --steps 4\n")
    with pytest.raises(ValueError, match="names no --vocab"):
        results.training_run(tmp_path)


def test_prepare_variants_take_each_variants_median_and_its_worst_output():
    def row(variant, rounds_ms, **errors):
        return [dict(round=r, B=1, N=16384, H=32, D=128, variant=variant, prepare_ms=str(ms), kernels_ms=str(ms + 1),
                     fla_ms="3", **{f"rel_l2_{name}": errors.get(name, "0") for name in results.S05_VARIANT_OUTPUTS},
                     error="") for r, ms in enumerate(rounds_ms, 1)]

    summary = results.prepare_variants(row("committed", (1.0, 1.2, 1.1)) + row("staged_wu", (0.9, 0.8, 0.7), a_qk="2e-3"))
    variants = summary[(1, 16384, 32, 128)]
    assert list(variants) == ["committed", "staged_wu"]
    assert variants["committed"][:4] == (1.1, 2.1, 3.0, 0.0)
    assert variants["staged_wu"][0] == 0.8 and variants["staged_wu"][3] == 2e-3


def test_recurrence_variants_take_the_median_per_shape():
    rows = [dict(variant=name, B=1, N=64, H=2, D=32, recurrence_ms=ms)
            for name, ms in (("committed", "2"), ("committed", "4"), ("committed", "3"), ("paired", "1"))]
    assert results.recurrence_variants(rows) == {"committed": {(1, 64, 2, 32): 3.0}, "paired": {(1, 64, 2, 32): 1.0}}


def _accuracy_rows(ratios_by_tensor, shape=s06_backward.GRADIENT_ACCURACY_SHAPE):
    return [{"shape": shape, "mode": "kernels", "layout": "gentle", "seed": seed, "tensor": name,
             "ours_rel_l2": "0", "fla_rel_l2": "0", "ratio": str(ratio)}
            for name, ratios in ratios_by_tensor.items() for seed, ratio in enumerate(ratios)]


def test_gradient_accuracy_is_the_geometric_mean_over_seeds_with_the_worst_beside_it():
    groups = results.gradient_accuracy(_accuracy_rows({"q": [1.0, 1.44], "k": [1.21, 1.0]}))
    mean, worst, seeds = groups[(s06_backward.GRADIENT_ACCURACY_SHAPE, "kernels", "gentle", "q")]
    assert (mean, worst, seeds) == (pytest.approx(1.2), 1.44, 2)
    assert groups[(s06_backward.GRADIENT_ACCURACY_SHAPE, "kernels", "gentle", "k")][0] == pytest.approx(1.1)


def test_the_gradient_accuracy_page_shows_the_newest_run_then_every_run_and_marks_a_mean_past_the_goal(
        tmp_path, monkeypatch):
    runs = {}
    for label, ratio in (("before", 1.3), ("after", 1.05)):
        folder = tmp_path / label
        folder.mkdir()
        _write_csv(folder / "gradient_accuracy.csv",
                   _accuracy_rows({name: [ratio, ratio] for name in s06_backward.GRADIENT_ACCURACY_TENSORS})
                   + _accuracy_rows({name: [9.0] for name in s06_backward.GRADIENT_ACCURACY_TENSORS},
                                    shape="1,2,3,4"))  # another shape: left out
        runs[label] = str(folder)
    monkeypatch.setattr(s06_backward, "GRADIENT_ACCURACY_RUNS", runs)
    s06_backward.write_gradient_accuracy_table(tmp_path / "table.md")
    text = (tmp_path / "table.md").read_text()
    newest, history = text.split("run by run")
    assert "| tensor | kernels, gentle |" in newest and "| q | 1.05 (1.05) |" in newest  # the last run alone
    assert "| tensor | kernels: before | kernels: after |" in history
    assert "| q | 1.30 (1.30) **over** | 1.05 (1.05) |" in history
    assert "9.00" not in text


def test_the_intra_sections_table_is_each_sections_median_less_the_kernels_read_from_the_log():
    rounds = [{"the kernel": 4.0, "loads": 4.5, "score gradients": 6.0, "every GEMM waited for": 4.25},
              {"the kernel": 5.0, "loads": 5.0, "score gradients": 6.5, "every GEMM waited for": 4.75},
              {"the kernel": 4.5, "loads": 4.75, "score gradients": 7.0, "every GEMM waited for": 4.5}]
    log = "compiled the kernel in 55 s\nevery GEMM waited for: outputs bit-equal\n" + "".join(
        f"round {n + 1}: " + ", ".join(f"{label} {ms:.4f} ms" for label, ms in r.items()) + "\n"
        for n, r in enumerate(rounds))
    times = results.round_times(log)
    assert list(times) == ["the kernel", "loads", "score gradients", "every GEMM waited for"]
    table = s06_backward.intra_sections_table(times)
    assert table.splitlines()[2:] == ["| (the kernel) | 4.5000 |  |  |",
                     "| (the kernel, every GEMM waited for) | 4.5000 | +0.0000 (the shared waits' saving) |  |",
                     "| loads | 4.7500 | 0.2500 | 6% |", "| score gradients | 6.5000 | 2.0000 | 44% |"]


def test_the_variants_the_stage_5_page_describes_are_those_its_results_measured():
    """Every variant a committed run measured has its description on the page, the adopted one too."""
    measured = set()
    for name in ("s05_variants.csv", "s05_variants_paired.csv", "s05_variants_accuracy.csv"):
        measured |= {variant for per_shape in results.prepare_variants(results.read_rows(results.RESULTS / name))
                     .values() for variant in per_shape}
    assert measured <= set(s05_fast_kda.PREPARE_VARIANTS) and s05_fast_kda.ADOPTED_VARIANT in s05_fast_kda.PREPARE_VARIANTS
    recurrence = results.recurrence_variants(results.read_rows(results.RESULTS / "s05_recurrence_variants.csv"))
    assert {name.partition("_dv")[0] for name in recurrence} <= set(s05_fast_kda.RECURRENCE_VARIANTS)


def test_every_gpu_test_log_a_page_shows_prints_errors():
    assert results.gpu_test_errors("tests/gpu_results/s01_linear_attention.log")
    with pytest.raises(ValueError, match="has no line"):
        results.gpu_test_errors("tests/gpu_results/README.md")


def test_the_kernel_digest_changes_with_the_program_only(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(results, "kernel_module", lambda stage: f"{stage}_probe_kernel")

    def write(program_line, elsewhere):
        (tmp_path / "s99_probe_kernel.py").write_text(
            f"def build_program(n):\n    # a comment\n    {program_line}\n\n\ndef forward(x):\n    {elsewhere}\n")

    write("return n + 1", "return x")
    before = results.current_kernel_digest("s99")
    write("return n + 1", "return 2 * x")
    assert results.current_kernel_digest("s99") == before
    write("return n + 2", "return 2 * x")
    assert results.current_kernel_digest("s99") != before


# ------------------------------------------------------------------ the call as Kimi Linear makes it

def _kimi_call(monkeypatch):
    """benchmarks.kimi_call, the module that writes the files read here; it sets FLA_FLASH_KDA when
    imported, which the test's environment gets back as it was."""
    import importlib
    import os

    monkeypatch.setenv("FLA_FLASH_KDA", os.environ.get("FLA_FLASH_KDA", "0"))
    return importlib.import_module("benchmarks.kimi_call")


def _kimi_call_run(folder, kimi_call, accuracy=True):
    """A run of two rounds of two cases written as the benchmark writes it: FLA 2 and 4 ms, the course
    1 and 4 ms (round by round 2x and 1x, median 1.5x; the medians' ratio would be 1.2x), FlashKDA absent."""
    rows = []
    for case, lengths in (("T8192_H64", (8192,)), ("packed6_H96", (1300, 547, 2048, 963, 271, 3063))):
        for round_number, (fla_ms, course_ms) in enumerate(((2.0, 1.0), (4.0, 4.0)), 1):
            for impl, what, ms in (("fla", "call", fla_ms), ("course", "call", course_ms), ("flashkda", "call", None),
                                   ("course", "kernels", course_ms / 2)):
                rows.append(dict(case=case, round=round_number, impl=impl, what=what, method="events", tokens=sum(lengths),
                                 sequences=len(lengths), H=kimi_call.CASES[case][1],
                                 time_ms="" if ms is None else f"{ms:.4f}",
                                 error="flashkda not importable: No module named 'flash_kda'" if ms is None else ""))
    with open(folder / kimi_call.CSV_NAME, "w", newline="") as f:
        writer = csv.DictWriter(f, kimi_call.FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    (folder / kimi_call.META_NAME).write_text(
        '{"device": "NVIDIA H200", "date": "2027-01-01", "command": "python -m benchmarks.kimi_call --out /x/y"}')
    if accuracy:
        _write_csv(folder / kimi_call.ACCURACY_NAME, [dict(impl="fla", o_rel_l2="4.010e-03", state_rel_l2="2.000e-03"),
                                                      dict(impl="course", o_rel_l2="3.390e-03", state_rel_l2="1.500e-03")])


def test_a_kimi_call_run_reads_its_cases_ratios_round_by_round_and_why_a_peer_is_missing(tmp_path, monkeypatch):
    kimi_call = _kimi_call(monkeypatch)
    assert results.kimi_call_run(tmp_path) is None
    _kimi_call_run(tmp_path, kimi_call)
    run = results.kimi_call_run(tmp_path)
    assert list(run.cases) == ["T8192_H64", "packed6_H96"]
    case = run.cases["packed6_H96"]
    assert (case.tokens, case.sequences, case.H) == (8192, 6, 96)
    assert case.times[("fla", "call")].median == 3.0 and case.times[("course", "kernels")].median == 1.25
    spread = case.ratios["FLA call / course call"]
    assert (spread.median, spread.low, spread.high) == (1.5, 1.0, 2.0)
    assert case.ratios["FlashKDA call / course call"] is None and ("flashkda", "call") not in case.times
    assert case.missing == {("flashkda", "call"): "flashkda not importable: No module named 'flash_kda'"}
    assert run.accuracy == {"fla": (4.01e-3, 2e-3), "course": (3.39e-3, 1.5e-3)}
    (tmp_path / kimi_call.ACCURACY_NAME).unlink()
    assert results.kimi_call_run(tmp_path).accuracy == {}


def test_a_folder_of_the_gpu_check_s_kimi_call_parts_reads_as_one_run(tmp_path, monkeypatch):
    """benchmarks/results/kimi_call/ holds a folder per GPU-check part: their cases in the benchmark's
    order whatever the folders' names, the accuracy of the part that checked it, each part's command."""
    kimi_call = _kimi_call(monkeypatch)
    assert results.KIMI_CALL_CASE_ORDER == tuple(kimi_call.CASES)  # the site's copy of the benchmark's order
    for name, accuracy in (("a_packed", False), ("b_one_sequence", True)):
        (tmp_path / name).mkdir()
        _kimi_call_run(tmp_path / name, kimi_call, accuracy)
    with open(tmp_path / "a_packed" / kimi_call.CSV_NAME) as f:  # the first part keeps its packed case only
        kept = [line for line in f if not line.startswith("T8192_H64,")]
    (tmp_path / "a_packed" / kimi_call.CSV_NAME).write_text("".join(kept).replace("packed6_H96", "8x1024_H96"))
    (tmp_path / "a_packed" / kimi_call.META_NAME).write_text(
        '{"device": "NVIDIA H100", "date": "2027-01-02", "command": "python -m benchmarks.kimi_call --out /z '
        '--cases 8x1024_H96", "commit": "abc1234"}')
    run = results.kimi_call_run(tmp_path)
    assert list(run.cases) == ["T8192_H64", "packed6_H96", "8x1024_H96"]
    assert run.accuracy == {"fla": (4.01e-3, 2e-3), "course": (3.39e-3, 1.5e-3)}
    assert results.kimi_call_provenance(run) == (
        "`python -m benchmarks.kimi_call --out DIR` on NVIDIA H200 (2027-01-01); "
        "`python -m benchmarks.kimi_call --out DIR --cases 8x1024_H96` on NVIDIA H100 (2027-01-02, commit abc1234)")
    assert results.kimi_call_run(tmp_path / "none") is None


def test_the_kimi_call_table_says_not_yet_run_or_shows_the_run(tmp_path, monkeypatch):
    kimi_call = _kimi_call(monkeypatch)
    out = tmp_path / "table.md"
    s05_fast_kda.write_kimi_call_table(out, folder=tmp_path)
    assert out.read_text().startswith("Not yet run: `python -m benchmarks.kimi_call --out DIR`") and "|" not in out.read_text()
    _kimi_call_run(tmp_path, kimi_call)
    s05_fast_kda.write_kimi_call_table(out, folder=tmp_path)
    text = out.read_text()
    assert "`python -m benchmarks.kimi_call --out DIR` on NVIDIA H200 (2027-01-01);" in text
    assert "| T 8192, H 64 | 3.000 (2.000 to 4.000) | – | 2.500 (1.000 to 4.000) | – | – | – | 1.250 (0.500 to 2.000) |" in text
    assert "| 8192 tokens in 6, H 96 | 1.50 (1.00 to 2.00) | – | – | – |" in text
    assert "Not measured: FlashKDA call: flashkda not importable" in text
    assert "| course | 3.39e-03 | 1.50e-03 |" in text


# ------------------------------------------------------------------ training as Kimi Linear trains

def _kimi_train(monkeypatch):
    """benchmarks.kimi_train, the module that writes the files read here (FLA_FLASH_KDA as for kimi_call)."""
    import importlib
    import os

    monkeypatch.setenv("FLA_FLASH_KDA", os.environ.get("FLA_FLASH_KDA", "0"))
    return importlib.import_module("benchmarks.kimi_train")


def _kimi_train_run(folder, kimi_train, times, date, accuracy=None, started=None):
    """A run as the benchmark writes it: times {(case, gate): [(fla ms, course ms) a round]}, a time of
    None written as the benchmark writes a peer that failed; accuracy {gate: course's error over FLA's,
    every quantity}; started: the meta's moment (runs before it was recorded have none)."""
    folder.mkdir(parents=True, exist_ok=True)
    rows = [dict(case=case, gate=gate, round=number, impl=impl, what="fwd_bwd_call", method="events",
                 tokens=kimi_train.CASES[case][0], H=kimi_train.CASES[case][1],
                 time_ms="" if ms is None else f"{ms:.4f}", error="RuntimeError: out of memory" if ms is None else "")
            for (case, gate), rounds in times.items() for number, pair in enumerate(rounds, 1)
            for impl, ms in zip(kimi_train.PEERS, pair)]
    if rows:
        _write_csv(folder / kimi_train.CSV_NAME, rows)
    moment = f', "started": "{started}"' if started else ""
    (folder / kimi_train.META_NAME).write_text(
        f'{{"device": "NVIDIA H200", "date": "{date}"{moment}, '
        f'"command": "python -m benchmarks.kimi_train --out /x/{folder.name}"}}')
    if accuracy:
        quantities = ("o", *kimi_train.GRADIENTS)
        _write_csv(folder / kimi_train.ACCURACY_NAME,
                   [dict(gate=gate, impl=impl, **{name: value for name in quantities})
                    for gate, ratio in accuracy.items()
                    for impl, value in (("fla", "4.000e-03"), ("course", f"{4e-3 * ratio:.3e}"),
                                        ("course/fla", f"{ratio:.3f}"))])


def test_kimi_train_runs_read_as_one_the_newest_giving_each_case_and_each_gates_accuracy(tmp_path, monkeypatch):
    """An older run timed T 4096 (FLA 3 and 5 ms, the course 2 and 2: 1.5x and 2.5x round by round,
    median 2.0x) and T 16384 with both gates and measured both gates' accuracy; a newer one timed T 4096
    softplus again (FLA 4, course 1: 4x) and the bounded gate's accuracy. The newer wins where both
    measured; the rest stays the older's. Read in the pages' order: the layer's gate first, then by T."""
    kimi_train = _kimi_train(monkeypatch)
    assert results.KIMI_TRAIN_CASE_ORDER == tuple(kimi_train.CASES) and set(results.KIMI_TRAIN_GATES) == set(
        kimi_train.GATES)  # the site's copies of the benchmark's names
    assert (results.KIMI_TRAIN_CSV, results.KIMI_TRAIN_META, results.KIMI_TRAIN_ACCURACY) == (
        kimi_train.CSV_NAME, kimi_train.META_NAME, kimi_train.ACCURACY_NAME)
    assert results.KIMI_TRAIN_ACCURACY_SHAPE == kimi_train.ACCURACY_CASE  # the shape the page names
    assert results.kimi_train_run(tmp_path) is None
    _kimi_train_run(tmp_path / "z_old", kimi_train, {
        ("T16384_H32", "bounded"): [(9.0, None)], ("T4096_H32", "softplus"): [(3.0, 2.0), (5.0, 2.0)],
        ("T16384_H32", "softplus"): [(11.0, 8.0)]}, "2026-12-07", accuracy={"softplus": 0.8, "bounded": 1.2})
    _kimi_train_run(tmp_path / "a_new", kimi_train, {("T4096_H32", "softplus"): [(4.0, 1.0)]}, "2026-12-09",
                    accuracy={"bounded": 0.9})
    run = results.kimi_train_run(tmp_path)
    assert list(run.cases) == [("T4096_H32", "softplus"), ("T16384_H32", "softplus"), ("T16384_H32", "bounded")]
    newest = run.cases[("T4096_H32", "softplus")]
    assert (newest.tokens, newest.H, newest.speedup.median, newest.times["fla"].median) == (4096, 32, 4.0, 4.0)
    older = run.cases[("T16384_H32", "softplus")]
    assert older.speedup.median == 11.0 / 8.0 and older.times["course"].count == 1
    failed = run.cases[("T16384_H32", "bounded")]
    assert failed.speedup is None and failed.missing == {"course": "RuntimeError: out of memory"}
    assert run.accuracy["softplus"]["course/fla"]["dt_bias"] == 0.8 and run.accuracy["bounded"]["course/fla"]["o"] == 0.9
    assert results.kimi_train_provenance(run) == (
        "`python -m benchmarks.kimi_train --out DIR` on NVIDIA H200 (2026-12-07); "
        "`python -m benchmarks.kimi_train --out DIR` on NVIDIA H200 (2026-12-09)")
    single = results.kimi_train_run(tmp_path / "z_old")  # a run's own folder reads as that run
    assert single.cases[("T4096_H32", "softplus")].speedup.median == 2.0
    # two runs of one day: the later start wins, whatever the folders' names (and over a run without one)
    _kimi_train_run(tmp_path / "b_same_day_later", kimi_train, {("T4096_H32", "softplus"): [(6.0, 1.0)]},
                    "2026-12-09", started="2026-12-09T15:00:00")
    _kimi_train_run(tmp_path / "c_same_day_earlier", kimi_train, {("T4096_H32", "softplus"): [(5.0, 1.0)]},
                    "2026-12-09", started="2026-12-09T09:00:00")
    assert results.kimi_train_run(tmp_path).cases[("T4096_H32", "softplus")].speedup.median == 6.0
    # a run none of whose numbers is left (a_new's case and accuracy, both given again later) is not named
    _kimi_train_run(tmp_path / "d_latest", kimi_train, {}, "2026-12-10", accuracy={"bounded": 0.7})
    run = results.kimi_train_run(tmp_path)
    assert [meta["command"].rsplit("/", 1)[1] for meta in run.metas] == ["z_old", "b_same_day_later", "d_latest"]
    assert run.accuracy["bounded"]["course/fla"]["o"] == 0.7


def test_the_kimi_train_table_says_not_yet_run_or_shows_the_runs(tmp_path, monkeypatch):
    kimi_train = _kimi_train(monkeypatch)
    out = tmp_path / "table.md"
    s06_backward.write_kimi_train_table(out, folder=tmp_path)
    assert out.read_text().startswith("Not yet run: `python -m benchmarks.kimi_train --out DIR`")
    _kimi_train_run(tmp_path / "run", kimi_train, {("T4096_H32", "softplus"): [(3.0, 2.0), (5.0, 2.0)],
                                                   ("T65536_H32", "bounded"): [(None, 30.0)]}, "2026-12-07",
                    accuracy={"bounded": 1.25})
    s06_backward.write_kimi_train_table(out, folder=tmp_path)
    text = out.read_text()
    assert "| softplus (the layer's default) | T 4096, H 32 | 4.000 (3.000 to 5.000) | 2.000 (2.000 to 2.000) | " \
           "2.00 (1.50 to 2.50) |" in text
    assert "| bounded (lower_bound -5) | T 65536, H 32 | – | 30.000 | – |" in text
    assert "Not measured: fla at T65536_H32 (bounded): RuntimeError: out of memory." in text
    assert "| bounded (lower_bound -5) | 1.25 | 1.25 | 1.25 | 1.25 | 1.25 | 1.25 | 1.25 | 1.25 |" in text


def test_the_goals_figure_takes_each_measured_ratio_and_says_where_nothing_is(tmp_path, monkeypatch):
    """The call's two ratios per case (FlashKDA absent in the fixture: no bar on its panel) and the
    training's per (case, gate); the figure names each goal and marks an empty panel."""
    from kdacourse.pages import benchmarks

    call_folder, train_folder = tmp_path / "call", tmp_path / "train"
    call_folder.mkdir()
    _kimi_call_run(call_folder, _kimi_call(monkeypatch))
    _kimi_train_run(train_folder / "run", _kimi_train(monkeypatch), {("T16384_H32", "bounded"): [(9.0, 6.0)]},
                    "2026-12-07")
    bars = benchmarks.kimi_goal_bars(results.kimi_call_run(call_folder), results.kimi_train_run(train_folder))
    assert bars["the call against FlashKDA"] == []
    assert [(label, spread.median) for label, spread in bars["the call against FLA"]] == [
        ("T 8192\nH 64", 1.5), ("8192 in 6\nH 96", 1.5)]
    assert [(label, spread.median) for label, spread in bars["training against FLA"]] == [("bounded\nT 16384", 1.5)]
    assert benchmarks.kimi_goal_bars(None, None) == {goal: [] for goal in benchmarks.KIMI_GOALS}
    out = tmp_path / "goals.svg"
    benchmarks.write_kimi_goals_plot(out, call_folder, train_folder)
    text = out.read_text()
    assert "goal: 1.1x" in text and "goal: 2x" in text and "not measured yet" in text


def test_the_parallelism_table_counts_each_kernels_programs():
    """T = 8192 at H = 64: 64 sequence-heads, so the forward's chunk is 32: 256 chunks (16384 prepare
    programs) against FlashKDA's 512 of 16 (32768 programs of its K1); 64 value columns give 128
    recurrence programs, nine SMs in ten of 132 or more; FlashKDA's K2 one a head (64). At T = 16384,
    H = 32 the chunk stays 64 (256 chunks) and 64 columns would give 64 programs, too few: 32 columns,
    128 programs. The packed sequences take ceil(n / 32) chunks each: 41 + 18 + 64 + 31 + 9 + 96 = 259."""
    assert s05_fast_kda.kernel_programs((8192,), 64) == {
        "course chunk": 32, "course value columns": 64, "course prepare": 16384, "course recurrence": 128,
        "FlashKDA K1": 32768, "FlashKDA K2": 64}
    few_heads = s05_fast_kda.kernel_programs((16384,), 32)
    assert (few_heads["course chunk"], few_heads["course prepare"], few_heads["course recurrence"]) == (64, 8192, 128)
    packed = s05_fast_kda.kernel_programs((1300, 547, 2048, 963, 271, 3063), 96)
    assert packed["course prepare"] == 259 * 96 and packed["course recurrence"] == 6 * 96 * 2


def test_the_fla_backend_page_reads_the_same_run(tmp_path, monkeypatch):
    from kdacourse.pages import fla_backend

    monkeypatch.setattr(fla_backend, "SPEED_RUNS", (tmp_path / "first", tmp_path / "second"))
    out = tmp_path / "speed.md"
    fla_backend.write_speed(out)
    assert out.read_text().startswith("Not measured yet") and "|" not in out.read_text()
    (tmp_path / "second").mkdir()
    _kimi_call_run(tmp_path / "second", _kimi_call(monkeypatch), accuracy=False)
    fla_backend.write_speed(out)
    text = out.read_text()
    assert "| 8192 in 6, 96 | 3.00 ms | – | 2.50 ms | 1.50 (1.00 to 2.00)x | – |" in text
    assert text.count("(benchmarks/results/") == 1 and "(benchmarks/results/second/)" in text  # the run present


def test_the_fla_backend_page_counts_fla_s_grid(tmp_path, monkeypatch):
    """The grid's counts by outcome, from the cases themselves, and a row for every case that did not pass
    with its reason; none before a run is committed."""
    import json

    from kdacourse.pages import fla_backend

    monkeypatch.setattr(fla_backend, "GRID", tmp_path / "fla_test_grid.json")
    out = tmp_path / "grid.md"
    fla_backend.write_grid(out)
    assert out.read_text().startswith("FLA's test grid has not been run") and "|" not in out.read_text()
    cases = [dict(case="test_chunk[a]", outcome="passed", reason=""),
             dict(case="test_chunk[b]", outcome="refused", reason="ValueError: g: log gates must be <= 0"),
             dict(case="test_decode[c]", outcome="skipped", reason="Skipped: requires CUDA")]
    (tmp_path / "fla_test_grid.json").write_text(json.dumps(dict(summary="against course: stale words", cases=cases)))
    fla_backend.write_grid(out)
    text = out.read_text()
    assert text.startswith("Against the course's kernels: 1 passed, 0 failed, 1 refused, 1 skipped of 3 cases."), text
    assert "| test_chunk[b] | refused | ValueError: g: log gates must be <= 0 |" in text and "test_chunk[a]" not in text


def test_the_launch_bound_table_shows_a_variant_not_built_for_a_case_as_a_dash(tmp_path, monkeypatch):
    """A variant built for one sequence only has no time at a packed case: "–" there, its time and
    FlashKDA's over it elsewhere; every variant's repeats in the second table, by its page name."""
    times = {"T8192_H96": {"dv64": (1.5, 1.4, 1.6), "dv32_pp3_no_ws": (1.2, 1.2, 1.3), "flashkda": (1.44, 1.4, 1.5)},
             "8x1024_H96": {"dv64": (1.6, 1.6, 1.6), "flashkda": (1.28, 1.2, 1.3)}}
    repeats = {("T8192_H96", "dv32_pp3_no_ws"): (0, 30, 3.4e-3)}
    monkeypatch.setattr(results, "programs_per_sm_run", lambda: (times, repeats, {"command": "python -m x --out /y"}))
    out = tmp_path / "table.md"
    s05_fast_kda.write_programs_per_sm_table(out)
    text = out.read_text()
    assert "| T8192_H96 | 1.500 (0.96x) | 1.200 (1.20x) | 1.440 |" in text
    assert "| 8x1024_H96 | 1.600 (0.80x) | – | 1.280 |" in text
    assert "| T8192_H96 | 32 columns, 3 an SM, no TMA, no loading warp group | 0 of 30 | 3.40e-03 |" in text
    assert text.splitlines()[1].startswith("`python -m x --out DIR` on the GPU (no date), benchmarks/results/")


def test_the_launch_bound_study_reads_its_medians_and_each_variants_repeats(tmp_path):
    """Three rounds of two variants, a log with a repeat line each and one variant without an error line:
    the medians by hand, the repeats as the log says them."""
    rows = [dict(case="c", round=r, variant=v, block_dv=64, programs_per_sm=p, time_ms=ms)
            for v, p, times in (("dv64", 1, ("3", "1", "2")), ("dv64_pp2", 2, ("5", "4", "9")))
            for r, ms in enumerate(times, 1)]
    _write_csv(tmp_path / "programs_per_sm.csv", rows)
    (tmp_path / "programs_per_sm.log").write_text(
        '{"device": "x"}\nc dv64: against float64: o 3.3989e-03, state 2.6742e-03\n'
        "c dv64: 0 of 30 calls differ from its first\n"
        "c dv64_pp2: 11 of 30 calls differ from its first (calls [0, 2]); 8 elements differ\n")
    times, repeats, meta = results.programs_per_sm_run(tmp_path)
    assert meta == {"device": "x"}
    assert times == {"c": {"dv64": (2.0, 1.0, 3.0), "dv64_pp2": (5.0, 4.0, 9.0)}}
    assert repeats == {("c", "dv64"): (0, 30, 3.3989e-3), ("c", "dv64_pp2"): (11, 30, None)}
