"""`course handout OUT`: the folder a student receives, without the answers.

It is made from the course as committed (HEAD), never from the working tree: `git archive` writes the
commit into a temporary folder, and that snapshot's own code (`python -m kdacourse.handout OUT`) makes
the handout from it. An instructor who solves an exercise to try it, or half rewrites a page, hands
none of it out; the uncommitted changes left out are listed on stderr. A course that is not a git
checkout is refused, with the commands that make it one.

It holds what a student works with, and works on its own (`make setup` there, or
`pip install -e '.[site,test]'`): `course check`, `course build` and `course serve` run there.

- exercises/ as shipped, and the tests that check them: tests/conftest.py and tests/exercises/,
  whose comparisons with library functions that are exercises read values recorded here from the
  full course (tests/exercises/library_values.py; tests/exercises/<stage>/expected/*.npz);
- the library, stages/, with every function that an exercise asks for replaced by a stub that raises
  NotImplementedError and names the exercise: the functions of stages/<stage>/reference.py,
  kernel.py and numerics.py that have the name of a function of solutions/<stage>/*.py (e.g.
  recurrent, kernel_mirror, build_program). What calls a stub raises in turn (the kernels' wrappers);
- the pages, docs/, as the handout has them: the texts that describe the full course (solutions/,
  --target=solutions, bug targets) replaced by the handout's (FULL_COURSE_TEXT), and without solution
  code: every collapsed block opened "after your check passes"
  (the solutions, the bugs the exercises ship with) gives way to a line saying the solution is with
  the instructor; a code snippet of a stubbed function is written into the page when the student's
  exercise file shows the same code anyway (a kernel's head), and otherwise gives way to the same
  line; the kill matrices lose the rows of the bugs the exercises ship with. The generated tables
  were made from the full library and are copied as they are (`course regenerate` refuses here);
- the catalog's exercises, without any bug entry (a bug's `find` text is solution code, and the bug
  a fix exercise ships with is its answer);
- the course machinery (kdacourse/), the site's configuration, benchmarks/results/ (a page includes
  one of its files), the setup files; no solutions/, no library tests, no benchmark code;
- a README for students (kdacourse/handout_README.md): setup, `course check`, the pages, handing in.

A handout-based submission is graded in the instructor's copy: `course grade` on the student's
exercises folder.
"""

import ast
import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from pathlib import Path

from kdacourse import HANDOUT_MARKER, REPO_ROOT, is_handout

MARKER = HANDOUT_MARKER
# What a handout copies from the course, relative to its root (folders whole, less caches).
COPIED = ["Makefile", "pyproject.toml", "mkdocs.yml", ".gitignore", "scripts", "kdacourse", "stages",
          "exercises", "docs", "benchmarks/results", "tests/__init__.py", "tests/conftest.py", "tests/exercises"]
LIBRARY_MODULES = ("reference.py", "kernel.py", "numerics.py")
# the fast path's package (stages/kda/): stages 5-7 teach its kernels, so an exercise of theirs may be
# one of its functions (build_prepare_program, say), stubbed there as in a stage's modules
KERNEL_PACKAGE = "kda"
# The README a student reads at the handout's root, in place of the course's (kdacourse/handout_README.md).
STUDENT_README = "kdacourse/handout_README.md"
# A snapshot of a commit, which make_handout writes and builds the handout from, holds this file.
SNAPSHOT_FILE = ".course-snapshot"
NO_SOLUTION = "*The solution is with your instructor: a handout leaves it out.*"
# A collapsed block the reader opens "after" a check passes holds an answer.
ANSWER_BLOCK = re.compile(r'^(?P<indent>\s*)\?\?\?\+? \w+ "[^"]*\(open after [^"]*\)"\s*$')
SNIPPET = re.compile(r'^(?P<indent>\s*)--8<-- "(?P<path>[^":]+):(?P<section>[A-Za-z_]\w*)"\s*$')
SECTION_MARK = re.compile(r"#\s*--8<--\s*\[(?P<which>start|end):(?P<name>\w+)\]")
# A page's text for the full course, then, in an HTML comment the site does not show, the handout's:
#     <!-- full course -->
#     ...what the full course says (solutions/, --target=solutions, bug targets)...
#     <!-- handout
#     ...what the handout says instead...
#     -->
FULL_COURSE_TEXT = re.compile(r"^<!-- full course -->\n(?P<course>.*?)^<!-- handout\n(?P<handout>.*?)^-->\n", re.S | re.M)
FULL_COURSE_MARKERS = ("<!-- full course -->", "<!-- handout")


