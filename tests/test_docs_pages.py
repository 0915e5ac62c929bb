"""The pages' Markdown, checked without building the site: section anchors, the stage pages' common
outline, and that everything a page includes from docs/generated/ is made by a registered generator.
Also the site's setup step: without npm it stops with a message that says what to install."""

import re

import pytest
from markdown.extensions.toc import slugify

from kdacourse import REPO_ROOT, site
from kdacourse.catalog import exercises
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
    included = [path for path in INCLUDE.findall(text) if path.startswith("docs/generated/")]
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
