"""The generated files whose figures go through BLAS are current under other OpenBLAS kernels too.

NumPy's OpenBLAS is built for every x86-64 core type (DYNAMIC_ARCH) and picks its kernel by the CPU:
another machine adds the same matrix products in another order, and figures at rounding level
change. OPENBLAS_CORETYPE forces a kernel, so this machine can stand for others. Each case
regenerates those files in a child process under one kernel and thread count, checks that OpenBLAS
really runs that kernel (it ignores a name it does not know), and compares the files with the
committed ones as tests/course/test_generated.py does.

BLAS_FILES are the files that changed when every generated file was regenerated under the
Haswell, Sandybridge, Nehalem and Prescott kernels, 1 and 2 threads, and SkylakeX (this machine's
own), plus the fp16 tables and the plot that also go through BLAS and did not change; a new table
whose figures go through BLAS belongs here too. A child takes about 7 s of CPU: the three cases
cost about 20 s.

Run a child alone: OPENBLAS_CORETYPE=Haswell python -m tests.course.test_generated_any_blas <folder>
"""

import ctypes
import importlib
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kdacourse import REPO_ROOT

BLAS_FILES = [f"docs/generated/{name}" for name in (
    "s01_errors.md", "s02_errors.md", "s02_factorized_vs_ratio.md", "s03_beta_bugs.md", "s03_degenerate_checks.md",
    "s03_errors.md", "s03_numerics.md", "s03_numerics.svg", "s03_small_beta.md", "s04_bug_costs.md",
    "s04_degenerate_checks.md", "s04_errors.md", "s04_fp16_emulation.md", "s04_small_beta.md",
    "s04_split_and_pairings.md", "s05_errors.md", "s05_fp16.md", "s06_errors.md", "s07_errors.md")]

# (OPENBLAS_CORETYPE, OPENBLAS_NUM_THREADS): kernels that any x86-64 CPU since 2013 runs (AVX2, AVX,
# SSE4.2), none of them this machine's own (SkylakeX), with one thread and with two
CASES = [("Haswell", 2), ("Sandybridge", 1), ("Nehalem", 2)]


def openblas_kernel():
    """(core name, threads) of the OpenBLAS this process's NumPy has loaded; None without one."""
    import numpy  # noqa: F401  (loads OpenBLAS)

    with open("/proc/self/maps") as maps:
        library = next((line.split()[-1] for line in maps if "openblas" in line.split()[-1]), None)
    if library is None:
        return None
    openblas = ctypes.CDLL(library)
    # NumPy's wheels name the functions scipy_openblas_*64_ (their 64-bit integer build)
    for prefix, suffix in (("scipy_openblas_", "64_"), ("openblas_", "64_"), ("openblas_", "")):
        corename = getattr(openblas, f"{prefix}get_corename{suffix}", None)
        if corename is not None:
            corename.restype = ctypes.c_char_p
            return corename().decode(), getattr(openblas, f"{prefix}get_num_threads{suffix}")()
    return None


def write_blas_files(folder):
    """Write BLAS_FILES under `folder`, from the stage pages alone (the other pages import torch)."""
    writers = {}
    for page in sorted((REPO_ROOT / "kdacourse/pages").glob("s[0-9][0-9]_*.py")):
        writers.update(importlib.import_module(f"kdacourse.pages.{page.stem}").generated_files())
    for path in BLAS_FILES:
        (Path(folder) / path).parent.mkdir(parents=True, exist_ok=True)
        writers[path](Path(folder) / path)


@pytest.mark.skipif(platform.machine() != "x86_64" or not Path("/proc/self/maps").exists(),
                    reason="the core types are x86-64's, found through /proc")
@pytest.mark.parametrize("core_type, threads", CASES)
def test_blas_files_are_current_under_another_kernel(core_type, threads, tmp_path):
    from tests.course.test_generated import staleness  # not in the child: test_generated lists every page, torch's too

    if openblas_kernel() is None:
        pytest.skip("NumPy has no OpenBLAS here")
    environment = dict(os.environ, OPENBLAS_CORETYPE=core_type, OPENBLAS_NUM_THREADS=str(threads))
    child = subprocess.run([sys.executable, "-m", "tests.course.test_generated_any_blas", str(tmp_path)], cwd=REPO_ROOT,
                           env=environment, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    ran = json.loads(child.stdout.splitlines()[-1])
    assert ran == [core_type, threads], f"asked for OpenBLAS's {core_type} kernel and {threads} threads, got {ran}"
    stale = [message for path in BLAS_FILES if (message := staleness(path, REPO_ROOT / path, tmp_path / path))]
    if stale:
        pytest.fail(f"under OpenBLAS's {core_type} kernel, OPENBLAS_NUM_THREADS={threads}:\n" + "\n".join(stale))


if __name__ == "__main__":
    write_blas_files(sys.argv[1])
    print(json.dumps(openblas_kernel()))