class HandoutError(Exception):
    """The handout cannot be made (the message says why)."""


def refuse_in_handout(command):
    """For the commands that need the full course: a message and exit code 2 in a handout, else None."""
    if not is_handout():
        return None
    print(f"course {command}: this is a student handout ({MARKER}): it has no solutions and its library leaves "
          f"out the exercises, so `course {command}` runs only in the instructor's copy of the course. "
          f"Here, `course check` checks your exercises.", file=sys.stderr)
    return 2


def make_handout(out, record=True, commit="HEAD"):
    """Write the handout of the course as committed at `commit` into `out` (a new or empty folder
    outside the course); returns the exit code.

    The handout is made from the commit, never from the working tree: `git archive` writes the
    committed course into a temporary folder, and that copy's own `python -m kdacourse.handout`
    makes the handout from it. So an instructor's edits (a solved exercise, a page half rewritten)
    cannot reach students; what the working tree holds and the commit does not is listed on stderr.
    A course that is not a git checkout is refused, with the commands that make it one."""
    out = Path(out).expanduser().resolve()
    try:
        if is_handout():
            raise HandoutError("this is already a handout: make one from the instructor's copy of the course")
        if out.exists() and any(out.iterdir()):
            raise HandoutError(f"{out} exists and is not empty")
        if out.is_relative_to(REPO_ROOT):
            raise HandoutError(f"{out} is inside the course: write the handout somewhere else")
        commit, prefix = _resolve_commit(commit)
        left_out = _uncommitted(commit)
        if left_out:
            _say_left_out(commit, left_out)
        with tempfile.TemporaryDirectory(prefix="course-handout-") as folder:
            snapshot = Path(folder) / "course"
            _export(commit, prefix, snapshot)
            # The snapshot's own code, not this one's: with the snapshot first on the path, its
            # kdacourse, stages and tests are the ones imported, and its REPO_ROOT is the snapshot.
            path = [str(snapshot), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
            environment = dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONDONTWRITEBYTECODE="1")
            command = [sys.executable, "-m", "kdacourse.handout", str(out), *([] if record else ["--no-record"])]
            return subprocess.run(command, cwd=snapshot, env=environment).returncode
    except HandoutError as error:
        print(f"course handout: {error}", file=sys.stderr)
        return 2


def build_from_snapshot(out, record=True):
    """Write the handout into `out` from this copy of the course, which must be a snapshot that
    make_handout exported (it holds SNAPSHOT_FILE); returns the exit code."""
    out = Path(out).resolve()
    try:
        if not (REPO_ROOT / SNAPSHOT_FILE).is_file():
            raise HandoutError(f"{REPO_ROOT} is not a snapshot of a commit: run `course handout OUT` in the course, "
                               "which makes the handout from the committed course only")
        commit = (REPO_ROOT / SNAPSHOT_FILE).read_text().strip()
        if out.exists() and any(out.iterdir()):
            raise HandoutError(f"{out} exists and is not empty")
        _copy(out)
        (out / "README.md").write_text((REPO_ROOT / STUDENT_README).read_text())
        stubbed = stub_library(out)
        rewrite_pages(out, stubbed)
        write_catalog(out)
        (out / MARKER).write_text(_marker_text(commit))
        if record:
            record_library_values(out)
    except HandoutError as error:
        print(f"course handout: {error}", file=sys.stderr)
        return 2
    print(f"wrote the handout of commit {commit[:12]} into {out}: {len(stubbed)} library functions left out as "
          "exercises", flush=True)
    return 0


def _marker_text(commit):
    return ("# A student handout of the course\n\n"
            "Made by `course handout` from the instructor's copy of the course, as committed at\n"
            f"{commit}. It has the exercises, their tests and the course pages, and the library without\n"
            "the functions that are exercises (they raise NotImplementedError). Check your work with\n"
            "`course check`; read the pages with `course serve`. Your instructor grades your `exercises/`\n"
            "folder in the full course (`course grade`). README.md says how to start.\n")


