"""The course site as a reader sees it: built with --strict, served on localhost, opened in Chromium.

The build runs once per session. The browser tests drive Debian's Chromium (/usr/bin/chromium) with
Playwright; no browser is downloaded. Without Chromium they skip, except under CI (the environment
variable CI set), where they fail: CI installs Chromium in .ci/run. Screenshots of the stage pages go
to build/screenshots/ (ignored by git; CI keeps them as artifacts).

On every page: the math is typeset (no raw TeX left, MathJax's mjx-container elements present), the
console shows no error, no request leaves localhost, every internal link and image answers 200 (and
every link's #fragment exists on its page), and no code block is empty.
"""

import os
import re
import shutil
import tempfile
import threading
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from kdacourse import REPO_ROOT
from kdacourse.site import build, make_server, site_url

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
SCREENSHOTS = REPO_ROOT / "build" / "screenshots"
DOCS = REPO_ROOT / "docs"
PAGES = sorted(path.relative_to(DOCS).as_posix() for path in DOCS.glob("*.md"))
STAGE_PAGES = [page for page in PAGES if re.match(r"s\d\d_", page)]
RAW_TEX = re.compile(r"\\\(|\\\)|\\\[|\\\]|\$\$|\\begin\{")


def page_url(base, page):
    """'index.md' -> base; 'setup.md' -> base + 'setup/' (MkDocs' directory URLs)."""
    return base if page == "index.md" else base + page.removesuffix(".md") + "/"


# ------------------------------------------------------------------------------ build and serve


@pytest.fixture(scope="session")
def site():
    """The site built with --strict into a temporary folder and served on a free localhost port."""
    folder = Path(tempfile.mkdtemp(prefix="course-site-"))
    server = make_server(0, directory=folder)
    port = server.server_address[1]
    code = build(site_dir=folder, quiet=True, port=port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield {"code": code, "folder": folder, "url": site_url(port)}
    server.shutdown()
    server.server_close()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def built(site):
    if site["code"] != 0:
        pytest.fail("`mkdocs build --strict` failed: see test_site_builds_with_strict", pytrace=False)
    return site


def test_site_builds_with_strict(site):
    assert site["code"] == 0, "mkdocs build --strict failed: run `course build` to see why"


def test_every_page_is_built_and_served(built):
    for page in PAGES:
        with urllib.request.urlopen(page_url(built["url"], page)) as response:
            assert response.status == 200, page


def test_mathjax_is_served_by_the_site(built):
    html = (built["folder"] / "index.html").read_text()
    scripts = re.findall(r'<script src="([^"]+)"', html)
    assert any(s.endswith("javascripts/vendor/mathjax/tex-chtml-full.js") for s in scripts), scripts
    assert not [s for s in scripts if s.startswith(("http:", "https:", "//"))], scripts
    fonts = list((built["folder"] / "javascripts/vendor/mathjax/output/chtml/fonts/woff-v2").glob("*.woff"))
    assert fonts, "MathJax's fonts were not copied into the site"


# ---------------------------------------------------------------------------------- the browser


@pytest.fixture(scope="session")
def browser_context():
    """A headless Chromium with a fresh profile; skips without Chromium unless CI is set."""
    if not CHROMIUM.exists():
        message = f"Chromium not found at {CHROMIUM}: install Debian's package (apt-get install chromium)"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI must run the browser tests (.ci/run installs it)", pytrace=False)
        pytest.skip(message)
    if os.environ.get("CI"):
        import playwright.sync_api as playwright_api  # a dependency of the course: CI must have it
    else:
        playwright_api = pytest.importorskip("playwright.sync_api")
    profile = tempfile.mkdtemp(prefix="course-chromium-")
    with playwright_api.sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            profile, executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 900})
        yield context
        context.close()
    shutil.rmtree(profile, ignore_errors=True)


