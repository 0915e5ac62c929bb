"""benchmarks.studies.s06_intra_sections's variants of stage 6's intra kernel: each section found in the
kernel's source and run twice, and the variant that waits for every GEMM (the study times them on a GPU)."""

import re

import pytest

from benchmarks.studies import s06_intra_sections as study

SHAPE = (1, 64, 1, 32, 32, 64, "bfloat16")  # 64-token chunks: the GEMMs are issued together


def _calls(program, name):
    return len(re.findall(rf"T\.{name}\(", program.script()))


@pytest.mark.parametrize("section", study.SECTIONS)
def test_a_section_is_found_and_run_twice(section):
    source = study.doubled_source(section)
    assert source.count("for repeat in T.serial(2):") == 1
    start = source.index("for repeat in T.serial(2):")
    first_line = study.SECTIONS[section][0]
    assert source.index(first_line, start) > start  # the section's first line is inside the loop
    kernel_program = study.kernel.build_intra_program(*SHAPE)
    variant = study.load_intra_variant(source, f"test_doubled_{abs(hash(section))}")(*SHAPE)
    assert "repeat" in variant.script() and "repeat" not in kernel_program.script()


def test_the_waited_variant_waits_for_each_gemm_and_changes_nothing_else():
    kernel_program = study.kernel.build_intra_program(*SHAPE)
    waited = study.load_intra_variant(study.every_gemm_waited_source(), "test_every_gemm_waited")(*SHAPE)
    shared_waits = _calls(kernel_program, "wait_wgmma")
    assert shared_waits >= 3 and _calls(kernel_program, "wgmma_gemm") > shared_waits
    assert _calls(waited, "wgmma_gemm") == 0 and _calls(waited, "wait_wgmma") == 0
    assert _calls(waited, "gemm") == _calls(kernel_program, "gemm") + _calls(kernel_program, "wgmma_gemm")


def test_the_table_is_each_sections_median_less_the_kernels_read_back_from_the_log():
    """The page's table comes from the H200 run's log: its round lines, the first run's labels renamed."""
    rounds = [{"the kernel": 4.0, study.EVERY_GEMM_WAITED: 4.25, "score gradients (a channel pass)": 6.0},
              {"the kernel": 5.0, study.EVERY_GEMM_WAITED: 4.75, "score gradients (a channel pass)": 6.5},
              {"the kernel": 4.5, study.EVERY_GEMM_WAITED: 4.5, "score gradients (a channel pass)": 7.0}]
    log = "compiled the kernel in 55 s\n" + "".join(
        f"round {n + 1}: " + ", ".join(f"{label} {ms:.4f} ms" for label, ms in r.items()) + "\n"
        for n, r in enumerate(rounds))
    table = study.sections_table(study.times_from_log(log))
    assert "| (the kernel) | 4.5000 | | |" in table
    assert "| (the kernel, every GEMM waited for) | 4.5000 | +0.0000 (the shared waits' saving) | |" in table
    assert "| score gradients (both channel passes) | 6.5000 | 2.0000 | 44% |" in table
    assert "| dA_qk | not measured: no time | | |" in table
