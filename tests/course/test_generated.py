"""Every generated file under docs/ is current: regenerating it changes nothing beyond rounding.

A Markdown file's text and shapes must be equal, its figures equal within what rounding moves them
(kdacourse/pages/tables.py: disagreement; a figure at rounding level is written "≈2e-16" and compared
within a factor). An SVG plot must be equal byte for byte: matplotlib writes its coordinates to 1e-6
of a point, and no plot shows a figure at rounding level; the one plotted figure that goes through
BLAS (s03_numerics.svg: float64 forward substitution) moves by far less than that between kernels.
tests/course/test_generated_any_blas.py regenerates the files whose figures go through BLAS under other
OpenBLAS kernels and thread counts.
"""

import os

import pytest

from kdacourse import REPO_ROOT
from kdacourse.pages import generators, regenerate
from kdacourse.pages.tables import disagreement
from stages.common.tilelang_tools import NvccMissing

GENERATED = sorted(generators())


def staleness(path, committed, regenerated):
    """Why the committed file `path` is not what regenerating it gives, as a message; None if it is."""
    if path.endswith(".md"):
        difference = disagreement(committed.read_text(), regenerated.read_text())
        return difference and f"{path} is stale ({difference}): run `course regenerate`"
    if committed.read_bytes() != regenerated.read_bytes():
        return f"{path} is stale: run `course regenerate`"
    return None


@pytest.mark.parametrize("path", GENERATED)
def test_generated_file_is_current(path, tmp_path):
    try:
        regenerate(root=tmp_path, only={path})
    except NvccMissing as missing:  # a compile report; CI has nvcc and must check it
        if os.environ.get("CI"):
            raise
        pytest.skip(str(missing))
    committed = REPO_ROOT / path
    assert committed.is_file(), f"{path} is missing: run `course regenerate`"
    if stale := staleness(path, committed, tmp_path / path):
        pytest.fail(stale)


ROW = "| B=2, N=16, C=16 | B chunkwise vs A | ≈2e-16 | 1.68e-01 | 0.00e+00 | eps = 1e-13 |\n"


@pytest.mark.parametrize("regenerated", [
    ROW.replace("≈2e-16", "≈4e-16"),  # another BLAS kernel (seen: up to 2.3x)
    ROW.replace("1.68e-01", "1.69e-01"),  # a 3-digit figure whose last digit rounding moved
])
def test_a_figure_moved_by_rounding_keeps_a_file_current(regenerated):
    assert disagreement(ROW, regenerated) is None


@pytest.mark.parametrize("regenerated", [
    ROW.replace("≈2e-16", "≈2e-15"),  # a figure at rounding level, 10x
    ROW.replace("1.68e-01", "1.68e-02"),  # a figure, 10x
    ROW.replace("1.68e-01", "1.73e-01"),  # a figure, 3%
    ROW.replace("0.00e+00", "1.00e-20"),  # bitwise equal no more
    ROW.replace("≈2e-16", "2e-16"),  # no longer marked as rounding
    ROW.replace("N=16", "N=17"),  # a shape
    ROW.replace("1e-13", "2e-13"),  # a parameter
    ROW.replace("chunkwise", "recurrent"),  # the text
    ROW + "| one more row |\n",
])
def test_a_change_beyond_rounding_makes_a_file_stale(regenerated):
    assert disagreement(ROW, regenerated) is not None