# ------------------------------------------------------------------------------------- the commit


def _git(*arguments):
    """The output of `git arguments` run in the course; HandoutError, with git's message, when it fails."""
    result = subprocess.run(["git", *arguments], cwd=REPO_ROOT, capture_output=True)
    if result.returncode != 0:
        raise HandoutError(f"git {' '.join(arguments)}: {result.stderr.decode(errors='replace').strip()}")
    return result.stdout


NOT_A_CHECKOUT = (
    "a handout is made from the committed course (git archive), so that nothing uncommitted, such as an "
    "exercise you solved to try it, reaches students; here {why}. Make the course a git checkout first, "
    "with its exercises as shipped: git init && git add -A && git commit -m course")


def _resolve_commit(commit):
    """(the full hash of `commit`, the course's folder inside its repository: '' or 'path/')."""
    if shutil.which("git") is None:
        raise HandoutError(NOT_A_CHECKOUT.format(why="git is not installed"))
    try:
        prefix = _git("rev-parse", "--show-prefix").decode().strip()
    except HandoutError:
        raise HandoutError(NOT_A_CHECKOUT.format(why=f"{REPO_ROOT} is not a git checkout")) from None
    try:
        full = _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").decode().strip()
    except HandoutError:
        raise HandoutError(f"{commit} is not a commit of the course's repository (one without commits has "
                           "none: commit the course first)") from None
    return full, prefix


def _uncommitted(commit):
    """[(what, path)] of the course's working tree that the commit does not hold: tracked files that
    differ from it (modified, added, deleted, changed type) and untracked files that git does not ignore."""
    kinds = {"M": "modified", "A": "added", "D": "deleted", "T": "changed type"}
    fields = _git("diff", "--name-status", "--no-renames", "--relative", "-z", commit, "--").decode().split("\0")
    changed = [(kinds.get(status, status), path) for status, path in zip(fields[0::2], fields[1::2]) if path]
    untracked = _git("ls-files", "--others", "--exclude-standard", "-z", "--", ".").decode().split("\0")
    return changed + [("untracked", path) for path in untracked if path]


def _say_left_out(commit, left_out, shown=20):
    lines = [f"course handout: the handout is made from commit {commit[:12]}, not from the working tree, which "
             f"holds {len(left_out)} uncommitted change(s) that the handout leaves out:"]
    lines += [f"  {what:<12} {path}" for what, path in left_out[:shown]]
    lines += [f"  ... and {len(left_out) - shown} more (git status)"] if len(left_out) > shown else []
    lines.append("Commit what students should have (never a solved exercise) and make the handout again.")
    print("\n".join(lines), file=sys.stderr, flush=True)


def _export(commit, prefix, snapshot):
    """Write the course as committed into `snapshot`, with SNAPSHOT_FILE naming the commit."""
    archive = _git("archive", "--format=tar", f"{commit}:{prefix}" if prefix else commit)
    snapshot.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+, 3.11.4+: no links or paths out of the folder
            tar.extractall(snapshot, filter="data")
        else:
            tar.extractall(snapshot)
    (snapshot / SNAPSHOT_FILE).write_text(commit + "\n")


# ------------------------------------------------------------------------------------------ copy


def _copy(out):
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in COPIED:
        source = REPO_ROOT / name
        if not source.exists():
            continue
        destination = out / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, destination, ignore=ignore)
        else:
            shutil.copy2(source, destination)


# -------------------------------------------------------------------------------------- library


ANSWER_LINES_THAT_GIVE_IT_AWAY = 4  # lines of a fill's answer that make another function hold it (boilerplate slicing lines are shared by up to 3)
# A build exercise's answer is a whole kernel, whose grid, allocations and loads every later stage's
# kernels share line for line: another function holds it when it holds this share of its lines.
BUILD_FILE = "build_kernel.py"
SHARE_OF_A_BUILD_ANSWER_THAT_GIVES_IT_AWAY = 0.5


