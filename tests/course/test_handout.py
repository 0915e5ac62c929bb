"""`course handout OUT`: what a student receives has no answers, and still works on its own.

One full handout is made per run (half a minute: the export of the commit, the copy, then the
solutions' tests that record the library's values). In it: no solutions/, no bug catalog, the
library's exercise functions are stubs, no distinctive line of a fill exercise's solution anywhere
(files and built site), the site builds with --strict; its exercise tests pass on the solutions
copied in from this course and fail on the exercises as shipped; `course check --target=solutions`
and `course regenerate` refuse; its README is the students'. Every stage is covered: the exercise
tests of all stages take about 5 s here.

The handout is made from the commit, not the working tree: in a clone of the course, an exercise
solved and a page edited without a commit do not reach a second handout (made without recording
values, a few seconds), and the clone without its git history is refused.
"""

import ast
import html
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from kdacourse import REPO_ROOT
from kdacourse.catalog import exercises
from kdacourse.handout import exercise_functions
from kdacourse.shipped import split_region

PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not compile and not gpu"]


def _run(command, cwd, timeout=600):
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _git(*arguments, cwd=REPO_ROOT):
    result = _run(["git", *arguments], cwd)
    assert result.returncode == 0, f"git {arguments}: {result.stderr}"
    return result.stdout.strip()


def _tracked_files_commit():
    """A commit of the working tree's tracked files as they are now (`git stash create`, which no
    branch holds and which changes nothing), or HEAD when they are as committed: the handout is
    made from a commit, and the tests check the code as edited, not as last committed."""
    return _git("stash", "create") or "HEAD"


MAKE_HANDOUT = "import sys; from kdacourse.handout import make_handout; sys.exit(make_handout(*sys.argv[1:2], {}))"


