#!/usr/bin/env bash
# Creates the course's virtual environment and installs everything the course needs into it.
# Usage: bash scripts/setup.sh [python] [venv-dir]     (make setup calls it)
set -euo pipefail
python=${1:-python3}
venv=${2:-.venv}
cd "$(dirname "$0")/.."
if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
  echo "setup: the course needs Python 3.11 or newer (it reads its catalog with tomllib); $python is" \
       "$("$python" --version 2>&1 | head -1). Give another: make setup PYTHON=python3.11" >&2
  exit 1
fi
# bubblewrap: the sandbox `course grade` runs students' code in (kdacourse/sandbox.py); course check needs none
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: bubblewrap, the grading sandbox (apt-get)"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null
  else
    echo "setup: bubblewrap is missing; course grade needs it to run untrusted code: sudo apt-get install bubblewrap" \
         "(Fedora: dnf install bubblewrap; Arch: pacman -S bubblewrap), or grade your own code with --trust" >&2
  fi
fi
echo "setup [1/5]: a virtual environment in $venv"
"$python" -m venv "$venv"
echo "setup [2/5]: the latest pip"
"$venv/bin/python" -m pip install -q --upgrade pip
# torch first and pinned: left to the resolver, it would arrive as a CUDA build of several GB on a
# machine without a GPU (scripts/install_torch.sh: the CPU build there, CUDA's where a GPU is)
echo "setup [3/5]: torch (the largest download)"
source scripts/install_torch.sh
install_torch "$venv/bin/python"
echo "setup [4/5]: the course and its dependencies (pyproject.toml: NumPy, SymPy, TileLang, pytest; MkDocs, matplotlib, Playwright, ruff)"
# with the extras the site (MkDocs, matplotlib) and the tests (Playwright's driver, ruff) need
"$venv/bin/python" -m pip install -q -e ".[site,test]"
# MathJax for the site, from the npm registry into docs/javascripts/vendor/ (needs npm; nothing to do when done)
echo "setup [5/5]: MathJax for the site, from npm"
"$venv/bin/python" -m kdacourse.site vendor
echo "course environment ready in $venv"
