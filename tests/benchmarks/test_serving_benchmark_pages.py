"""The benchmarks page's training and serving tables (kdacourse/pages/serving_benchmarks.py), made from
hand-made result files in a temporary folder: values checked by hand (a median of three rounds, a
ratio taken round by round), and the text each table shows when nothing is committed."""

import csv
import json

import pytest

from benchmarks import backward, decode, varlen
from kdacourse.pages import serving_benchmarks as page


def _write_csv(path, fields, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fields)
        writer.writeheader()
        writer.writerows(rows)


def _table_row(text, first_cell):
    """The cells of the table row of `text` that starts with `first_cell`."""
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        if line.startswith("|") and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in:\n{text}")


def _written(tmp_path, monkeypatch, write):
    monkeypatch.setattr(page, "RESULTS", tmp_path)
    out = tmp_path / "out.md"
    write(out)
    return out.read_text()


@pytest.mark.parametrize("write, what", [(page.write_backward_timings, "backward"),
                                         (page.write_varlen_timings, "variable-length prefill"),
                                         (page.write_decode_timings, "decode")])
def test_without_results_each_table_says_none_are_committed(tmp_path, monkeypatch, write, what):
    text = _written(tmp_path, monkeypatch, write)
    assert text.startswith(f"No {what} timings are committed yet") and "|" not in text


def test_a_backward_csv_without_its_meta_counts_as_absent(tmp_path, monkeypatch):
    _write_csv(tmp_path / backward.CSV_NAME, backward.FIELDS, [_backward_row(1, "ours", "fwd_bwd_call", 1.5)])
    assert _written(tmp_path, monkeypatch, page.write_backward_timings).startswith("No backward timings")


SHAPE = (1, 4096, 32, 128)


def _backward_row(round_number, impl, what, ms=None, shape=SHAPE, error=""):
    B, N, H, D = shape
    return dict(round=round_number, B=B, N=N, H=H, D=D, dtype="bfloat16", impl=impl, what=what, method="graph",
                time_ms="" if ms is None else f"{ms:.4f}", error=error)


def _backward_run(folder, kernel=None):
    rows = []
    # per round: ours fwd+bwd kernels, FLA call, ours call, FLA backward call, ours backward
    for r, (ours_kernels, fla_call, ours_call, fla_backward, ours_backward) in enumerate(
            [(1.0, 3.0, 1.5, 0.9, 0.3), (1.2, 3.0, 1.5, 0.9, 0.3), (1.6, 3.6, 1.5, 1.2, 0.3)], 1):
        rows += [_backward_row(r, "fla", "fwd_bwd_kernels", None, error=backward.FLA_GRAPH_NOT_TRIED),
                 _backward_row(r, "ours", "fwd_bwd_kernels", ours_kernels),
                 _backward_row(r, "fla", "fwd_bwd_call", fla_call), _backward_row(r, "ours", "fwd_bwd_call", ours_call),
                 _backward_row(r, "fla", "backward_call", fla_backward),
                 _backward_row(r, "ours", "fwd_bwd_call_kept", 1.2), _backward_row(r, "fla", "fwd_bwd_call_kept", 2.4),
                 _backward_row(r, "ours", "backward_kernels", ours_backward),
                 *(_backward_row(r, "ours", name, 0.01 * (i + 1) * r)
                   for i, name in enumerate(backward.BACKWARD_KERNELS))]
    rows.append(_backward_row(0, "ours", "setup", shape=(8, 4096, 16, 128), error="RuntimeError: no compile"))
    _write_csv(folder / backward.CSV_NAME, backward.FIELDS, rows)
    meta = dict(device="NVIDIA H200", date="2026-12-01", command="python -m benchmarks.backward --out /root/out/b",
                rounds=3, seconds=200, kernel=kernel or backward.kernel_digest(), complete=True,
                shapes={"B=1 N=4096 H=32 D=128": dict(
                            rel_l2_ours_vs_fla=dict(dq=0.004, dk=0.005, dv=0.006, dg=0.01, dbeta=0.002),
                            forward_block_dv=32, backward_block_dv=64),
                        "B=8 N=4096 H=16 D=128": dict(error="RuntimeError: no compile")})
    (folder / backward.META_NAME).write_text(json.dumps(meta))


