"""The pages' Markdown, checked without building the site: section anchors, the stage pages' common
outline, and that everything a page includes from docs/generated/ is made by a registered generator.
Also the site's setup step: without npm it stops with a message that says what to install."""

import re

import pytest
from markdown.extensions.toc import slugify

from kdacourse import REPO_ROOT, site
from kdacourse.catalog import exercises, load_catalog
from kdacourse.pages import generators

DOCS = REPO_ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
STAGE_PAGES = [page for page in PAGES if re.match(r"s\d\d_", page.name)]
# The sections of a stage page, in this order (stage 1's page is the model the others copy).
STAGE_SECTIONS = [
    "What changes from the previous stage",
    "The math",
    "Reference A: token by token",
    "Reference B: chunk by chunk",
    "Reference C: the kernel's control flow",
    "The kernel",
    "Identities",
    "Numerics",
    "Exercises",
    "Known bugs",
    "What comes next",
]
INCLUDE = re.compile(r'^\s*--8<--\s+"([^"]+)"', re.MULTILINE)


def headings(page, level=None):
    """The page's Markdown headings (outside fenced code), without their {#id} or {.class} suffix."""
    found, fenced = [], False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        match = re.match(r"^(#{1,6})\s+(.*?)\s*(\{[^}]*\})?\s*$", line)
        if match and not fenced and (level is None or len(match.group(1)) == level):
            found.append(match.group(2))
    return found


def anchor(heading):
    """The anchor MkDocs gives a heading (Python-Markdown's toc slugify, as mkdocs.yml uses it)."""
    return slugify(heading, "-")


@pytest.mark.parametrize("exercise", exercises(), ids=lambda exercise: exercise.id)
def test_exercise_read_field_names_a_section(exercise):
    page, _, section = exercise.read.partition("#")
    path = DOCS / page
    assert path.is_file(), f"{exercise.id}: read = {exercise.read!r}, but docs/{page} does not exist"
    anchors = [anchor(heading) for heading in headings(path)]
    assert section in anchors, f"{exercise.id}: docs/{page} has no heading with anchor #{section}; it has {anchors}"


def test_anchor_matches_what_the_site_makes():
    assert anchor("Reference C: the kernel's control flow") == "reference-c-the-kernels-control-flow"
    assert anchor("`s01.recurrent` (fix)") == "s01recurrent-fix"


def test_stage_one_page_has_the_stage_outline():
    assert headings(DOCS / "s01_linear_attention.md", level=2) == STAGE_SECTIONS


def outline_section(heading):
    """A stage page's section as the outline names it: "What changes from stage 2" is the first."""
    return STAGE_SECTIONS[0] if heading.startswith("What changes from") else heading


@pytest.mark.parametrize("page", STAGE_PAGES, ids=lambda page: page.name)
def test_stage_page_sections_come_in_the_outline_order(page):
    """Every stage page starts like stage 1's, and the outline's sections it has come in its order."""
    sections = [outline_section(heading) for heading in headings(page, level=2)]
    assert sections and sections[0] == STAGE_SECTIONS[0], f"{page.name} starts with {sections[:1]}"
    present = [section for section in sections if section in STAGE_SECTIONS]
    assert present == sorted(present, key=STAGE_SECTIONS.index), f"{page.name}: sections out of order: {present}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_generated_content_comes_from_a_generator(page):
    """What a page includes or shows from docs/generated/ is written by a registered generator."""
    registered = set(generators())
    text = page.read_text(encoding="utf-8")
    included = [re.sub(r"(:-?\d*)+$", "", path)  # `file:2` includes the file from its line 2
                for path in INCLUDE.findall(text) if path.startswith("docs/generated/")]
    shown = ["docs/" + path for path in re.findall(r"\]\((generated/[^)#\s]+)\)", text)]
    for path in included + shown:
        assert path in registered, f"{page.name} uses {path}, which no generator writes (kdacourse/pages/)"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_included_files_and_sections_exist(page):
    """Each `--8<-- "file"` or `--8<-- "file:section"` names a file with that section's markers."""
    for include in INCLUDE.findall(page.read_text(encoding="utf-8")):
        path, _, section = include.partition(":")
        source = REPO_ROOT / path
        assert source.is_file(), f"{page.name} includes {path}, which does not exist"
        if section and not section.replace(":", "").isdigit():
            text = source.read_text(encoding="utf-8")
            for marker in (f"--8<-- [start:{section}]", f"--8<-- [end:{section}]"):
                assert marker in text, f"{page.name} includes {include}, but {path} has no '{marker}'"