@pytest.fixture(scope="module")
def handout(tmp_path_factory):
    out = tmp_path_factory.mktemp("handout") / "course"
    code = MAKE_HANDOUT.format(f"commit={_tracked_files_commit()!r}")
    result = _run([sys.executable, "-c", code, str(out)], REPO_ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    return out


def _library_names():
    """{stage: names of the public functions of its solution files}."""
    names = {}
    for exercise in exercises():
        tree = ast.parse((REPO_ROOT / "solutions" / exercise.stage / exercise.file).read_text())
        names.setdefault(exercise.stage, set()).update(
            node.name for node in tree.body if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"))
    return names


# Second answers to the build, tune and chunkwise exercises, kept out of the handout (tests/course/test_build_exercises.py,
# tests/course/test_tune_exercises.py, tests/course/test_chunked_answers.py): they hold answer lines as the solutions do.
SECOND_ANSWERS = {("tests", "build_alternatives"), ("tests", "tuned_programs"), ("tests", "chunkwise_alternatives")}


def distinctive_solution_lines():
    """{fill exercise id: lines of its solution region that the course shows nowhere but in the
    solution and in the library function it asks for}: text a handout must not hold."""
    from kdacourse.handout import exercise_functions

    left_out = {}  # {(stage, module): names the handout stubs}
    for stage, module, name in exercise_functions():
        left_out.setdefault((stage, module), set()).add(name)
    corpus = []
    for pattern in ("exercises/**/*.py", "tests/**/*.py", "kdacourse/**/*.py", "docs/**/*.md", "stages/**/*.py"):
        for path in REPO_ROOT.glob(pattern):
            if path.relative_to(REPO_ROOT).parts[:2] in SECOND_ANSWERS:
                continue
            text = path.read_text()
            names = left_out.get((path.parent.name, path.name), set())
            if path.relative_to(REPO_ROOT).parts[0] == "stages" and names:
                lines = text.splitlines(keepends=True)
                functions = [node for node in ast.parse(text).body
                             if isinstance(node, ast.FunctionDef) and node.name in names]
                for node in sorted(functions, key=lambda node: -node.lineno):
                    del lines[node.lineno - 1:node.end_lineno]
                text = "".join(lines)
            corpus.append(text)
    corpus = "\n".join(corpus)
    found = {}
    for exercise in exercises():
        if exercise.kind != "fill":
            continue
        region = split_region((REPO_ROOT / "solutions" / exercise.stage / exercise.file).read_text())[1]
        lines = {line.strip() for line in region.splitlines() if len(line.strip()) >= 25 and not line.strip().startswith("#")}
        found[exercise.id] = sorted(line for line in lines if line not in corpus)
    return found


def test_every_fill_exercise_has_distinctive_lines():
    """Otherwise the search below would prove nothing for that exercise. No exception: a build
    exercise's answer (the stage's kernel, written whole) is held by no file the handout ships, since
    the fix and tune exercises ship other programs (tests/course/test_build_answers_not_shipped.py)."""
    empty = sorted(name for name, lines in distinctive_solution_lines().items() if not lines)
    assert not empty, f"no distinctive solution line to search the handout for: {empty}"


def test_no_solutions_and_no_bug_catalog(handout):
    assert not (handout / "solutions").exists()
    assert (handout / "HANDOUT.md").is_file()
    for path in (handout / "kdacourse" / "catalog").glob("*.toml"):
        text = path.read_text()
        assert "[[bug]]" not in text and "find =" not in text and "\nbug =" not in text, path.name
    shipped_bugs = {exercise.bug for exercise in exercises() if exercise.bug}
    generated = handout / "docs" / "generated"
    for path in [*generated.glob("catalog/*.md"), generated / "kill_matrix.md"]:
        for bug in shipped_bugs:
            assert f"`{bug}`" not in path.read_text(), f"{path.name} names {bug}, which an exercise ships with"


def test_exercise_functions_are_stubs(handout):
    stubbed = exercise_functions()
    assert {name for _, _, name in stubbed} >= {"recurrent", "chunkwise", "kernel_mirror", "build_program",
                                                "decay_table", "chunk_system", "block_inverse", "build_prepare_program",
                                                "anchored_scores_macro"}  # a library form of s05.intra_chunk_scores
    for (stage, module, name), exercise in stubbed.items():
        tree = ast.parse((handout / "stages" / stage / module).read_text())
        function = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == name)
        body = function.body[1:] if isinstance(function.body[0], ast.Expr) else function.body
        code = ast.unparse(ast.Module(body=body, type_ignores=[]))
        raises = len(body) == 1 and isinstance(body[0], ast.Raise) and "NotImplementedError" in code
        delegates = f"'exercises' / {exercise.stage!r} / {exercise.file!r}" in code  # calls the student's
        assert raises or delegates, f"{stage}/{module}: {name} is not a stub:\n{code}"
        if raises:
            assert exercise.id in code


def test_a_library_form_names_a_function_the_library_defines():
    """A catalog entry's `library_forms` (functions holding the answer in another form, which the handout
    stubs) resolve to top-level functions; a name the library lacks is refused, not skipped."""
    from kdacourse.handout import HandoutError, library_form

    forms = [form for exercise in exercises() for form in exercise.library_forms]
    assert "kda/tiles.py:anchored_scores_macro" in forms
    for form in forms:
        library_form(form)
    with pytest.raises(HandoutError, match="defines no function 'no_such_macro'"):
        library_form("kda/tiles.py:no_such_macro")


def _site_text(site):
    """The built site's pages as text: tags dropped, entities decoded."""
    return {path: html.unescape(re.sub(r"<[^>]+>", "", path.read_text(errors="replace")))
            for path in site.rglob("*.html")}


def test_site_builds_and_holds_no_solution(handout, tmp_path):
    site = tmp_path / "site"
    result = _run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], handout)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    texts = {path: path.read_text(errors="replace") for path in handout.rglob("*")
             if path.is_file() and path.suffix in (".py", ".md", ".toml", ".txt", ".yml", ".js", ".csv", ".json")}
    texts.update(_site_text(site))
    for exercise_id, lines in distinctive_solution_lines().items():
        for line in lines:
            holders = [str(path) for path, text in texts.items() if line in text]
            assert not holders, f"{exercise_id}'s solution line {line!r} is in the handout: {holders}"
    stage_pages = "".join(texts[handout / "docs" / f"{stage}.md"] for stage in {e.stage for e in exercises()})
    assert "Solution (open after your check passes)" not in stage_pages
    pages = "".join(text for path, text in texts.items() if path.suffix == ".html" or path.is_relative_to(handout / "docs"))
    assert "The bugs the exercises ship with (open after" not in pages


