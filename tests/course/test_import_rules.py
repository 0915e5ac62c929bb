"""The import rules between the library, the site, the benchmarks and the tests, read from the source.

Every project .py file is parsed with `ast`; every import counts, those inside functions too:
1. stages/ (the library) imports only stages/ of the project, and neither matplotlib nor playwright;
2. nothing outside tests/ imports tests/;
3. no import cycle among project modules;
4. no module imports matplotlib or playwright at import time (only inside the function that plots
   or drives the browser), so that importing any of them needs neither;
5. benchmarks/ does not import kdacourse/, and kdacourse/ does not import benchmarks/: a benchmark
   writes its results' files, the site reads the files (kdacourse.results), so that either can
   change, and a one-off study retire, without the other.
"""

import ast
from functools import cache

import pytest

from kdacourse import REPO_ROOT

SKIPPED_FOLDERS = {".venv", "site", "docs", ".git", "build", "archive"}  # archive/: code kept as it ran, never imported
SITE_AND_TEST_TOOLS = ("matplotlib", "playwright")
# benchmarks that still import kdacourse (none: the grader's own timing lives in kdacourse.grading_speed)
BENCHMARKS_IMPORTING_THE_SITE = set()


def module_name(path):
    """stages/s04_kda/kernel.py -> 'stages.s04_kda.kernel'; a package's __init__.py -> the package."""
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def project_files():
    return {module_name(path): path for path in sorted(REPO_ROOT.rglob("*.py"))
            if not SKIPPED_FOLDERS & set(path.relative_to(REPO_ROOT).parts)}


