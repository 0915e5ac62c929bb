"""solutions/ holds the library's functions: the same code, compared as syntax trees.

Comments and docstrings may differ, and must be free to: an exercise's comments must not give its
fix away (its file is the solution with the region emptied or a bug applied), while the library's
may explain the fix, which the pages show after the exercise.
"""

import ast
import difflib
import inspect
import textwrap

from kdacourse.targets import load_module


def code_without_words(function):
    """The function's code as Python prints it back: no comments, no docstring, no layout."""
    node = ast.parse(textwrap.dedent(inspect.getsource(function))).body[0]
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
            and isinstance(body[0].value.value, str):
        node.body = body[1:] or [ast.Pass()]
    return ast.unparse(node)


def assert_solution_is_library_code(stage, name, module, file=None):
    """solutions/<stage>/<file or name.py>'s `name` has the code of `module`'s `name`."""
    solution = getattr(load_module("solutions", stage, file or f"{name}.py"), name)
    ours, theirs = code_without_words(solution), code_without_words(getattr(module, name))
    if ours != theirs:
        diff = "\n".join(difflib.unified_diff(theirs.splitlines(), ours.splitlines(), f"{module.__name__}.{name}",
                                              f"solutions/{stage}/{file or name + '.py'}", lineterm="", n=1))
        raise AssertionError(f"the solution's code differs from the library's:\n{diff}")
