"""The course machinery's tables, generated from the code and the catalog rather than typed.

docs/generated/course_commands.md lists the `course` subcommands (from kdacourse/cli.py's docstring),
docs/generated/reference_modules.md the Reference page's sections, one per stage, and
docs/generated/kill_matrix.md the kill matrix (computed by kdacourse/killmatrix.py). For every stage
of the catalog, three files under docs/generated/catalog/ (a stage page includes them with
`--8<-- "docs/generated/catalog/..."`):

    <stage>_exercises.md      the stage's exercises: file, kind, points, the bug it ships with
    <stage>_bugs.md           the stage's known bugs: the mistake, why it is easy, when it hides
    <stage>_kill_matrix.md    the stage's rows of the kill matrix

and docs/generated/course_path.md, the path through the course (docs/index.md): per stage, its
exercises from the easiest to the hardest with the catalog's estimate of the minutes each takes.
"""

import ast
import re
import tempfile
import textwrap
from collections import defaultdict
from pathlib import Path

from kdacourse import REPO_ROOT
from kdacourse.catalog import bugs, exercises, stages
from kdacourse.pages.tables import banner, markdown_table, table_cell

CATALOG_TABLES_DIR = "docs/generated/catalog"
KILL_MATRIX_PATH = "docs/generated/kill_matrix.md"
KILL_MATRIX_LEGEND = ("A cell counts the cases of a test (its parameters) that fail with the bug in; **bold** cells "
                      "catch it. A test of another file (·) is not run: it loads only its own file, never the bug.")


# ------------------------------------------------------------------------------------- catalog


def write_exercise_table(stage, path):
    from kdacourse.sitelinks import read_location  # what `course check` prints: the section's heading

    rows = []
    for exercise in (e for e in exercises() if e.stage == stage):
        section = re.search(r"section '(.*)'$", read_location(exercise.read))
        # The table sits above the exercises: it says what a fix exercise ships with (one seeded
        # bug), never which one; the bug table below names it, collapsed.
        ships_with = {"fill": "a TODO to fill", "fix": "one seeded bug", "tune": "a right but wasteful program"}
        rows.append((f"`{exercise.id}`", f"`exercises/{stage}/{exercise.file}`", exercise.kind,
                     exercise.points, ships_with[exercise.kind],
                     f"[{section[1] if section else exercise.read}]({exercise.read})",
                     f"`tests/exercises/{stage}/test_{exercise.file}`"))
    path.write_text(banner("kdacourse/pages/course.py and the catalog") + markdown_table(
        ["exercise", "file", "kind", "points", "ships with", "read", "tests"], rows))


def write_bug_table(stage, path):
    """The stage's known bugs: those no exercise ships in full; those an exercise ships, collapsed.

    A bug an exercise ships with is that exercise's answer, so its row (the mistake, why it is easy,
    when it hides) sits in a block the reader opens, after the exercises, like a solution.
    """
    header = ["bug", "file", "the mistake", "why it is easy to make", "when it hides"]
    shipped = {exercise.bug: exercise.id for exercise in exercises() if exercise.bug}
    stage_bugs = [bug for bug in bugs() if bug.stage == stage]
    open_rows = [(f"`{bug.id}`", f"`{bug.file}`", bug.mistake, bug.why_easy, bug.hides_when)
                 for bug in stage_bugs if bug.id not in shipped]
    shipped_rows = [(f"`{bug.id}` (exercise `{shipped[bug.id]}`)", f"`{bug.file}`", bug.mistake,
                     bug.why_easy, bug.hides_when) for bug in stage_bugs if bug.id in shipped]
    text = banner("kdacourse/pages/course.py and the catalog") + markdown_table(header, open_rows)
    if shipped_rows:
        block = markdown_table(header, shipped_rows)
        text += ('\n??? success "The bugs the exercises ship with (open after your checks pass)"\n'
                 + "".join(f"    {line}\n" if line else "\n" for line in block.splitlines()))
    path.write_text(text)


def kill_matrix_sections(text):
    """{stage: its table} from the text of docs/generated/kill_matrix.md ('### <stage>' sections)."""
    sections = re.split(r"^### (\S+)\n", text, flags=re.MULTILINE)
    tables = {}
    for stage, body in zip(sections[1::2], sections[2::2]):
        tables[stage] = "\n".join(line for line in body.strip().splitlines() if line.startswith("|")) + "\n"
    return tables