def test_backward_table_gives_medians_ratios_round_by_round_and_the_gradients(tmp_path, monkeypatch):
    _backward_run(tmp_path)
    text = _written(tmp_path, monkeypatch, page.write_backward_timings)
    assert text.startswith("Run of 2026-12-01 on an NVIDIA H200 (`python -m benchmarks.backward --out DIR`, "
                           "3 rounds, 200 s), on the committed kernel.")
    # FLA call / ours kernels 3.0, 2.5, 2.25 round by round; calls 2.0, 2.0, 2.4; FLA's call / ours kept
    # 2.5, 2.5, 3.0; both keeping 2.0; backward 3.0, 3.0, 4.0
    assert _table_row(text, "1, 4096, 32, 128")[1:6] == ["2.50 (2.25 to 3.00)", "2.00 (2.00 to 2.40)",
                                                         "2.50 (2.50 to 3.00)", "2.00 (2.00 to 2.00)",
                                                         "3.00 (3.00 to 4.00)"]
    times = text.split("The times, medians")[1]
    # ours fwd+bwd kernels 1.0, 1.2, 1.6: median 1.2; FLA's call 3.0, 3.0, 3.6: median 3.0
    assert _table_row(times, "1, 4096, 32, 128") == [
        "1, 4096, 32, 128", "1.200 (1.000 to 1.600)", "1.500 (1.500 to 1.500)", "1.200 (1.200 to 1.200)",
        "0.300 (0.300 to 0.300)", "3.000 (3.000 to 3.600)", "2.400 (2.400 to 2.400)", "0.900 (0.900 to 1.200)"]
    kernels = text.split("The backward's five kernels")[1]
    assert _table_row(kernels, "1, 4096, 32, 128")[1:3] == ["0.020 (0.010 to 0.030)", "0.040 (0.020 to 0.060)"]
    gradients = text.split("Our gradients against FLA's")[1]
    assert _table_row(gradients, "1, 4096, 32, 128")[1:] == [
        "4.00e-03", "5.00e-03", "6.00e-03", "1.00e-02", "2.00e-03", "32", "64"]
    assert _table_row(gradients, "8, 4096, 16, 128")[1:] == ["–"] * 7
    assert "- ours setup at 8, 4096, 16, 128: RuntimeError: no compile" in text
    assert backward.FLA_GRAPH_NOT_TRIED in text  # why FLA has no graph


def test_backward_table_says_when_the_kernel_changed_since_the_run(tmp_path, monkeypatch):
    _backward_run(tmp_path, kernel="000000000000")
    assert "on an earlier kernel (changed since)" in _written(tmp_path, monkeypatch, page.write_backward_timings)


def test_backward_table_of_a_run_without_fla_has_times_and_no_ratios(tmp_path, monkeypatch):
    rows = [_backward_row(r, "ours", what, ms) for r in (1, 2) for what, ms in
            (("fwd_bwd_kernels", 1.0 * r), ("fwd_bwd_call", 1.5), ("backward_kernels", 0.5))]
    _write_csv(tmp_path / backward.CSV_NAME, backward.FIELDS, rows)
    (tmp_path / backward.META_NAME).write_text(json.dumps(dict(
        device="NVIDIA H200", date="2026-12-01", command="python -m benchmarks.backward --out x --no-fla", rounds=2,
        seconds=50, kernel="0", complete=False, shapes={"B=1 N=4096 H=32 D=128": dict(rel_l2_ours_vs_fla=None)})))
    text = _written(tmp_path, monkeypatch, page.write_backward_timings)
    assert "The run was stopped before it finished." in text
    assert "50 s" not in text  # the seconds of the meta file's last write, not the run's length
    assert "No ratios: FLA was not run." in text.split("The times, medians")[0]
    times = text.split("The times, medians")[1].split("The backward's five kernels")[0]
    # the columns of the measurements the run made, and only those
    assert "FLA" not in times and "default checks" not in times and "forward tensors kept" not in times
    assert _table_row(times, "1, 4096, 32, 128")[1:] == [
        "1.500 (1.000 to 2.000)", "1.500 (1.500 to 1.500)", "0.500 (0.500 to 0.500)"]


