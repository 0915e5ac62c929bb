"""Static checks of a submission for cheating, read with `ast` in the grader: never imported or run.

An exercise scores zero, whatever its tests say, when its file (or its stage folder) shows one of:

- a symbolic link: the exercise's file, its stage folder, or anything inside that folder; a file
  with other hard links;
- an import of the course's answers or machinery: solutions, tests, kdacourse, exercises (another
  copy), benchmarks; a relative import (a file beside it);
- an import from the course library stages/ that the shipped exercise does not make. The rule,
  read from what the shipped exercise files import: anything of stages.common is allowed (checks,
  inputs, tilelang_tools: helpers) except stages.common.oracles (the answers the tests compare
  with); from a stage's own modules (stages.<stage>.reference, .kernel, ...) only the names that the
  shipped file itself imports (e.g. s04's kernel_program imports the constants DEFAULT_BLOCK_DV,
  DEFAULT_CHUNK_SIZE and DEFAULT_LAYOUT from stages.s04_kda.kernel, never build_program; s02's
  kernel_mirror imports decay_table from its reference);
- code that loads or runs code or files the grader cannot see: exec, eval, compile, __import__,
  open, importlib, runpy, imp, ctypes, reading a file through pathlib or NumPy (read_text,
  read_bytes, np.load, np.fromfile, np.loadtxt, np.genfromtxt);
- a name the exercise's catalog entry forbids (`forbidden`, e.g. np.linalg.inv), however imported
  or aliased, or fetched with getattr by its name.

Each finding names the file and the line. The sandbox stops most of these from working at all
(stages/ is the only part of the course it holds); these checks make the attempt show.
"""

import ast
import os
import stat
from dataclasses import dataclass

from kdacourse import REPO_ROOT

FORBIDDEN_PACKAGES = {"solutions", "tests", "kdacourse", "exercises", "benchmarks"}
LOADER_MODULES = {"importlib", "runpy", "imp", "ctypes", "zipimport", "pickle", "marshal"}
LOADER_BUILTINS = {"exec", "eval", "compile", "__import__", "open", "breakpoint"}
FILE_READERS = {"read_text", "read_bytes"}
NUMPY_FILE_READERS = {"load", "fromfile", "loadtxt", "genfromtxt", "memmap"}
ANSWER_MODULES = {"stages.common.oracles"}


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    reason: str

    def __str__(self):
        return f"{self.path}:{self.line}: {self.reason}"


def shipped_stage_imports(stage, file):
    """(module, name) pairs the shipped exercise file imports from a stage's own modules (not common)."""
    path = REPO_ROOT / "exercises" / stage / file
    allowed = set()
    if not path.is_file():
        return allowed
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                allowed.add((node.module, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                allowed.add((alias.name, None))
    return allowed


def _stage_library(module):
    """'stages.s04_kda.kernel' -> True; stages.common.* -> False (helpers)."""
    parts = module.split(".")
    return parts[0] == "stages" and len(parts) > 1 and parts[1] != "common"


def check_source(source, path, stage, file, forbidden=()):
    """The findings in one exercise file's source (a syntax error: none; its tests fail anyway)."""
    try:
        tree = ast.parse(source, filename=path)
    except (SyntaxError, ValueError):
        return []
    allowed = shipped_stage_imports(stage, file)
    findings = []

    def flag(node, reason):
        findings.append(Finding(path, getattr(node, "lineno", 0), reason))

    aliases = {"np": "numpy"}  # local name -> the dotted name it stands for
    forbidden_full = {_normalize(name) for name in forbidden}
    forbidden_last = {name.rsplit(".", 1)[-1] for name in forbidden}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
                _check_module(alias.name, None, node, allowed, flag)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                flag(node, f"a relative import (from {'.' * node.level}{node.module or ''}): a submission's "
                           f"exercise files stand alone")
                continue
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                if _normalize(f"{node.module}.{alias.name}") in forbidden_full:
                    flag(node, f"imports {node.module}.{alias.name}, which this exercise forbids")
                _check_module(node.module, alias.name, node, allowed, flag)
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id in LOADER_BUILTINS:
            flag(node, f"uses {node.id}: exercise code neither loads nor runs other code or files")
        elif isinstance(node, ast.Attribute):
            if node.attr in FILE_READERS:
                flag(node, f"reads a file ({node.attr})")
            dotted = _dotted(node, aliases)
            if dotted and dotted.startswith("numpy.") and dotted.count(".") == 1 and node.attr in NUMPY_FILE_READERS:
                flag(node, f"reads a file ({dotted})")
            if dotted in forbidden_full:
                flag(node, f"uses {dotted}, which this exercise forbids")
        elif isinstance(node, ast.Name) and aliases.get(node.id) in forbidden_full:
            flag(node, f"uses {aliases[node.id]} (as {node.id}), which this exercise forbids")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr":
            names = [arg.value for arg in node.args[1:2] if isinstance(arg, ast.Constant)]
            if names and names[0] in forbidden_last:
                flag(node, f"fetches {names[0]!r} with getattr, which this exercise forbids")
    return sorted(set(findings), key=lambda finding: finding.line)


def _check_module(module, name, node, allowed, flag):
    top = module.split(".")[0]
    what = f"{module}.{name}" if name else module
    if top in FORBIDDEN_PACKAGES:
        flag(node, f"imports {what}: the course's {top}/ is not part of an answer")
    elif top in LOADER_MODULES:
        flag(node, f"imports {what}: exercise code neither loads nor runs other code or files")
    elif module in ANSWER_MODULES or (module == "stages.common" and name == "oracles"):
        flag(node, f"imports {what}: the oracles are what the tests compare with")
    elif _stage_library(module) and (module, name) not in allowed:
        flag(node, f"imports {what}, which the exercise does not import as shipped: a stage's own "
                   f"library holds the answers (stages.common's helpers are fine)")
    elif module == "stages" and name and name != "common":
        flag(node, f"imports {what}: a stage's own library holds the answers")


def _normalize(name):
    root, _, rest = name.partition(".")
    return ("numpy" if root == "np" else root) + ("." + rest if rest else "")


def _dotted(node, aliases):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(aliases.get(node.id, node.id))
    return ".".join(reversed(parts))


def symlinks_in(folder):
    """Every symbolic link at or under `folder` (the folder itself included), without following any."""
    found = []
    if os.path.islink(folder):
        return [folder]
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            path = os.path.join(root, name)
            if os.path.islink(path):
                found.append(path)
    return found


def check_exercise(folder, exercise):
    """The findings for one catalog exercise in a submission folder."""
    stage_folder = os.path.join(folder, exercise.stage)
    links = symlinks_in(stage_folder)
    findings = [Finding(link, 0, f"a symbolic link (to {os.readlink(link)}): a submission holds its own files")
                for link in links]
    if links:
        return findings
    path = os.path.join(stage_folder, exercise.file)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return findings  # missing: its tests fail
    with os.fdopen(fd, "rb") as f:
        status = os.fstat(f.fileno())
        if not stat.S_ISREG(status.st_mode):
            return [Finding(path, 0, "not a regular file")]
        if status.st_nlink > 1:
            return [Finding(path, 0, "a file with other hard links: a submission holds its own files")]
        source = f.read(1 << 20).decode("utf-8", errors="replace")
    return check_source(source, path, exercise.stage, exercise.file, exercise.forbidden)