def solution_functions():
    """{(stage, library module, function name): exercise} for every public function of an exercise's
    solution file that its stage's library also defines at the top level: the library's copy of the
    solution (tests/course/test_solutions_are_library.py holds the two to the same code)."""
    from kdacourse.catalog import exercises

    found = {}
    for exercise in exercises():
        solution = REPO_ROOT / "solutions" / exercise.stage / exercise.file
        names = {node.name for node in ast.parse(solution.read_text()).body
                 if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}
        for folder, path in library_paths(exercise.stage):
            defined = {node.name for node in ast.parse(path.read_text()).body if isinstance(node, ast.FunctionDef)}
            for name in sorted(names & defined):
                found[(folder, path.name, name)] = exercise
    return found


def library_paths(stage):
    """[(folder under stages/, path)] of the library modules where `stage`'s exercise functions may
    live: the stage's LIBRARY_MODULES and, for a stage whose kernel.py teaches the kernel package, the
    package's modules."""
    paths = [(stage, REPO_ROOT / "stages" / stage / module) for module in LIBRARY_MODULES]
    kernel = REPO_ROOT / "stages" / stage / "kernel.py"
    if kernel.is_file() and f"stages.{KERNEL_PACKAGE}" in kernel.read_text():
        paths += [(KERNEL_PACKAGE, path) for path in sorted((REPO_ROOT / "stages" / KERNEL_PACKAGE).glob("*.py"))]
    return [(folder, path) for folder, path in paths if path.is_file()]


def exercise_functions():
    """{(stage, library module, function name): exercise} for every function of solution_functions(),
    every function an exercise names as a form of its answer (its catalog entry's `library_forms`), and
    every other library function (of any stage) that holds lines of a fill exercise's answer: a later
    stage's kernel may reuse an earlier stage's code, and would give that exercise away (the first such
    exercise in catalog order)."""
    from kdacourse.catalog import exercises

    found = solution_functions()
    for exercise in exercises():
        for form in exercise.library_forms:
            found[library_form(form)] = exercise
    fills = [(exercise, answer, SHARE_OF_A_BUILD_ANSWER_THAT_GIVES_IT_AWAY * len(answer)
              if exercise.file == BUILD_FILE else ANSWER_LINES_THAT_GIVE_IT_AWAY)
             for exercise in exercises() if exercise.kind == "fill" for answer in [answer_lines(exercise)]]
    for path in sorted((REPO_ROOT / "stages").glob("s[0-9][0-9]_*/*.py")) + sorted(
            (REPO_ROOT / "stages" / KERNEL_PACKAGE).glob("*.py")):
        if path.name not in LIBRARY_MODULES and path.parent.name != KERNEL_PACKAGE:
            continue
        source = path.read_text()
        lines = source.splitlines()
        for node in ast.parse(source).body:
            key = (path.parent.name, path.name, node.name) if isinstance(node, ast.FunctionDef) else None
            if key is None or key in found:
                continue
            held = {line.strip() for line in lines[node.lineno - 1:node.end_lineno]}
            given_to = next((exercise for exercise, answer, given_away in fills if len(answer & held) >= given_away), None)
            if given_to is not None:
                found[key] = given_to
    return found


def library_form(form):
    """"<folder>/<module>.py:<function>" (a catalog entry's `library_forms`) -> (folder, module, function);
    HandoutError unless stages/<folder>/<module>.py defines that function at its top level."""
    path, _, name = form.partition(":")
    folder, _, module = path.partition("/")
    source = REPO_ROOT / "stages" / folder / module
    defined = source.is_file() and any(isinstance(node, ast.FunctionDef) and node.name == name
                                       for node in ast.parse(source.read_text()).body)
    if not defined:
        raise HandoutError(f"the catalog names {form!r} as a form of an exercise's answer, and stages/{path} "
                           f"defines no function {name!r} at its top level")
    return folder, module, name


def answer_lines(exercise):
    """The lines of a fill exercise's solution region that its shipped file does not hold (code of 25
    characters or more, no comments): the answer."""
    from kdacourse.shipped import split_region

    region = split_region((REPO_ROOT / "solutions" / exercise.stage / exercise.file).read_text())[1]
    shipped = {line.strip() for line in (REPO_ROOT / "exercises" / exercise.stage / exercise.file).read_text().splitlines()}
    return {line.strip() for line in region.splitlines()
            if len(line.strip()) >= 25 and not line.strip().startswith("#") and line.strip() not in shipped}


def _function_spans(source):
    """{name: (first line, last line)} of the top-level functions, 1-based, decorators included."""
    spans = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            spans[node.name] = (first, node.end_lineno)
    return spans


