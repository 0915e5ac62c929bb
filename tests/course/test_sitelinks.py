"""What `course check` tells a student to read: every catalog `read` field names a page and section
of the built site, and its URL is where a real `course build` put that section."""

import re
from pathlib import Path

import pytest

from kdacourse.catalog import exercises
from kdacourse.site import build, site_url
from kdacourse.sitelinks import SITE_URL, read_location, read_url


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    folder = tmp_path_factory.mktemp("site")
    assert build(site_dir=folder, quiet=True) == 0
    return folder


def test_location_names_the_page_title_and_the_heading(tmp_path):
    (tmp_path / "page.md").write_text("# The page\n\n```python\n# not a heading\n```\n\n"
                                      "## Reference B: chunk by chunk\n\ntext\n")
    assert read_location("page.md#reference-b-chunk-by-chunk", tmp_path) == \
        "page 'The page', section 'Reference B: chunk by chunk'"
    assert read_location("page.md#not-a-heading", tmp_path) == "page 'The page', section '#not-a-heading'"
    assert read_location("page.md", tmp_path) == "page 'The page'"


def test_urls_follow_mkdocs_directory_layout():
    assert SITE_URL == site_url(8000)
    assert read_url("s04_kda.md#reference-a-token-by-token") == \
        "http://127.0.0.1:8000/s04_kda/#reference-a-token-by-token"
    assert read_url("index.md") == "http://127.0.0.1:8000/"
    assert read_url("setup.md", "http://127.0.0.1:8001/") == "http://127.0.0.1:8001/setup/"


@pytest.mark.parametrize("exercise", exercises(), ids=lambda exercise: exercise.id)
def test_every_read_field_is_a_section_of_the_built_site(site, exercise):
    url = read_url(exercise.read, "/")
    page, _, anchor = url.partition("#")
    html = (Path(site) / page.strip("/") / "index.html").read_text(encoding="utf-8")
    assert f'id="{anchor}"' in html, f"{exercise.read}: no section #{anchor} on the built page {page}"
    heading = re.search(r"section '(.*)'$", read_location(exercise.read))[1]
    assert not heading.startswith("#"), f"{exercise.read}: the page has no heading with that anchor"
