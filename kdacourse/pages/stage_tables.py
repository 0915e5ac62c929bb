"""Tables that every stage's page makes the same way, from the stage's code.

`identities_table` (names, statements, proved, from the stage's identities.py), `compile_report_table`
(the kernel's ptxas report at a few tile sizes, from kernel.compile_report) and `gpu_log_table` (the
errors a committed GPU test log printed).
"""

import re
import subprocess

from kdacourse import results
from kdacourse.pages.tables import banner, markdown_table
from stages.common.tilelang_tools import find_nvcc


def identities_table(identity_builders, source):
    """A table of a stage's identities: name, statement, and whether SymPy proves it (here, now)."""
    rows = []
    for build in identity_builders:
        identity = build()
        rows.append((f"`{build.__name__}`", identity.name, identity.statement,
                     "proved" if identity.holds() else "**FAILS**"))
    return banner(source) + markdown_table(["function", "identity", "statement", "SymPy"], rows)


def nvcc_version():
    """'13.0.88', the release of the nvcc that compile reports use."""
    output = subprocess.run([find_nvcc(), "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"V(\d+\.\d+\.\d+)", output)
    return match.group(1) if match else "unknown"


def compile_report_table(reports, source):
    """A table of compile reports: reports is a list of ({column: value} of tile sizes, CompileReport)."""
    settings = list(reports[0][0])
    rows = []
    for values, report in reports:
        rows.append([values[name] for name in settings] + [
            " x ".join(map(str, report.grid)), report.threads, report.registers, report.spill_stores,
            report.spill_loads, f"{report.shared_memory / 1024:.1f}"])
    header = settings + ["grid (x, y, z)", "threads/block", "registers/thread", "spill stores (B)",
                         "spill loads (B)", "shared memory (KiB)"]
    return (banner(source) + markdown_table(header, rows)
            + f"\nCompiled for sm_90a by nvcc {nvcc_version()}; no GPU involved.\n")


def gpu_log_table(log_path, source):
    """The kernel errors a committed GPU test log printed, one row per line of the form
    '<what>: max abs <x>, rel L2 <y>' (how the gpu tests print an ErrorReport)."""
    rows = results.gpu_test_errors(log_path)
    return (banner(f"{source}, from {log_path}") + markdown_table(["run", "max abs error", "relative L2"], rows)
            + f"\nFrom `{log_path}`; tests/gpu_results/README.md says on which machine and with which command.\n")