class PageVisit:
    """A browser tab that records console errors, failed requests and requests leaving localhost."""

    def __init__(self, context, base):
        self.page = context.new_page()
        self.errors, self.external = [], []
        origin = urllib.parse.urlsplit(base).netloc

        def route(route_):
            if urllib.parse.urlsplit(route_.request.url).netloc == origin:
                route_.continue_()
            else:
                self.external.append(route_.request.url)
                route_.abort()

        self.page.route("**/*", route)
        self.page.on("console", lambda message: message.type == "error" and self.errors.append(
            f"console: {message.text} ({message.location.get('url')})"))
        self.page.on("pageerror", lambda error: self.errors.append(f"page error: {error}"))
        self.page.on("requestfailed", lambda request: self.errors.append(
            f"request failed: {request.url} ({request.failure})"))
        self.page.on("response", lambda response: response.status >= 400 and self.errors.append(
            f"HTTP {response.status}: {response.url}"))

    def open(self, url):
        self.page.goto(url, wait_until="load")
        self.wait_for_math()

    def wait_for_math(self):
        self.page.wait_for_function("window.MathJax && MathJax.startup && MathJax.startup.promise")
        self.page.evaluate("MathJax.startup.promise")

    def math(self):
        """(arithmatex elements, those with an mjx-container, raw TeX left in any of them, characters
        of typeset formulas without a glyph, TeX errors and undefined macros).

        MathJax's HTML output draws each character from a CSS rule: a formula whose rules were lost
        shows as blank space. A TeX error or an undefined macro shows in red, not in the console."""
        return self.page.evaluate("""() => {
            const spans = Array.from(document.querySelectorAll('article .arithmatex'));
            const glyphless = Array.from(document.querySelectorAll('article mjx-c')).filter(c => {
                const content = getComputedStyle(c, '::before').content;
                return (content === 'none' || content === '') && !c.textContent;
            });
            const errors = Array.from(document.querySelectorAll('article mjx-merror'))
                .map(e => 'TeX error: ' + e.getAttribute('data-mjx-error') + ' in ' + e.textContent)
                .concat(Array.from(document.querySelectorAll('article mjx-assistive-mml mtext[mathcolor="red"]'))
                .map(e => 'undefined macro: ' + e.textContent));
            return [spans.length,
                    spans.filter(e => e.querySelector('mjx-container')).length,
                    spans.map(e => e.textContent).filter(text => /\\\\\\(|\\\\\\[|\\$\\$|\\\\begin\\{/.test(text)),
                    glyphless.length, errors];
        }""")

    def close(self):
        self.page.close()


@pytest.fixture
def visit(built, browser_context):
    tab = PageVisit(browser_context, built["url"])
    yield tab
    tab.close()


_checked_urls = {}  # url without fragment -> (status, set of ids on the page), shared by the pages


def _fetch(url):
    if url not in _checked_urls:
        try:
            with urllib.request.urlopen(url) as response:
                body = response.read().decode("utf-8", "replace")
                _checked_urls[url] = (response.status, set(re.findall(r'\sid="([^"]+)"', body)))
        except urllib.error.HTTPError as error:
            _checked_urls[url] = (error.code, set())
    return _checked_urls[url]