def imports(tree, module, is_package=False):
    """[(imported name, line, at import time)] of a module's syntax tree, relative imports resolved."""
    found = []

    def visit(node, top_level):
        for child in ast.iter_child_nodes(node):
            inside_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((alias.name, child.lineno, top_level) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = module.split(".")[: len(module.split(".")) - child.level + is_package]
                    base = ".".join(package + ([base] if base else []))
                found.extend((f"{base}.{alias.name}", child.lineno, top_level) for alias in child.names)
                found.append((base, child.lineno, top_level))
            visit(child, top_level and not inside_function)

    visit(tree, True)
    return found


def resolve(name, modules):
    """The project module an imported name refers to (its longest prefix that is one), or None."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


@cache
def import_graph():
    """{module: {project module it imports: first line}} and {module: [(name, line, at import time)]}."""
    modules = project_files()
    graph, all_imports = {}, {}
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        all_imports[module] = imports(tree, module, is_package=path.name == "__init__.py")
        graph[module] = {}
        for name, line, _ in all_imports[module]:
            target = resolve(name, modules)
            if target is not None and target != module:
                graph[module].setdefault(target, line)
    return graph, all_imports


def cycles(graph):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def connect(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in graph.get(node, ()):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return found


def where(module, target):
    graph, _ = import_graph()
    return f"{project_files()[module].relative_to(REPO_ROOT)}:{graph[module][target]} imports {target}"


def test_the_checker_sees_the_project():
    graph, _ = import_graph()
    assert {"stages.s04_kda.kernel", "kdacourse.cli", "kdacourse.pages", "benchmarks.bench",
            "tests.conftest"} <= set(graph)
    assert "stages.common.checks" in graph["stages.s04_kda.reference"]


def test_cycles_are_found():
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_relative_imports_resolve():
    tree = ast.parse("from . import checks\nfrom .inputs import make_inputs\n")
    names = {name for name, _, _ in imports(tree, "stages.common.errors")}
    assert {"stages.common.checks", "stages.common.inputs.make_inputs"} <= names


def test_the_library_imports_only_the_library():
    graph, all_imports = import_graph()
    wrong = [where(module, target) for module in graph if module.startswith("stages")
             for target in graph[module] if not target.startswith("stages")]
    wrong += [f"{module} imports {name}" for module in graph if module.startswith("stages")
              for name, _, _ in all_imports[module] if name.split(".")[0] in SITE_AND_TEST_TOOLS]
    assert not wrong, "stages/ must import only stages/ (and no site or test tools):\n" + "\n".join(wrong)


def test_nothing_outside_the_tests_imports_the_tests():
    graph, _ = import_graph()
    wrong = [where(module, target) for module in graph if not module.startswith("tests")
             for target in graph[module] if target.startswith("tests")]
    assert not wrong, "only tests/ may import tests/:\n" + "\n".join(wrong)


def test_benchmarks_do_not_import_the_site():
    graph, _ = import_graph()
    wrong = [where(module, target) for module in graph
             if module.split(".")[0] == "benchmarks" and module not in BENCHMARKS_IMPORTING_THE_SITE
             for target in graph[module] if target.split(".")[0] == "kdacourse"]
    assert not wrong, "benchmarks/ must not import kdacourse/ (the pages read the results):\n" + "\n".join(wrong)


def test_the_site_does_not_import_the_benchmarks():
    graph, _ = import_graph()
    wrong = [where(module, target) for module in graph if module.split(".")[0] == "kdacourse"
             for target in graph[module] if target.split(".")[0] == "benchmarks"]
    assert not wrong, ("kdacourse/ must not import benchmarks/ (the pages read the results' files through "
                       "kdacourse.results):\n" + "\n".join(wrong))


def test_no_import_cycle():
    graph, _ = import_graph()
    found = cycles(graph)
    assert not found, "import cycles among project modules (each line, modules that import each other in a circle):\n" + "\n".join(", ".join(c) for c in found)


@pytest.mark.parametrize("tool", SITE_AND_TEST_TOOLS)
def test_site_and_test_tools_are_imported_only_where_used(tool):
    _, all_imports = import_graph()
    wrong = [f"{project_files()[module].relative_to(REPO_ROOT)}:{line}" for module, found in all_imports.items()
             if not module.startswith("tests") for name, line, top_level in found
             if top_level and name.split(".")[0] == tool]
    assert not wrong, f"{tool} imported at import time (import it inside the function that uses it):\n" + "\n".join(wrong)


# ------------------------------------------------------------------ rule 5: private names stay home

# Roots whose modules the rule reads; tests/ may reach into a module's privates (to patch or to probe).
PRIVATE_RULE_ROOTS = ("stages", "solutions", "exercises", "kdacourse", "benchmarks", "scripts")
# Modules the rule does not read yet, each with why (a test fails once one has nothing left to allow).
PRIVATE_RULE_ALLOWED = {}


def is_private(name):
    """_name is private to its module; a dunder (__version__, __file__) is not."""
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def dotted(node):
    """'a.b.c' for the expression a.b.c (names and attributes only), else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def private_uses(tree, module, modules, is_package=False):
    """[(line, what)] where `module` names a private name of another project module: `from X import
    _name`, or `X._name` with X a name bound to a project module (by `import X`, `import X as Y` or
    `from package import X`). What counts is the name taken from X: `import f as _f` is fine."""
    bound, found = {}, []  # bound: a local name -> the project module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if resolve(alias.name, modules):
                    local = alias.asname or alias.name.split(".")[0]
                    bound[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: len(module.split(".")) - node.level + is_package]
                base = ".".join(package + ([base] if base else []))
            if resolve(base, modules) is None:
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{base}.{alias.name}"
                elif is_private(alias.name) and base != module:
                    found.append((node.lineno, f"from {base} import {alias.name}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr):
            owner = dotted(node.value)
            if owner is None or owner.split(".")[0] not in bound:
                continue
            first, _, rest = owner.partition(".")
            target = ".".join(filter(None, (bound[first], rest)))
            if target in modules and target != module:
                found.append((node.lineno, f"{owner}.{node.attr} ({target})"))
    return sorted(found)


def test_private_uses_are_found():
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"}
    source = ("from pkg.a import _hidden, shown as _alias\n"
              "import pkg.b\n"
              "import pkg.sub.c as c\n"
              "from pkg import a\n"
              "from . import _x\n"
              "pkg.b._run()\n"
              "c._table\n"
              "a._f = None\n"
              "a.__file__, a.Class._method, os._exit\n")
    found = [what for _, what in private_uses(ast.parse(source), "pkg.sub.d", modules)]
    assert found == ["from pkg.a import _hidden", "from pkg.sub import _x", "pkg.b._run (pkg.b)",
                     "c._table (pkg.sub.c)", "a._f (pkg.a)"]
    own = "from pkg.a import _helper\n"  # a module reading its own privates, or another's public names: fine
    assert private_uses(ast.parse("import pkg.a\npkg.a.public\n"), "pkg.b", modules) == []
    assert private_uses(ast.parse("x = 1\nx._y\n"), "pkg.a", modules) == []
    assert private_uses(ast.parse(own), "pkg.a", modules) == []


def project_private_uses():
    """{module: [(line, what)]} for every module of PRIVATE_RULE_ROOTS that uses another's private name."""
    modules = project_files()
    found = {}
    for module, path in modules.items():
        if module.split(".")[0] in PRIVATE_RULE_ROOTS:
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
            uses = private_uses(tree, module, modules, is_package=path.name == "__init__.py")
            if uses:
                found[module] = uses
    return found


def test_no_private_name_crosses_modules():
    """A name that starts with _ is its module's own: another module that needs it needs a public,
    documented function (or the name was never private)."""
    found = project_private_uses()
    wrong = [f"{project_files()[module].relative_to(REPO_ROOT)}:{line}: {what}" for module, uses in found.items()
             if module not in PRIVATE_RULE_ALLOWED for line, what in uses]
    assert not wrong, "private names used across modules (make them public, with a docstring):\n" + "\n".join(wrong)
    stale = sorted(set(PRIVATE_RULE_ALLOWED) - set(found))
    assert not stale, f"nothing left to allow in {stale}: remove them from PRIVATE_RULE_ALLOWED"
