"""Which kernel a result was measured on: a digest of the code that builds a kernel module's programs.

The benchmarks record it beside their results (benchmarks/results/*meta.json, interpreter_speed.csv)
and the site compares it with the committed kernel's (kdacourse.results), so that a page says when a
result's kernel has changed since. An edit of a wrapper, a comment or a snippet marker leaves it alone.
"""

import ast
import hashlib
import importlib.util
import io
import tokenize
from pathlib import Path


def modules_digest(modules):
    """program_digest of the kernel modules named (dotted names), their code in the order given."""
    lines = []
    for module in modules:
        lines += program_lines(_module_source(module))
    return _digest(lines)


def program_digest(source):
    """Digest of the code that builds a kernel module's programs: its `build_*program` functions and
    its TileLang macros (`*_macro`), and those it imports from another kernel module (stage 5 re-exports
    the builders of stages.kda, whose builders build with the macros of stages.kda.tiles), their text
    with the comments and blank lines taken out. Not `ast.dump` or the token stream, whose forms change
    between Python versions (the GPU machine runs another Python than the course machines); a comment
    is a comment in every version."""
    return _digest(program_lines(source))


def program_lines(source, names=None):
    """The code lines program_digest hashes: the builders and macros `source` defines (those of `names`
    only, if given), then, in the order imported, those it imports from other modules and what they
    build with in turn. Refused if none of them is a `build_*program` function."""
    tree = ast.parse(source)
    own = [node for node in tree.body if _builds(node) and (names is None or node.name in names)]
    own.sort(key=lambda node: not _is_builder(node.name))  # the builders, then the macros
    kept = _code_lines(source, own)
    builds_a_program = any(_is_builder(node.name) for node in own)
    for node in tree.body:
        imported = {alias.name for alias in getattr(node, "names", ()) if _builds_name(alias.name)}
        if isinstance(node, ast.ImportFrom) and node.module and imported:
            kept += program_lines(_module_source(node.module), imported)
            builds_a_program = builds_a_program or any(_is_builder(name) for name in imported)
    if not builds_a_program and names is None:
        raise ValueError("the kernel module defines or imports no build_*program function")
    return kept


def _digest(lines):
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:12]


def _module_source(module):
    return Path(importlib.util.find_spec(module).origin).read_text()


def _is_builder(name):
    return name.startswith("build_") and name.endswith("program")


def _builds_name(name):
    return _is_builder(name) or name.endswith("_macro")


def _builds(node):
    return isinstance(node, ast.FunctionDef) and _builds_name(node.name)


def _code_lines(source, functions):
    """The lines of `functions` (nodes of `source`'s tree), without comments, blank lines or trailing blanks."""
    kept = []
    for node in functions:
        lines = ast.get_source_segment(source, node).splitlines()
        for token in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
            if token.type == tokenize.COMMENT:  # one line each: cut it from its column on
                row, column = token.start
                lines[row - 1] = lines[row - 1][:column]
        kept += [line.rstrip() for line in lines if line.strip()]
    return kept


def module_digest(module):
    """program_digest of the kernel module named `module` ("stages.s04_kda.kernel")."""
    return modules_digest((module,))