def _varlen_row(round_number, impl, what, ms=None, mix="chat", error=""):
    return dict(mix=mix, round=round_number, impl=impl, what=what, method="events", sequences=64, tokens=32683,
                padded_tokens=34624, H=32, D=128, dtype="bfloat16", time_ms="" if ms is None else f"{ms:.5f}",
                time_ms_p20="", time_ms_p80="", error=error)


def test_varlen_table_gives_each_mix_its_tokens_ratios_and_times(tmp_path, monkeypatch):
    rows = []
    for r, (fla, ours, unchecked) in enumerate([(3.0, 1.5, 1.0), (3.3, 1.5, 1.0), (2.4, 1.2, 1.0)], 1):
        rows += [_varlen_row(r, "fla", "call", fla), _varlen_row(r, "ours", "call", ours),
                 _varlen_row(r, "ours", "call_unchecked", unchecked), _varlen_row(r, "ours", "kernels", 0.8)]
    rows += [_varlen_row(r, "fla", "graph", error="RuntimeError: capture") for r in (1, 2)]  # listed once
    _write_csv(tmp_path / "varlen.csv", varlen.FIELDS, rows)
    (tmp_path / "varlen_meta.json").write_text(json.dumps(dict(
        command="python -m benchmarks.varlen --out /root/out/v --mix chat", device="NVIDIA H200",
        mixes={"chat": dict(lengths=[1] * 64, tokens=32683, padded_tokens=34624, rel_l2_o_ours_vs_fla=0.0031,
                            rel_l2_state_ours_vs_fla=0.0002)})))
    text = _written(tmp_path, monkeypatch, page.write_varlen_timings)
    assert text.startswith("Run on an NVIDIA H200 (`python -m benchmarks.varlen --out DIR --mix chat`, 3 rounds, "
                           "bfloat16).")
    # FLA / ours call: 2.0, 2.2, 2.0 round by round; FLA / ours unchecked: 3.0, 3.3, 2.4
    assert _table_row(text, "chat")[1:] == ["64", "32683", "34624", "32, 128", "2.00 (2.00 to 2.20)",
                                            "3.00 (2.40 to 3.30)", "3.10e-03", "2.00e-04"]
    assert _table_row(text.split("The times, medians")[1], "chat")[1:] == [
        "1.500 (1.200 to 1.500)", "1.000 (1.000 to 1.000)", "0.800 (0.800 to 0.800)", "–", "–",
        "3.000 (2.400 to 3.300)", "–", "–"]
    assert text.count("- fla graph at the chat mix: RuntimeError: capture") == 1


def _decode_row(impl, what, block_dv, method, ms, p20, p80, **extra):
    total = 250 * 2**20
    return dict(impl=impl, what=what, block_dv=block_dv, method=method, B=64, H=32, d_k=128, d_v=128, pool=256,
                dtype="bfloat16", time_ms=f"{ms:.5f}", time_ms_p20=f"{p20:.5f}", time_ms_p80=f"{p80:.5f}",
                bytes=total, state_bytes=248 * 2**20, bytes_per_s=f"{total / (ms * 1e-3):.4g}",
                copy_bytes_per_s="4e+12", fraction_of_copy=f"{total / (ms * 1e-3) / 4e12:.3f}", **extra)