def _call_arguments(arguments):
    """The text that passes a function's own parameters on: `a, b, *args, c=c, **kwargs`."""
    parts = [a.arg for a in (*arguments.posonlyargs, *arguments.args)]
    parts += [f"*{arguments.vararg.arg}"] if arguments.vararg else []
    parts += [f"{a.arg}={a.arg}" for a in arguments.kwonlyargs]
    parts += [f"**{arguments.kwarg.arg}"] if arguments.kwarg else []
    return ", ".join(parts)


def _delegating_body(name, exercise, arguments, indent):
    """The body of a stub that other exercises call: it runs the student's own function."""
    module = f"handout_exercise_{exercise.stage}_{Path(exercise.file).stem}"
    return (f"{indent}# Exercise {exercise.id}: a handout leaves it out of the library, and the exercises that use it\n"
            f"{indent}# call yours, exercises/{exercise.stage}/{exercise.file}.\n"
            f"{indent}import importlib.util\n"
            f"{indent}import sys\n"
            f"{indent}from pathlib import Path\n\n"
            f"{indent}if {module!r} not in sys.modules:\n"
            f"{indent}    path = Path(__file__).resolve().parents[2] / 'exercises' / {exercise.stage!r} / {exercise.file!r}\n"
            f"{indent}    spec = importlib.util.spec_from_file_location({module!r}, path)\n"
            f"{indent}    loaded = importlib.util.module_from_spec(spec)\n"
            f"{indent}    spec.loader.exec_module(loaded)\n"
            f"{indent}    sys.modules[{module!r}] = loaded\n"
            f"{indent}return sys.modules[{module!r}].{name}({_call_arguments(arguments)})\n")


def _exercise_docstring(exercise, name):
    """The docstring of `name` in the exercise file, as source lines (what the student reads anyway)."""
    source = (REPO_ROOT / "exercises" / exercise.stage / exercise.file).read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef) and node.name == name and ast.get_docstring(node) is not None:
            return "".join(source.splitlines(keepends=True)[node.body[0].lineno - 1:node.body[0].end_lineno])
    return ""


def _stub(source, name, exercise, delegate=False):
    """The function `name` of `source` with its body replaced by a NotImplementedError naming the
    exercise (or, with `delegate`, by a call of the student's function); its signature and decorators
    stay, and its docstring becomes the exercise's (the library's may explain the answer)."""
    lines = source.splitlines(keepends=True)
    node = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name)
    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
    body = node.body[0]
    has_docstring = isinstance(body, ast.Expr) and isinstance(body.value, ast.Constant) and isinstance(body.value.value, str)
    indent = re.match(r"\s*", lines[body.lineno - 1]).group(0)
    message = (f"{exercise.id} is an exercise: this handout leaves {name} out of the library. Write it in "
               f"exercises/{exercise.stage}/{exercise.file} (course check {exercise.stage.split('_')[0]})")
    if name not in _public_names(REPO_ROOT / "solutions" / exercise.stage / exercise.file):
        message = (f"{name} holds the answer of exercise {exercise.id} (exercises/{exercise.stage}/{exercise.file}), "
                   "so this handout leaves it out of the library; the instructor's copy of the course runs it")
    header = "".join(lines[first - 1:body.lineno - 1])
    docstring = _exercise_docstring(exercise, name) if has_docstring else ""
    body_text = docstring + (_delegating_body(name, exercise, node.args, indent) if delegate
                 else f"{indent}raise NotImplementedError({message!r})\n")
    stub = header + body_text
    return "".join(lines[:first - 1]) + stub + "".join(lines[node.end_lineno:])


