"""Every generated file under docs/: tables, plots and reports, each made by code in the repository.

A stage contributes its files through `stages/<stage>/figures.py`, which defines
`generated_files()` -> {path relative to the repository: function(path) that writes it}.
The course machinery contributes the kill matrix and, through kdacourse/doctables.py, each stage's
tables of exercises, bugs and kill-matrix rows; benchmarks/figures.py the benchmark page's tables and
plots (from the committed CSVs). `course regenerate` rewrites them all; the test
suite regenerates them into a temporary folder and checks that the committed ones are current.
Figures are SVG written without dates, so the same numbers give the same bytes.
"""

import importlib
import sys
import time
from pathlib import Path

from kdacourse import REPO_ROOT


def generators():
    """{relative path: writer}, from every stage's figures.py and the course machinery."""
    if str(REPO_ROOT) not in sys.path:  # figures use tests/oracles.py and benchmarks/, which live beside the package
        sys.path.insert(0, str(REPO_ROOT))
    table = {}
    for figures in sorted((REPO_ROOT / "stages").glob("s*/figures.py")):
        module = importlib.import_module(f"stages.{figures.parent.name}.figures")
        table.update(module.generated_files())
    from benchmarks import figures as benchmark_figures
    from kdacourse import doctables, killmatrix

    table.update(benchmark_figures.generated_files())
    table.update(killmatrix.generated_files())
    table.update(doctables.generated_files())
    return table


def regenerate(root=REPO_ROOT, only=None):
    """Write every generated file under `root` (the repository by default); prints progress."""
    table = generators()
    selected = [path for path in table if only is None or path in only]
    for number, path in enumerate(selected, 1):
        started = time.monotonic()
        destination = Path(root) / path
        destination.parent.mkdir(parents=True, exist_ok=True)
        table[path](destination)
        print(f"[{number}/{len(selected)}] {path} ({time.monotonic() - started:.1f} s)", flush=True)
    return 0


def save_svg(figure, path):
    """Save a matplotlib figure as SVG with no date or random ids, so equal plots are equal bytes."""
    import matplotlib

    matplotlib.rcParams["svg.hashsalt"] = "kdacourse"
    figure.savefig(path, format="svg", metadata={"Date": None, "Creator": None}, bbox_inches="tight")


def table_cell(value):
    """A value as the text of one Markdown table cell: a "|" would end the cell, so it becomes the
    HTML entity, which the browser turns back into "|" (inside math too, before MathJax reads it)."""
    return str(value).replace("|", "&#124;").replace("\n", " ")


def markdown_table(header, rows):
    """A Markdown table from a header row and rows of already formatted cells."""
    lines = ["| " + " | ".join(map(table_cell, header)) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(map(table_cell, row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(regenerate())
