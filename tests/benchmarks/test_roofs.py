"""benchmarks/roofs.py on a CPU: the arithmetic of a measurement, what meta.json records, and what the
page reads back from it (kdacourse.results.roofs_of, kdacourse.pages.benchmarks.roofs_rows)."""

import json

import pytest

from benchmarks import roofs
from kdacourse import results
from kdacourse.pages.benchmarks import roofs_rows


def fixed_timer(milliseconds):
    """A timer that runs the function once (so that it is exercised) and reports a fixed time."""
    def timer(function):
        function()
        return milliseconds
    return timer


def test_measure_counts_bytes_read_and_written_and_2mnk_flops():
    measured = roofs.measure(device="cpu", copy_bytes=1 << 20, gemm_size=32, timer=fixed_timer(2.0))
    assert set(measured) == set(roofs.FIELDS)
    assert measured["copy_bytes"] == 2 * (1 << 20)  # read once, written once
    assert measured["bandwidth_bytes_per_s"] == pytest.approx(2 * (1 << 20) / 2e-3)
    assert measured["bf16_flops_per_s"] == pytest.approx(2 * 32 ** 3 / 2e-3)
    assert measured["copy_ms"] == measured["gemm_ms"] == 2.0


def test_a_recorded_measurement_survives_meta_json():
    measured = roofs.measure(device="cpu", copy_bytes=1 << 16, gemm_size=16, timer=fixed_timer(0.5))
    run = json.loads(json.dumps({"device": "NVIDIA H200", "roofs": measured}))
    assert results.roofs_of(run) == pytest.approx(measured)


def test_a_failed_measurement_is_recorded_not_raised():
    recorded = roofs.measure_or_error(device="no-such-device")
    assert set(recorded) == {"error"}
    assert results.roofs_of({"roofs": recorded}) is None


@pytest.mark.parametrize("run", [
    {},  # a run from before the roofs were measured
    {"roofs": None},
    {"roofs": {"bandwidth_bytes_per_s": 4e12}},  # fields missing
    {"roofs": dict.fromkeys(roofs.FIELDS, "fast")},
    {"roofs": dict.fromkeys(roofs.FIELDS, 0.0)},
    {"roofs": dict.fromkeys(roofs.FIELDS, float("nan"))},
])
def test_runs_without_usable_roofs_read_as_none(run):
    assert results.roofs_of(run) is None


def test_page_rows_say_which_bandwidth_is_specified_measured_and_used():
    measured = dict(zip(roofs.FIELDS, (2e9, 0.5, 4.25e12, 8192, 1.7, 6.5e14)))
    runs = [{"device": "NVIDIA H200"}, {"device": "NVIDIA H200", "roofs": measured}]
    fair = {"device": "NVIDIA H200", "date": "2026-12-01", "roofs": dict(measured, bandwidth_bytes_per_s=4.2e12)}
    rows = roofs_rows(runs, fair)
    assert rows[0][:2] == ("specified", "4.80 TB/s")
    assert rows[1][:3] == ("measured before the runs", "4.30 TB/s", "672 TFLOP/s")
    assert rows[2][:3] == ("run 2", "4.25 TB/s", "650 TFLOP/s")  # run 1 recorded none: no row
    assert rows[3][:3] == ("fair run of 2026-12-01", "4.20 TB/s", "650 TFLOP/s")
    assert rows[-1][:2] == ("the memory bound uses", "4.30 TB/s")
    assert len(rows) == 5
    assert len(roofs_rows(runs)) == 4  # no fair run committed: no row for it


def test_the_page_reads_the_fields_a_run_records_and_the_bandwidth_the_bound_uses():
    """kdacourse.results knows the roofs' fields and DESIGN.md's figures without importing the benchmarks."""
    from benchmarks.bench import MEMORY_BANDWIDTH

    assert results.ROOF_FIELDS == roofs.FIELDS
    assert results.DESIGN_COPY_BANDWIDTH == roofs.DESIGN_COPY_BANDWIDTH == MEMORY_BANDWIDTH