def test_decode_table_gives_bandwidth_and_fla_timed_alike(tmp_path, monkeypatch):
    checked = dict(rel_l2_o="1.6e-03", rel_l2_state="5.1e-08")
    rows = [_decode_row("ours", "kernel", "16", "graph", 0.2, 0.19, 0.21, **checked),
            _decode_row("ours", "kernel", "32", "graph", 0.1, 0.09, 0.11, **checked),
            _decode_row("ours", "call", "32", "events", 0.4, 0.38, 0.45),
            _decode_row("ours", "call_host_checks", "32", "events", 0.125, 0.12, 0.13),
            _decode_row("fla", "call", "", "events", 0.2, 0.18, 0.3, **checked),
            _decode_row("fla", "kernel", "", "graph", 0.15, 0.14, 0.16, **checked),
            _decode_row("ours", "call_graph", "32", "graph", 0.12, 0.11, 0.13),
            dict(impl="ours", what="kernel", block_dv="64", error="RuntimeError: no compile")]
    _write_csv(tmp_path / "decode.csv", decode.FIELDS, rows)
    text = _written(tmp_path, monkeypatch, page.write_decode_timings)
    assert ("`python -m benchmarks.decode --out DIR --B 64 --H 32 --d 128 --pool 256 --block-dv 16,32,64 "
            "--dtype bfloat16`") in text
    assert "One step moves 250.0 MiB, 248 MiB of them the states" in text and "same run: 4.00 TB/s" in text
    table = [line for line in text.splitlines() if line.startswith("| ours") or line.startswith("| FLA")]
    # 250 MiB in 0.1 ms: 2.62 TB/s, 65.5 % of 4 TB/s; FLA's graph 0.15 ms / 0.1 ms = 1.50; FLA's call against
    # each of ours' calls: 0.2 / 0.4 = 0.50 and 0.2 / 0.125 = 1.60
    assert table[1] == ("| ours | kernel | 32 | CUDA graph | 100.0 (90.0 to 110.0) | 2.62 | 65.5% | 1.50 | 1.6e-03 "
                        "| 5.1e-08 |")
    # and the default call as a graph against FLA's graph: 0.15 / 0.12 = 1.25
    assert [line.split(" | ")[7] for line in table] == ["0.75", "1.50", "0.50", "1.60", "–", "–", "1.25"]
    assert table[2].endswith("| – | – |") and table[3].split(" | ")[1] == "call host checks"
    assert table[4].split(" | ")[1:4] == ["call", "–", "CUDA events"]
    assert "- ours kernel at block_dv 64: RuntimeError: no compile" in text


def test_decode_variants_table_takes_the_medians_that_end_each_log(tmp_path, monkeypatch):
    """The rows of each log's closing table (not the rounds before it), under their B; none committed: says so."""
    assert "No decode variants study is committed" in _written(tmp_path, monkeypatch, page.write_decode_variants)
    (tmp_path / "decode_variants_b64.log").write_text(
        "round 1: library (one state a program): 70.0 us, 90.0% of the copy bandwidth\n"
        "| not | the medians | yet |\n"
        "\nmedians over rounds:\n| library (one state a program) | 71.0 us | 88.0% |\n| 2 states a program, serial | "
        "75.0 us | 84.0% |\n")
    text = _written(tmp_path, monkeypatch, page.write_decode_variants)
    assert _table_row(text, "64") == ["64", "library (one state a program)", "71.0 us", "88.0%"]
    assert "| 64 | 2 states a program, serial | 75.0 us | 84.0% |" in text
    assert "not" not in text.split("|---|")[-1] and "| 256 |" not in text


def test_decode_threads_table_has_each_kernel_with_its_own_runs_fla(tmp_path, monkeypatch):
    """One row per threads and block_dv, in that order, the kernels only (not the calls), each beside
    FLA's graph from the run of its threads, and each run's command with its --threads."""
    def row(threads, impl, what, block_dv, ms, fraction):
        return dict(impl=impl, what=what, block_dv=block_dv, threads=threads, method="graph", B=64, H=32, d_k=128,
                    d_v=128, pool=256, dtype="bfloat16", time_ms=f"{ms:.5f}", fraction_of_copy=f"{fraction:.3f}")

    _write_csv(tmp_path / "decode_b64_blocks.csv", decode.FIELDS, [
        row(128, "ours", "kernel", 64, 0.0730, 0.875), row(128, "ours", "call", 64, 0.0100, 0.999),
        row(128, "ours", "kernel", 32, 0.0770, 0.830), row(128, "fla", "kernel", "", 0.0750, 0.856)])
    _write_csv(tmp_path / "decode_b64_t256.csv", decode.FIELDS, [
        row(256, "ours", "kernel", 64, 0.0754, 0.853), row(256, "fla", "kernel", "", 0.0760, 0.850)])
    text = _written(tmp_path, monkeypatch, page.write_decode_threads)
    rows = [line for line in text.splitlines() if line.startswith("| 1") or line.startswith("| 2")]
    assert rows == ["| 128 | 32 | 77.0 | 83.0% | 75.0 |", "| 128 | 64 | 73.0 | 87.5% | 75.0 |",
                    "| 256 | 64 | 75.4 | 85.3% | 76.0 |"]
    assert "--block-dv 64,32 --dtype bfloat16 --threads 128`" in text and "--threads 256`" in text
