"""One-off studies: variants of a kernel timed against the committed one, a kernel's parts checked alone, a sweep
of tile sizes. Each answered a question once (its results and what was adopted are on the stage pages); they
stay runnable (`python -m benchmarks.studies.<name> --help`) so that the answer can be checked again. The
benchmarks a reader runs to reproduce the pages' tables are the modules of benchmarks/ itself."""

import importlib.util
import inspect
import tempfile
import textwrap
from pathlib import Path


def function_source(function):
    """The source of `function` (a kernel builder), dedented, for a study to edit."""
    return textwrap.dedent(inspect.getsource(function))


def load_edited(source, module, name):
    """`source` (an edited function_source) loaded as the module `name`, run in a copy of `module`'s
    namespace, so that what it defines builds with the module's macros and constants. TileLang reads a
    program's source from its file, so the source is written to one and imported."""
    path = Path(tempfile.mkdtemp()) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    edited = importlib.util.module_from_spec(spec)
    edited.__dict__.update({key: value for key, value in vars(module).items() if not key.startswith("__")})
    spec.loader.exec_module(edited)
    return edited
