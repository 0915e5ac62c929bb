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


def program_digest(source):
    """Digest of the code that builds a kernel module's programs: its `build_*program` functions and
    its TileLang macros (`*_macro`), and the macros it imports from another kernel module (stages 6
    and 7 build with stage 5's), their text with the comments and blank lines taken out. Not
    `ast.dump` or the token stream, whose forms change between Python versions (the GPU machine runs
    another Python than the course machines); a comment is a comment in every version."""
    tree = ast.parse(source)
    builders = [node for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name.startswith("build_") and node.name.endswith("program")]
    if not builders:
        raise ValueError("the kernel module defines no build_*program function")
    kept = _code_lines(source, builders + [node for node in tree.body if _is_macro(node)])
    for node in tree.body:  # the macros of another kernel module, in the order they are imported
        names = {alias.name for alias in getattr(node, "names", ()) if alias.name.endswith("_macro")}
        if isinstance(node, ast.ImportFrom) and node.module and names:
            other = Path(importlib.util.find_spec(node.module).origin).read_text()
            kept += _code_lines(other, [n for n in ast.parse(other).body if _is_macro(n) and n.name in names])
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()[:12]


def _is_macro(node):
    return isinstance(node, ast.FunctionDef) and node.name.endswith("_macro")


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
    return program_digest(Path(importlib.util.find_spec(module).origin).read_text())
