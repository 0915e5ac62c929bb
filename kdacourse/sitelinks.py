"""Where a catalog `read` field ("page.md#anchor") is on the built site: the page's title, the
section's heading, and its URL as `course serve` serves it.

    read_location("s04_kda.md#reference-a-token-by-token")
        -> "page 'Stage 4: Kimi Delta Attention', section 'Reference A: token by token'"
    read_url("s04_kda.md#reference-a-token-by-token")
        -> "http://127.0.0.1:8000/s04_kda/#reference-a-token-by-token"

Students read the site, not docs/*.md, whose code snippets are unexpanded. The URL follows MkDocs'
directory URLs (docs/x.md is served at /x/, docs/index.md at /) and the anchors Python-Markdown's
toc extension gives headings; tests/course/test_sitelinks.py checks both against a real build.
"""

import re
import unicodedata
from pathlib import Path

from kdacourse import REPO_ROOT

DOCS = REPO_ROOT / "docs"
SITE_URL = "http://127.0.0.1:8000/"  # `course serve`'s default port (kdacourse.site.site_url)


def read_location(read, docs=DOCS):
    """The page's title and the section's heading: "page '<title>', section '<heading>'".

    Where the page has no heading with that anchor, the section is named by its anchor.
    """
    page, _, anchor = read.partition("#")
    location = f"page '{page_title(docs / page)}'"
    if not anchor:
        return location
    return f"{location}, section '{heading_with_anchor(docs / page, anchor)}'"


def read_url(read, site_url=SITE_URL):
    """The URL of the page and section on the served site."""
    page, _, anchor = read.partition("#")
    path = "" if page == "index.md" else page.removesuffix(".md").removesuffix("/index") + "/"
    return site_url + path + (f"#{anchor}" if anchor else "")


def _headings(page_path):
    """(level, text) of the page's headings, outside fenced code; an {#id} suffix dropped."""
    if not Path(page_path).is_file():
        return []
    headings, fenced = [], False
    for line in Path(page_path).read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            text = re.sub(r"\s*\{[^}]*\}\s*$", "", line.lstrip("#").strip())
            headings.append((len(line) - len(line.lstrip("#")), text))
    return headings


def page_title(page_path):
    """The page's first level-one heading (its title on the site), else its file name."""
    return next((text for level, text in _headings(page_path) if level == 1), Path(page_path).name)


def heading_with_anchor(page_path, anchor):
    return next((text for _, text in _headings(page_path) if anchor_of(text) == anchor), f"#{anchor}")


def anchor_of(heading):
    """The anchor Python-Markdown's toc extension (and so MkDocs) gives a heading."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)
