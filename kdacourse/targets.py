"""Loading the code under test: the student's copy, the solutions, a submission folder, or a bug.

A target is one of:
    "exercises"   the student's copy in exercises/ (the default)
    "solutions"   the instructors' solutions/
    "bug:<id>"    solutions/ with one catalog bug applied
    <path>        any folder laid out like exercises/ (a student's submission)

Modules are compiled from source and executed in memory: nothing is written to the target's
folder (no __pycache__), so grading never touches a student's files.
"""

import linecache
import sys
import types
from pathlib import Path

from kdacourse import REPO_ROOT, is_handout
from kdacourse.catalog import load_catalog


class TargetError(Exception):
    """The target's file is missing or cannot be imported; the test that needed it fails."""


def target_folder(target):
    """The folder that holds the target's files (solutions/ for a bug)."""
    if target == "exercises":
        return REPO_ROOT / "exercises"
    if target == "solutions" or target.startswith("bug:"):
        if is_handout():
            raise TargetError(f"target {target!r}: this is a student handout, which has no solutions/ and no bug "
                              "catalog; check your own exercises (the default target)")
        return REPO_ROOT / "solutions"
    folder = Path(target).expanduser().resolve()
    if not folder.is_dir():
        raise TargetError(f"target {target!r} is not 'exercises', 'solutions', 'bug:<id>' or a folder")
    return folder


def target_source(target, stage, file):
    """The source text of <stage>/<file> as the target has it."""
    path = target_folder(target) / stage / file
    if not path.is_file():
        raise TargetError(f"{path} is missing")
    source = path.read_text(encoding="utf-8", errors="replace")
    if target.startswith("bug:"):
        bug_id = target.removeprefix("bug:")
        bugs = load_catalog()[1]
        if bug_id not in bugs:
            raise TargetError(f"unknown bug {bug_id!r}; see kdacourse/catalog/")
        bug = bugs[bug_id]
        if (bug.stage, bug.file) == (stage, file):
            source = bug.apply(source)
    return source, path


def load_module(target, stage, file):
    """Import <stage>/<file> from the target as a fresh module; raises TargetError on failure."""
    source, path = target_source(target, stage, file)
    name = f"course_target.{stage}.{Path(file).stem}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    try:
        code = compile(source, str(path), "exec", dont_inherit=True)
        exec(code, module.__dict__)
    except Exception as error:
        raise TargetError(f"{path} does not import: {type(error).__name__}: {error}") from error
    sys.modules[name] = module  # inspect and pickle find functions through their module
    # inspect reads a function's source through linecache: give it the text that ran (for a bug
    # target, not the file on disk). TileLang parses a kernel from that text, so it needs this.
    linecache.cache[str(path)] = (len(source), None, source.splitlines(keepends=True), str(path))
    return module