def _public_names(path):
    return {node.name for node in ast.parse(path.read_text()).body
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_")}


def stub_library(out):
    """Replace every exercise function of the handout's library by a stub; returns
    {(stage, module, name): exercise}."""
    found = exercise_functions()
    used = used_by_exercises()
    for (stage, module, name), exercise in found.items():
        path = out / "stages" / stage / module
        path.write_text(_stub(path.read_text(), name, exercise, delegate=(stage, module, name) in used))
    return found


def used_by_exercises():
    """{(stage, module, name)} of the library functions that an exercise file imports."""
    used = set()
    for path in (REPO_ROOT / "solutions").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("stages.s"):
                parts = node.module.split(".")
                if len(parts) == 3:
                    used |= {(parts[1], parts[2] + ".py", alias.name) for alias in node.names}
    return used


# ---------------------------------------------------------------------------------------- pages


def _sections(source):
    """{section name: (first line, last line)} of the snippet sections of a source file, 1-based."""
    starts, sections = {}, {}
    for number, line in enumerate(source.splitlines(), 1):
        match = SECTION_MARK.search(line)
        if match and match["which"] == "start":
            starts[match["name"]] = number
        elif match and match["name"] in starts:
            sections[match["name"]] = (starts.pop(match["name"]), number)
    return sections


def _section_text(source, span):
    lines = source.splitlines()[span[0]:span[1] - 1]
    return textwrap.dedent("\n".join(line for line in lines if not SECTION_MARK.search(line)))


def _code_lines(text):
    """The lines of code of `text`, stripped, without comments or blank lines (to compare code)."""
    lines = []
    for line in text.splitlines():
        code = re.sub(r"\s+#.*$", "", line).strip()
        if code and not code.startswith("#"):
            lines.append(code)
    return lines


def _shown_in(section, exercise_source):
    """Whether every line of code of `section` is, in the same order and contiguous, in the exercise
    file that the student receives anyway."""
    wanted, have = _code_lines(section), _code_lines(exercise_source)
    if not wanted:
        return True
    return any(have[i:i + len(wanted)] == wanted for i in range(len(have) - len(wanted) + 1))


def _snippet_replacements(stubbed):
    """{(path, section): code to write into the page, or an italic line saying it is left out} for every
    snippet section of a library module that overlaps a stubbed function."""
    replacements = {}
    by_module = {}
    for (stage, module, name), exercise in stubbed.items():
        by_module.setdefault((stage, module), []).append((name, exercise))
    for (stage, module), functions in by_module.items():
        relative = f"stages/{stage}/{module}"
        source = (REPO_ROOT / relative).read_text()
        spans = _function_spans(source)
        for section, (first, last) in _sections(source).items():
            overlapping = [exercise for name, exercise in functions
                           if spans[name][0] <= last and first <= spans[name][1]]
            if not overlapping:
                continue
            text = _section_text(source, (first, last))
            shown = all(_shown_in(text, (REPO_ROOT / "exercises" / e.stage / e.file).read_text()) for e in overlapping)
            ids = " and ".join(f"`{e.id}`" for e in dict.fromkeys(overlapping))
            replacements[(relative, section)] = (text if shown else
                                                 f"*This code is the answer of exercise {ids}: a handout leaves it out.*")
    return replacements


def _without_answer_blocks(text):
    """`text` with each collapsed block opened "after" a check replaced by the no-solution line."""
    lines = text.splitlines()
    result, i = [], 0
    while i < len(lines):
        match = ANSWER_BLOCK.match(lines[i])
        if not match:
            result.append(lines[i])
            i += 1
            continue
        indent = len(match["indent"])
        i += 1
        while i < len(lines) and (not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent):
            i += 1
        result += [match["indent"] + NO_SOLUTION, ""]
    return "\n".join(result).rstrip("\n") + "\n"


def _with_snippets_replaced(text, replacements):
    """`text` with each snippet of a stubbed section written in (or, with its code fence, replaced by
    the no-solution line)."""
    lines = text.splitlines()
    result = []
    i = 0
    while i < len(lines):
        match = SNIPPET.match(lines[i])
        key = (match["path"], match["section"]) if match else None
        if key not in replacements:
            result.append(lines[i])
            i += 1
            continue
        indent = match["indent"]
        replacement = replacements[key]
        if not replacement.startswith("*"):  # code, written into the page
            result += [indent + line if line else "" for line in replacement.splitlines()]
            i += 1
            continue
        fenced = result and result[-1].strip().startswith("```") and i + 1 < len(lines) and lines[i + 1].strip() == "```"
        if fenced:
            result.pop()
            i += 1
        result.append(indent + replacement)
        i += 1
    return "\n".join(result).rstrip("\n") + "\n"


def _without_shipped_rows(text, shipped):
    """A kill matrix without the rows of the bugs that the exercises ship with."""
    kept = [line for line in text.splitlines() if not any(line.startswith(f"| `{bug}` ") for bug in shipped)]
    return "\n".join(kept) + "\n"


def _handout_text(text):
    """The page as the handout has it: each full-course text replaced by the handout's (FULL_COURSE_TEXT)."""
    new = FULL_COURSE_TEXT.sub(lambda match: match["handout"], text)
    if any(marker in new for marker in FULL_COURSE_MARKERS):
        raise HandoutError("a page holds a `<!-- full course -->` text without its `<!-- handout` one after it "
                           "(kdacourse/handout.py: FULL_COURSE_TEXT)")
    return new


def rewrite_pages(out, stubbed):
    """The handout's pages: no answer blocks, no snippets of stubbed code, no shipped bugs."""
    from kdacourse.catalog import exercises

    replacements = _snippet_replacements(stubbed)
    shipped = {exercise.bug for exercise in exercises() if exercise.bug}
    for path in sorted((out / "docs").rglob("*.md")):
        text = path.read_text()
        new = _with_snippets_replaced(_without_answer_blocks(_handout_text(text)), replacements)
        if path.name.endswith("kill_matrix.md"):
            new = _without_shipped_rows(new, shipped)
        new = new.replace('"The kill matrix, bug by test (it names the bugs the exercises ship with)"',
                          '"The kill matrix, bug by test (the bugs the exercises ship with left out)"')
        if new != text:
            path.write_text(new)
    leftover = [str(p.relative_to(out)) for p in (out / "docs").rglob("*.md")
                if any(SNIPPET.match(line) and (SNIPPET.match(line)["path"], SNIPPET.match(line)["section"]) in replacements
                       for line in p.read_text().splitlines())]
    if leftover:
        raise HandoutError(f"snippets of exercise code left in {', '.join(leftover)}")


# -------------------------------------------------------------------------------------- catalog


def _toml_value(value):
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return str(value)


def write_catalog(out):
    """The handout's catalog: every exercise, without the bug it ships with; no bug entries."""
    from kdacourse.catalog import exercises

    folder = out / "kdacourse" / "catalog"
    for path in folder.glob("*.toml"):
        path.unlink()
    by_stage = {}
    for exercise in exercises():
        by_stage.setdefault(exercise.stage, []).append(exercise)
    for stage, stage_exercises in by_stage.items():
        lines = [f"# {stage}'s exercises, as a student's handout has them: no bug entries (kdacourse/handout.py).", ""]
        for exercise in stage_exercises:
            lines.append("[[exercise]]")
            for field in ("id", "stage", "file", "kind", "points", "read", "forbidden"):
                value = getattr(exercise, field)
                if field == "forbidden" and not value:
                    continue
                lines.append(f"{field} = {_toml_value(value)}")
            lines.append("")
        (folder / f"{stage}.toml").write_text("\n".join(lines))


# ------------------------------------------------------------------------------- recorded values


def record_library_values(out):
    """Run the exercise tests that take values from the library (tests/exercises/library_values.py)
    on the solutions, here in the full course, recording those values into the handout."""
    tests = sorted(str(path.relative_to(REPO_ROOT)) for path in (REPO_ROOT / "tests" / "exercises").rglob("test_*.py")
                   if "from_library(" in path.read_text())
    print(f"recording the library's values for {len(tests)} test files (the solutions' tests, once)", flush=True)
    environment = dict(os.environ, COURSE_RECORD_EXPECTED=str(out / "tests" / "exercises"))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--target=solutions",
               "-m", "not compile", *tests]
    result = subprocess.run(command, cwd=REPO_ROOT, env=environment, capture_output=True, text=True)
    if result.returncode != 0:
        raise HandoutError(f"the tests that record the library's values failed on the solutions:\n{result.stdout[-3000:]}")


def main(argv=None):
    """`python -m kdacourse.handout OUT [--no-record]`: what make_handout runs in the snapshot it exports."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0].startswith("-") or set(argv[1:]) - {"--no-record"}:
        print("usage: python -m kdacourse.handout OUT [--no-record]  (in a snapshot; `course handout OUT` makes one)",
              file=sys.stderr)
        return 2
    return build_from_snapshot(argv[0], record="--no-record" not in argv)


if __name__ == "__main__":
    sys.exit(main())
