"""The course site: building it with MkDocs and serving it on this machine.

    course build     MathJax vendored if missing, then `mkdocs build --strict` into site/
    course serve     the same build, then site/ served on http://127.0.0.1:8000

The pages' math is typeset by MathJax served from the site itself, never from a CDN, so the site
works offline. MathJax comes from the npm registry: `vendor_mathjax()` installs one pinned version
into .cache/npm/ and copies the two things the pages load into docs/javascripts/vendor/mathjax/
(ignored by git): the combined TeX-to-HTML component and its web fonts. scripts/setup.sh calls it
(`python -m kdacourse.site vendor`), and build() calls it again in case the folder was deleted.
"""

import functools
import http.server
import os
import shutil
import subprocess
import sys
import threading
import webbrowser
from pathlib import Path

from kdacourse import REPO_ROOT

MATHJAX_VERSION = "3.2.2"
NPM_PREFIX = REPO_ROOT / ".cache" / "npm"
VENDOR_DIR = REPO_ROOT / "docs" / "javascripts" / "vendor" / "mathjax"
# The combined component: TeX input with every extension preloaded (nothing is fetched on demand),
# HTML output; and the fonts it loads from [its folder]/output/chtml/fonts/woff-v2/.
MATHJAX_FILES = ["tex-chtml-full.js", "output/chtml/fonts/woff-v2"]
SITE_DIR = REPO_ROOT / "site"


class SetupError(Exception):
    """Something the build needs is missing; the message says what to install."""


def mathjax_is_vendored():
    stamp = VENDOR_DIR / "VERSION"
    return stamp.is_file() and stamp.read_text().strip() == MATHJAX_VERSION and all(
        (VENDOR_DIR / name).exists() for name in MATHJAX_FILES)


def vendor_mathjax():
    """Install MathJax from npm and copy what the pages load into docs/; silent when already done."""
    if mathjax_is_vendored():
        return
    npm = shutil.which("npm")
    if npm is None:
        raise SetupError(
            "npm was not found: the site serves its own copy of MathJax, installed with npm.\n"
            "Install Node.js and npm (Debian/Ubuntu: `apt-get install nodejs npm`; macOS: "
            "`brew install node`), then run `make setup` or `course build` again.")
    command = [npm, "install", "--prefix", str(NPM_PREFIX), "--no-audit", "--no-fund", "--silent",
               f"mathjax@{MATHJAX_VERSION}"]
    print(f"fetching MathJax {MATHJAX_VERSION} from the npm registry (once)", flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise SetupError(f"`{' '.join(command)}` failed ({result.returncode}):\n{result.stderr[-2000:]}")
    source = NPM_PREFIX / "node_modules" / "mathjax" / "es5"
    if VENDOR_DIR.exists():
        shutil.rmtree(VENDOR_DIR)
    for name in MATHJAX_FILES:
        destination = VENDOR_DIR / name
        destination.parent.mkdir(parents=True, exist_ok=True)
        if (source / name).is_dir():
            shutil.copytree(source / name, destination)
        else:
            shutil.copy2(source / name, destination)
    (VENDOR_DIR / "VERSION").write_text(MATHJAX_VERSION + "\n")
    print(f"MathJax {MATHJAX_VERSION} copied into {VENDOR_DIR.relative_to(REPO_ROOT)}", flush=True)


def _shown(path):
    path = Path(path)
    return str(path.relative_to(REPO_ROOT)) + "/" if path.is_relative_to(REPO_ROOT) else str(path)


def site_url(port):
    return f"http://127.0.0.1:{port}/"


def build(site_dir=SITE_DIR, quiet=False, port=8000):
    """Vendor MathJax if needed, then `mkdocs build --strict`; returns the exit code.

    `port` is the one the site will be served on: Material's instant navigation follows only links
    that match the site's URL, host and port included.
    """
    try:
        vendor_mathjax()
    except SetupError as error:
        print(f"course build: {error}", file=sys.stderr, flush=True)
        return 1
    command = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site_dir)]
    if quiet:
        command.append("--quiet")
    else:
        print(f"building the site into {_shown(site_dir)} (mkdocs build --strict; a few seconds)", flush=True)
    environment = dict(os.environ, COURSE_SITE_URL=site_url(port),
                       NO_MKDOCS_2_WARNING="1")  # Material's banner about its successor
    return subprocess.run(command, cwd=REPO_ROOT, env=environment).returncode


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # one line per request would bury the URL
        pass


def make_server(port, directory=SITE_DIR):
    """An HTTP server for `directory` on 127.0.0.1:port (port 0: any free port), not yet started."""
    handler = functools.partial(_QuietHandler, directory=str(directory))
    return http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)


def has_graphical_session():
    """Whether a browser opened here would show a window (rather than take over the terminal)."""
    return sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def serve(port=8000, open_browser=True):
    """Build the site, then serve it on http://127.0.0.1:port until Ctrl-C."""
    try:
        server = make_server(port)  # first, so that a busy port is reported before the build
    except OSError as error:
        print(f"course serve: cannot listen on 127.0.0.1:{port} ({error.strerror}); "
              f"try `course serve --port {port + 1}`", file=sys.stderr)
        return 1
    port = server.server_address[1]
    code = build(port=port)
    if code != 0:
        server.server_close()
        return code
    url = site_url(port)
    print(f"Serving the course site on {url} (Ctrl-C to stop)", flush=True)
    if open_browser:
        if has_graphical_session():
            # in a thread: some browsers' launchers return only when the browser exits
            threading.Thread(target=webbrowser.open, args=(url,), daemon=True).start()
        else:
            print("No graphical session here: open the URL above in a browser.", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("\nstopped", flush=True)
    finally:
        server.server_close()
    return 0


def main(argv=None):
    """`python -m kdacourse.site vendor`: the setup step of scripts/setup.sh."""
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["vendor"]:
        print("usage: python -m kdacourse.site vendor", file=sys.stderr)
        return 2
    try:
        vendor_mathjax()
    except SetupError as error:
        print(f"setup: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
