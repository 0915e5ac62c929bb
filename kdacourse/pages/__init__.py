"""The site's page generators: every generated file under docs/, each made by code in the repository.

One module per page that has generated content: kdacourse/pages/<stage>.py for each stage's page,
benchmarks.py for the benchmarks page (fair.py for its section on stage 5 measured fairly,
serving_benchmarks.py for its sections on stage 6's backward and stage 7's prefill and decode),
fla_backend.py for the page on the course's kernels in a model,
course.py for the course machinery's tables (exercises, bugs, the kill matrix, the `course`
commands, the Reference page's sections). Each defines
`generated_files()` -> {path relative to the repository: function(path) that writes it}.
tables.py makes the Markdown tables, table cells and SVG files they all write.

The generators import the library (stages/) and the catalog, and read the committed results
(benchmarks/results/, tests/gpu_results/) through kdacourse.results, never the benchmarks' code; the
library imports none of them. `course regenerate` rewrites every file; the test suite regenerates them into
a temporary folder and checks that the committed ones are current. Figures are SVG written without
dates, so the same numbers give the same bytes.
"""

import importlib
import time
from pathlib import Path

from kdacourse import REPO_ROOT

PAGES = Path(__file__).parent


def generators():
    """{relative path: writer}, from every page module."""
    from kdacourse.pages import benchmarks, course, fair, fla_backend, interpreter, layouts, serving_benchmarks

    table = {}
    for page in sorted(PAGES.glob("s[0-9][0-9]_*.py")):
        table.update(importlib.import_module(f"kdacourse.pages.{page.stem}").generated_files())
    table.update(benchmarks.generated_files())
    table.update(fair.generated_files())
    table.update(serving_benchmarks.generated_files())
    table.update(fla_backend.generated_files())
    table.update(course.generated_files())
    table.update(layouts.generated_files())
    table.update(interpreter.generated_files())
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