def nav_pages():
    """The pages of mkdocs.yml's nav, in order (read as text: the file uses MkDocs' own YAML tags)."""
    text = (REPO_ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    nav = text.split("\nnav:\n", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^\s+- .*:\s*(\S+\.md)\s*$", nav, flags=re.MULTILINE)


def test_nav_has_every_page_once_and_the_stages_in_order():
    pages = nav_pages()
    assert sorted(pages) == sorted(page.name for page in PAGES), "docs/*.md and mkdocs.yml's nav differ"
    stages = [page for page in pages if re.match(r"s\d\d_", page)]
    assert stages == sorted(stages), f"stage pages out of order in the nav: {stages}"
    assert pages.index(stages[0]) == pages.index("exercises.md") + 1, "stage pages follow 'How to work the exercises'"
    assert pages.index(stages[-1]) + 1 == pages.index("numerics.md"), "stage pages come as one block before Numerics"


def test_readme_lists_the_course_commands_as_the_cli_does():
    import textwrap

    from kdacourse import cli

    listing = textwrap.dedent(cli.__doc__.split("\n\n")[1]).strip()
    assert listing in (REPO_ROOT / "README.md").read_text(encoding="utf-8"), "README's `course` list differs from cli.py's"


def test_command_help_says_what_the_course_does(capsys):
    """`course test --help` is the course's help (not pytest's hundreds of lines); `serve --port` has one."""
    from kdacourse import cli

    assert cli.main(["test", "--help"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("usage: course test") and "ruff" in text and len(text.splitlines()) < 20, text[:2000]
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    assert re.search(r"--port PORT[ \t]+\S", capsys.readouterr().out), "course serve --port has no help"


def test_readme_links_to_pages_that_exist():
    for link in re.findall(r"\]\((docs/[^)#]+)", (REPO_ROOT / "README.md").read_text(encoding="utf-8")):
        assert (REPO_ROOT / link).is_file(), f"README links to {link}, which does not exist"


def test_build_without_npm_says_what_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(site, "VENDOR_DIR", tmp_path / "vendor" / "mathjax")  # nothing vendored yet
    monkeypatch.setattr(site.shutil, "which", lambda name: None)
    with pytest.raises(site.SetupError, match="npm"):
        site.vendor_mathjax()
    assert site.build(site_dir=tmp_path / "site") == 1
    message = capsys.readouterr().err
    assert "Install Node.js and npm" in message and "apt-get install nodejs npm" in message
    assert not (tmp_path / "site").exists(), "the build went on without MathJax"


def test_mathjax_setup_is_silent_when_done(capsys):
    site.vendor_mathjax()  # vendors it if this checkout has not yet
    capsys.readouterr()
    site.vendor_mathjax()
    assert capsys.readouterr().out == ""
    assert site.mathjax_is_vendored()


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_headings_hold_no_math(page):
    """The table of contents shows headings as plain text, where MathJax never runs: a formula in a
    heading appears there as raw TeX. Headings use words or Unicode (β, γ) instead."""
    headings, in_code = [], False
    for line in (DOCS / page).read_text().splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            in_code = not in_code
        elif line.startswith("#") and not in_code:
            headings.append(line)
    assert not [h for h in headings if "$" in h or "\\(" in h], f"{page}: math in a heading"


# A page never shows the answer to an exercise before the exercise (DESIGN.md, "Exercises"): the
# code of a function that is an exercise appears after its subsection, or in another form. A collapsed
# block is no exception: its title may ask the reader to wait ("open after your kernel exercise
# passes"), but one click opens it, and the handout drops only such blocks, so the public site would
# still show it above the exercise. (The check once read the page as a reader sees it unopened, and
# missed stage 2's whole kernel program, collapsed above `s02.kernel_program`.)
SECTION_MARKER = re.compile(r"--8<--\s*\[(start|end):[^\]]*\]")
COLLAPSED = re.compile(r"^(\s*)\?\?\?(?!\+)\s")  # `??? kind "title"`; `???+` opens expanded


def included_lines(include):
    """The lines `--8<-- "file"` or `--8<-- "file:section"` puts on the page, markers stripped."""
    path, _, section = include.partition(":")
    lines = (REPO_ROOT / path).read_text(encoding="utf-8").splitlines()
    if section and not section.replace(":", "").isdigit():
        start, end = f"--8<-- [start:{section}]", f"--8<-- [end:{section}]"
        first = next(i for i, line in enumerate(lines) if start in line)
        last = next(i for i, line in enumerate(lines) if end in line and i > first)
        lines = lines[first + 1:last]
    return [line for line in lines if not SECTION_MARKER.search(line)]


def page_lines(lines, collapsed=True):
    """What the page holds, includes expanded; with collapsed=False, only what a reader sees without
    opening anything (collapsed blocks dropped)."""
    shown, collapsed_at = [], None
    for line in lines:
        indent = len(line) - len(line.lstrip())
        if collapsed_at is not None and (not line.strip() or indent > collapsed_at):
            continue
        collapsed_at = None
        match = COLLAPSED.match(line)
        if match and not collapsed:
            collapsed_at = len(match.group(1))
            continue
        include = INCLUDE.match(line)
        shown.extend(included_lines(include.group(1)) if include else [line])
    return shown


def code_lines(lines):
    """Lines as code compares them: comments and surrounding blanks dropped, empty lines skipped."""
    stripped = (re.sub(r"\s+#.*$", "", line).strip() for line in lines)
    return [line for line in stripped if line and not line.startswith("#")]


def region_lines(exercise):
    """The lines of the solution's EXERCISE region: the answer of a fill exercise."""
    text = (REPO_ROOT / "solutions" / exercise.stage / exercise.file).read_text(encoding="utf-8")
    return code_lines(text.split("# EXERCISE BEGIN", 1)[1].split("# EXERCISE END", 1)[0].splitlines())


def above_exercise(exercise):
    """The page's lines before the exercise's own subsection (the whole page if none), collapsed
    blocks included."""
    page = DOCS / exercise.read.partition("#")[0]
    lines = page.read_text(encoding="utf-8").splitlines()
    heading = re.compile(rf"^###\s+`{re.escape(exercise.id)}`")
    end = next((i for i, line in enumerate(lines) if heading.match(line)), len(lines))
    return page, code_lines(page_lines(lines[:end]))


def runs_in(needle, haystack):
    return any(haystack[i:i + len(needle)] == needle for i in range(len(haystack) - len(needle) + 1))


@pytest.mark.parametrize("exercise", exercises(), ids=lambda exercise: exercise.id)
def test_page_shows_no_solution_before_the_exercise(exercise):
    """A fill exercise's answer lines, or a fix or tune exercise's fixed lines (for a tune exercise,
    the economical code its wasteful program replaced), are not on the page above it, in a collapsed
    block or not."""
    page, shown = above_exercise(exercise)
    if exercise.kind == "fill":
        answer = set(line for line in region_lines(exercise) if len(line) >= 16)
        seen = sorted(answer & set(shown))
        assert len(seen) < max(3, len(answer) / 2), (
            f"docs/{page.name} shows {len(seen)} of the {len(answer)} lines of {exercise.id}'s solution above "
            f"its subsection (collapsed blocks count too), e.g. {seen[:3]}: move that code into a "
            f'`??? success "Solution (open after your check passes)"` block after the exercise')
    else:
        fixed = code_lines(load_catalog()[1][exercise.bug].find.splitlines())
        assert not runs_in(fixed, shown), (
            f"docs/{page.name} shows the fixed line(s) of {exercise.id} above its subsection (collapsed "
            f"blocks count too): {fixed}: move that code into a block after the exercise")


@pytest.mark.parametrize("page", STAGE_PAGES, ids=lambda page: page.name)
def test_no_prose_above_known_bugs_names_a_shipped_bug(page):
    """The bug an exercise ships with is not named above "Known bugs" (included tables too)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    end = next((i for i, line in enumerate(lines) if line.strip() == "## Known bugs"), len(lines))
    text = "\n".join(page_lines(lines[:end], collapsed=False))
    shipped = sorted(exercise.bug for exercise in exercises() if exercise.bug)
    named = [bug for bug in shipped if re.search(rf"(?<![\w-]){re.escape(bug)}(?![\w-])", text)]
    assert not named, f"{page.name} names shipped bug(s) {named} above its Known bugs section"


KERNEL_EXERCISE_FILES = ("kernel_program.py", "build_kernel.py", "tune_kernel.py")
KERNEL_EXERCISES = [exercise for exercise in exercises() if exercise.file in KERNEL_EXERCISE_FILES]
MOST_OF_A_KERNEL_ANSWER_ABOVE = 0.2  # share of its solution's lines a page may show above a kernel exercise
TRIVIAL_LINE = re.compile(r"^([)\]}:,]+|return \w+|else:|pass|break|continue)$")


def answer_lines(exercise):
    """The solution's region lines that say something: not trivial (`)`, `return out`, `else:`)."""
    return [line for line in region_lines(exercise) if not TRIVIAL_LINE.match(line)]


@pytest.mark.parametrize("exercise", KERNEL_EXERCISES, ids=lambda exercise: exercise.id)
def test_page_above_a_kernel_exercise_shows_little_of_its_solution(exercise):
    """At most a fifth of a kernel exercise's solution lines appear, verbatim, anywhere on the page above
    its subsection (in code, a table cell or prose; collapsed blocks count too): a table that maps
    reference C to the kernel line by line belongs in the exercise's hints, after it. Tune exercises
    too: their answer is the stage's kernel, so its listing comes after the last kernel exercise."""
    page, shown = above_exercise(exercise)
    text = "\n".join(shown)
    answer = answer_lines(exercise)
    seen = [line for line in answer if line in text]
    assert len(seen) <= MOST_OF_A_KERNEL_ANSWER_ABOVE * len(answer), (
        f"docs/{page.name} shows {len(seen)} of the {len(answer)} lines of {exercise.id}'s solution above its "
        f"subsection (at most {MOST_OF_A_KERNEL_ANSWER_ABOVE:.0%}), e.g. {seen[:4]}: move them after the exercise, "
        'into its `??? tip "Hint N"` blocks or its solution block')


@pytest.mark.parametrize("exercise", exercises(), ids=lambda exercise: exercise.id)
def test_every_exercise_has_a_place_on_the_path(exercise):
    """docs/index.md's path through the course orders each stage's exercises by the catalog's
    `difficulty` (1 to 5) and states its `minutes`: every exercise has both."""
    assert exercise.difficulty in range(1, 6), f"{exercise.id}: difficulty = {exercise.difficulty!r}, expected 1 to 5"
    assert isinstance(exercise.minutes, int) and exercise.minutes > 0, (
        f"{exercise.id}: minutes = {exercise.minutes!r}, expected an estimate of a student's minutes")