@pytest.mark.parametrize("page", PAGES)
def test_page_in_browser(page, visit, built):
    base = built["url"]
    visit.open(page_url(base, page))
    problems = []

    spans, typeset, raw, glyphless, tex_errors = visit.math()
    problems += tex_errors
    if typeset != spans:
        problems.append(f"{spans - typeset} of {spans} formulas were not typeset by MathJax")
    if glyphless:
        problems.append(f"{glyphless} characters of typeset formulas have no glyph (they show as blanks)")
    problems += [f"raw TeX left in a formula: {text[:80]!r}" for text in raw]
    text = visit.page.evaluate("""() => {
        const article = document.querySelector('article').cloneNode(true);
        article.querySelectorAll('pre, code, .arithmatex, mjx-container').forEach(e => e.remove());
        return article.textContent;
    }""")
    problems += [f"TeX outside any formula: {m.group(0)!r} near {text[max(0, m.start() - 40):m.end() + 40]!r}"
                 for m in RAW_TEX.finditer(text)]

    empty_code = visit.page.evaluate(
        "Array.from(document.querySelectorAll('article pre code')).filter(e => !e.textContent.trim()).length")
    if empty_code:
        problems.append(f"{empty_code} empty code blocks")

    links = visit.page.evaluate("Array.from(document.querySelectorAll('a[href]')).map(a => a.href)")
    for link in sorted(set(links)):
        if not link.startswith(base):
            continue
        address, _, fragment = link.partition("#")
        status, ids = _fetch(address)
        if status != 200:
            problems.append(f"broken link {link}: HTTP {status}")
        elif fragment and urllib.parse.unquote(fragment) not in ids and address.endswith("/"):
            problems.append(f"link to a missing section: {link}")
    sources = visit.page.evaluate("""Array.from(document.querySelectorAll('img[src], object[data]'))
        .map(e => [e.currentSrc || e.src || e.data, e.tagName === 'IMG' ? e.naturalWidth : 1])""")
    for url, width in sources:
        if url.startswith(base) and _fetch(url)[0] != 200:
            problems.append(f"missing image {url}")
        elif width == 0:
            problems.append(f"image does not display: {url}")

    problems += visit.errors
    problems += [f"request left localhost: {url}" for url in visit.external]
    if page in STAGE_PAGES and not os.environ.get("CI"):  # for a person to look at: CI has no one (3-4 s a page)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        visit.page.screenshot(path=str(SCREENSHOTS / f"{page.removesuffix('.md')}.png"), full_page=True)
    assert not problems, f"{page}:\n" + "\n".join(problems)


def test_instant_navigation_typesets_the_new_page(visit, built):
    """Following a link swaps the page without a reload; the new page's math must still be typeset."""
    visit.open(page_url(built["url"], "s01_linear_attention.md"))
    visit.page.evaluate("window.__same_document = true")
    visit.page.locator("nav.md-nav--primary a.md-nav__link", has_text="Notation").first.click()
    visit.page.wait_for_url("**/notation/", wait_until="commit")
    visit.page.wait_for_function("document.querySelector('article h1') && "
                                 "document.querySelector('article h1').textContent.includes('Notation')")
    visit.wait_for_math()
    visit.page.wait_for_function("""() => {
        const spans = document.querySelectorAll('article .arithmatex');
        return spans.length > 0 && Array.from(spans).every(e => e.querySelector('mjx-container'));
    }""", timeout=10_000)
    assert visit.page.evaluate("window.__same_document === true"), "the link reloaded the page: instant navigation is off"
    spans, typeset, raw, glyphless, tex_errors = visit.math()
    assert spans == typeset and not raw and not glyphless and not tex_errors, (
        f"{spans} formulas, {typeset} typeset, raw TeX {raw}, {glyphless} blank characters, {tex_errors}")
    assert not visit.errors, visit.errors


def test_course_serve_prints_its_url_and_serves_the_site():
    """`course serve` builds, says where it serves, and answers there (the README's `make serve`)."""
    import subprocess
    import sys
    import time

    command = [sys.executable, "-c", "import sys; from kdacourse.cli import main; sys.exit(main())",
               "serve", "--port", "0", "--no-browser"]
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, url, output = time.monotonic() + 120, None, []
        while url is None and time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            output.append(line)
            match = re.search(r"Serving the course site on (http://127\.0\.0\.1:\d+/)", line)
            url = match.group(1) if match else None
        assert url, "course serve did not print the URL it serves:\n" + "".join(output[-15:])
        with urllib.request.urlopen(url + "s01_linear_attention/") as response:
            assert response.status == 200
            assert "Stage 1: linear attention" in response.read().decode()
    finally:
        process.terminate()
        process.wait(timeout=30)