def write_kill_matrix(path):
    """Every stage's bugs against its exercise tests (kdacourse.killmatrix.compute, once per process)."""
    from kdacourse.killmatrix import compute, test_function

    results = compute()
    by_stage = defaultdict(list)
    for bug in bugs():
        by_stage[bug.stage].append(bug)
    lines = [banner("kdacourse/killmatrix.py").rstrip(), ""]
    for stage, stage_bugs in by_stage.items():
        functions = sorted({test_function(t) for bug in stage_bugs for t in results[bug.id].outcomes})
        lines += [f"### {stage}", "", "| bug | hides when | " + " | ".join(f"`{f.split('::')[1]}`<br>{f.split('::')[0]}" for f in functions) + " |",
                  "|---|---|" + "---|" * len(functions)]
        for bug in stage_bugs:
            outcomes = results[bug.id].outcomes
            cells = []
            for function in functions:
                cases = [o for t, o in outcomes.items() if test_function(t) == function]
                caught = sum(o == "failed" for o in cases)
                if not cases:  # a test of another file: it never loads the file the bug is in
                    cells.append("·")
                else:
                    cells.append(f"**{caught}/{len(cases)}**" if caught else f"0/{len(cases)}")
            lines.append(f"| `{bug.id}` | {table_cell(bug.hides_when)} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append(KILL_MATRIX_LEGEND)
    path.write_text("\n".join(lines) + "\n")


def write_stage_kill_matrix(stage, path):
    with tempfile.TemporaryDirectory() as folder:
        full = Path(folder) / "kill_matrix.md"
        write_kill_matrix(full)
        tables = kill_matrix_sections(full.read_text())
    if stage not in tables:
        raise ValueError(f"the kill matrix has no section for {stage}")
    path.write_text(banner("kdacourse/killmatrix.py (this stage's rows)") + tables[stage] + "\n" + KILL_MATRIX_LEGEND + "\n")


def generated_files():
    table = {"docs/generated/course_commands.md": write_course_commands,
             "docs/generated/reference_modules.md": write_reference_modules,
             KILL_MATRIX_PATH: write_kill_matrix,
             COURSE_PATH: write_course_path}
    for stage in stages():
        table[f"{CATALOG_TABLES_DIR}/{stage}_exercises.md"] = lambda path, s=stage: write_exercise_table(s, path)
        table[f"{CATALOG_TABLES_DIR}/{stage}_bugs.md"] = lambda path, s=stage: write_bug_table(s, path)
        table[f"{CATALOG_TABLES_DIR}/{stage}_kill_matrix.md"] = lambda path, s=stage: write_stage_kill_matrix(s, path)
    return table


COURSE_PATH = "docs/generated/course_path.md"
DIFFICULTY = {1: "a line or two", 2: "a short function", 3: "a step of a kernel", 4: "a whole function or kernel",
              5: "a whole kernel of many parts"}
BUILD_FILE = "build_kernel.py"  # a fill exercise whose region is a kernel's whole body


def write_course_path(path):
    """Per stage, its exercises in order of difficulty (then of the time they take), with the
    catalog's estimate of the minutes each takes and the stage's total."""
    rows = []
    for stage in stages():
        ordered = sorted((e for e in exercises() if e.stage == stage), key=lambda e: (e.difficulty, e.minutes))
        page = stage + ".md"
        for step, exercise in enumerate(ordered, 1):
            rows.append((f"[{stage.split('_')[0]}]({page})" if step == 1 else "", step,
                         f"[`{exercise.id}`]({exercise.read})", "build" if exercise.file == BUILD_FILE else exercise.kind,
                         f"{exercise.difficulty} ({DIFFICULTY[exercise.difficulty]})", exercise.minutes))
        rows.append(("", "", f"*{len(ordered)} exercises*", "", "",
                     f"*{sum(e.minutes for e in ordered)}*"))
    total_hours = sum(e.minutes for e in exercises()) / 60
    path.write_text(banner("kdacourse/pages/course.py and the catalog (difficulty, minutes)") + markdown_table(
        ["stage", "step", "exercise", "kind", "difficulty", "minutes"], rows)
        + f"\nAbout {total_hours:.0f} hours in all; the minutes are estimates, not measurements.\n")


def write_course_commands(path):
    """The `course` subcommands and what each does, as kdacourse/cli.py's docstring lists them (read
    from the source: the command line imports this package for `course regenerate`)."""
    source = (REPO_ROOT / "kdacourse" / "cli.py").read_text(encoding="utf-8")
    listing = ast.get_docstring(ast.parse(source), clean=False).split("\n\n")[1]
    path.write_text(banner("kdacourse/cli.py's docstring") + "```text\n" + textwrap.dedent(listing).strip() + "\n```\n")


REFERENCE_MODULES = ("reference", "kernel", "identities", "numerics", "autograd", "layer")


def write_reference_modules(path):
    """The Reference page's stage sections: a mkdocstrings block per module of each stage that has it."""
    lines = [banner("kdacourse/pages/course.py: every stage's reference, kernel, identities, numerics, autograd, layer; the kernel package").rstrip(), ""]
    for folder in sorted((REPO_ROOT / "stages").glob("s[0-9][0-9]_*")):
        modules = [name for name in REFERENCE_MODULES if (folder / f"{name}.py").is_file()]
        if not modules:
            continue
        title = folder.name
        init = folder / "__init__.py"
        if init.is_file():
            match = re.match(r'\s*"""(Stage \d+: [^,.]+)', init.read_text(encoding="utf-8"))
            title = match.group(1) if match else title
        lines += [f"## {title}", ""]
        lines += [line for name in modules for line in (f"::: stages.{folder.name}.{name}", "")]
    package = REPO_ROOT / "stages" / "kda"  # the fast path's kernel library, which stages 5-7 teach
    lines += ["## The kernel package, stages.kda", ""]
    lines += [line for module in sorted(package.glob("*.py")) if module.name != "__init__.py"
              for line in (f"::: stages.kda.{module.stem}", "")]
    path.write_text("\n".join(lines))