def _failing_files(junit):
    """{test file: number of failed or errored tests} from a JUnit XML report."""
    failing = {}
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            name = case.get("classname", "")
            failing[name] = failing.get(name, 0) + 1
    return failing


def test_exercise_tests_pass_on_the_solutions_and_fail_as_shipped(handout, tmp_path):
    with_solutions = tmp_path / "with_solutions"
    shutil.copytree(handout, with_solutions)
    for exercise in exercises():
        shutil.copy(REPO_ROOT / "solutions" / exercise.stage / exercise.file,
                    with_solutions / "exercises" / exercise.stage / exercise.file)
    result = _run([*PYTEST, "tests/exercises"], with_solutions)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "skipped" not in result.stdout.splitlines()[-1], result.stdout[-2000:]  # every value was recorded

    junit = tmp_path / "shipped.xml"
    result = _run([*PYTEST, f"--junitxml={junit}", "tests/exercises"], handout)
    assert result.returncode == 1, result.stdout[-4000:]
    failing = _failing_files(junit)
    for exercise in exercises():
        module = f"tests.exercises.{exercise.stage}.test_{Path(exercise.file).stem}"
        assert failing.get(module), f"{exercise.id}: no test fails on the exercise as shipped, in the handout"


def test_commands_that_need_the_full_course_refuse(handout):
    course = [sys.executable, "-m", "kdacourse.cli"]
    check = _run([*course, "check", "s01", "--target=solutions"], handout)
    assert check.returncode != 0 and "student handout" in check.stdout + check.stderr
    for command in (["regenerate"], ["test"], ["handout", str(handout.parent / "again")]):
        result = _run([*course, *command], handout)
        assert result.returncode == 2 and "handout" in result.stderr, (command, result.stderr)


def test_readme_is_the_students(handout):
    """Setup, `course check`, the pages, how to hand in; nothing of the instructor's."""
    readme = (handout / "README.md").read_text()
    for needed in ("make setup", "course check", "course serve", "docs/", "Hand in", "exercises/"):
        assert needed in readme, f"the handout's README does not say {needed!r}"
    for instructors in ("make test", "solutions/", "course test [", "course grade FOLDER", "regenerate every"):
        assert instructors not in readme, f"the handout's README says {instructors!r}, which is the instructor's"
    for link in re.findall(r"\]\(([^)#]+)", readme):
        assert (handout / link).is_file(), f"the handout's README links to {link}, which the handout lacks"


def test_full_course_texts_give_way_to_the_handouts():
    """On the course's exercises page, each text marked as the full course's gives way to the handout's
    (the handout built below shows it in place); a marker without its handout text is refused."""
    from kdacourse.handout import HandoutError, _handout_text

    page = (REPO_ROOT / "docs" / "exercises.md").read_text()
    assert "--target=bug:" in page and "<!-- full course -->" in page
    handout_page = _handout_text(page)
    assert "the solutions are with your instructor" in handout_page
    assert not any(text in handout_page for text in ("solutions/", "bug:", "<!-- full course", "<!-- handout"))
    with pytest.raises(HandoutError, match="without its"):
        _handout_text("<!-- full course -->\nthe solutions/ folder\n")


def test_readme_and_pages_describe_the_handout(handout):
    """The README names the Python the course needs (pyproject.toml's requires-python); the exercises
    page names no solutions/, no --target=solutions and no bug target, which a handout lacks; no page
    keeps the full course's text."""
    import tomllib

    requires = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    version = re.fullmatch(r">=\s*(3\.\d+)", requires)[1]
    readme = (handout / "README.md").read_text()
    assert f"Python {version} or newer" in readme and "3.10" not in readme
    page = (handout / "docs" / "exercises.md").read_text()
    assert "the solutions are with your instructor" in page
    for full_course in ("solutions/", "--target=solutions", "bug:"):
        assert full_course not in page, f"the handout's exercises page says {full_course!r}"
    for path in (handout / "docs").rglob("*.md"):
        assert "<!-- full course" not in path.read_text(), f"{path.name} keeps the full course's text"


def test_pages_give_no_command_the_handout_cannot_run(handout):
    """No page but the instructors' (their commands run in the instructor's copy) names a solutions or
    bug target, and no code block of one runs pytest on tests the handout leaves out (tests/stages,
    tests/kernels, ...). A command cited in the text as the source of a number stays: it says how the
    course made it."""
    for path in sorted((handout / "docs").glob("*.md")):
        if path.name == "instructors.md":
            continue
        text = path.read_text()
        for target in ("--target=solutions", "--target=bug:"):
            assert target not in text, f"the handout's {path.name} gives a command with {target}, which a handout lacks"
        code_blocks = "\n".join(re.findall(r"^```.*?^```", text, re.S | re.M))
        for command in re.findall(r"pytest((?: +tests/\S+)+)", code_blocks):
            for test_path in command.split():
                assert (handout / test_path.split("::")[0]).exists(), (
                    f"the handout's {path.name} runs pytest on {test_path}, which the handout leaves out")


def test_handout_is_made_from_the_commit_not_the_working_tree(tmp_path):
    """An instructor solves an exercise and edits a page in their copy without committing: the
    handout holds the exercise as shipped and the page as committed, and stderr names what it left out."""
    clone = tmp_path / "course"
    _git("clone", "--quiet", "--shared", "--no-checkout", str(REPO_ROOT), str(clone))  # shared: the stash commit too
    _git("checkout", "--quiet", "--detach", _git("rev-parse", _tracked_files_commit()), cwd=clone)
    stage = "s01_linear_attention"
    solved = clone / "exercises" / stage / "kernel_program.py"
    shipped = solved.read_text()
    solution = (clone / "solutions" / stage / "kernel_program.py").read_text()
    assert shipped != solution
    solved.write_text(solution)
    page = clone / "docs" / f"{stage}.md"
    page.write_text(page.read_text() + "\nAn instructor's note, not committed.\n")
    (clone / "exercises" / stage / "my_attempt.py").write_text("# not committed\n")

    out = tmp_path / "handout"
    result = _run([sys.executable, "-c", MAKE_HANDOUT.format("record=False"), str(out)], clone)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (out / "exercises" / stage / "kernel_program.py").read_text() == shipped, "the solved exercise reached the handout"
    assert "An instructor's note" not in (out / "docs" / f"{stage}.md").read_text()
    assert not (out / "exercises" / stage / "my_attempt.py").exists()
    assert _git("rev-parse", "HEAD", cwd=clone) in (out / "HANDOUT.md").read_text()
    for line in (f"modified     exercises/{stage}/kernel_program.py", f"modified     docs/{stage}.md",
                 f"untracked    exercises/{stage}/my_attempt.py"):
        assert line in result.stderr, f"stderr does not list {line!r}:\n{result.stderr}"

    shutil.rmtree(clone / ".git")
    out = tmp_path / "from_no_checkout"
    result = subprocess.run([sys.executable, "-c", MAKE_HANDOUT.format("record=False"), str(out)], cwd=clone,
                            capture_output=True, text=True, env={**os.environ, "GIT_CEILING_DIRECTORIES": str(tmp_path)})
    assert result.returncode == 2 and "is not a git checkout" in result.stderr, result.stderr
    assert not out.exists()
