"""Untrusted grading against a library without the answers (issue 25, item 4).

A student's code runs in the sandbox against the graded library: stages/ as `course handout` stubs it
(every function that is an exercise raises NotImplementedError or runs the student's own), without
stages/common/oracles.py. So no trick reaches an answer: each submission below walks past the static
checks (kdacourse.cheating finds nothing) and reaches the library function that is its exercise's
answer by another way, and gets the stub. Run as the grader (--trust) the same tricks do reach the
answer, which shows that each would score without the stubs. The sandbox finds the library of the
course that grades, wherever that copy lies: one reached through PYTHONPATH only grades its solutions
in full. The tests need bubblewrap; without it they skip, except in CI.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from kdacourse import REPO_ROOT
from kdacourse.catalog import exercises, exercises_of_stage
from kdacourse.cheating import check_exercise
from kdacourse.remote import RemoteSession
from kdacourse.sandbox import graded_library, sandbox_problem
from kdacourse.targets import load_module

STAGE = "s01_linear_attention"
REFERENCE = f"stages.{STAGE}.reference"

# name -> a recurrent.py that returns the library's own recurrent(q, k, v), reached without an import
# the static checks see. Names of modules are built at run time so that no string names them whole.
TRICKS = {
    "sys.modules after a computed import": """
        import builtins, sys
        getattr(builtins, "__imp" + "ort__")("stages.s01_linear_" + "attention.reference")
        answer = getattr(sys.modules["stages.s01_linear_" + "attention.reference"], "recur" + "rent")
    """,
    "importlib fetched from sys.modules": """
        import sys
        loader = sys.modules["import" + "lib"]
        answer = getattr(loader.import_module("stages.s01_linear_" + "attention.reference"), "recurrent")
    """,
    "pkgutil.resolve_name": """
        import pkgutil
        answer = pkgutil.resolve_name("stages.s01_linear_" + "attention.reference:recurrent")
    """,
    "the library's source read and run": """
        import builtins, os, stages
        read, run = getattr(builtins, "op" + "en"), getattr(builtins, "ex" + "ec")
        places = [os.path.join(stages.__path__[0], "s01_linear_attention", "reference.py"),
                  "{repo}/stages/s01_linear_attention/reference.py"]
        scope = {{}}
        for place in places:
            try:
                run(read(place).read(), scope)
                break
            except OSError:
                pass
        answer = scope["recurrent"]
    """,
    "inspect.getsource of the library function": """
        import builtins, inspect, pkgutil
        scope = {{}}
        source = inspect.getsource(pkgutil.resolve_name("stages.s01_linear_" + "attention.reference"))
        getattr(builtins, "ex" + "ec")(source, scope)
        answer = scope["recurrent"]
    """,
    "a pickled reference to the function": """
        import pkgutil
        loads = pkgutil.resolve_name("pick" + "le:loads")
        answer = loads(b"cstages.s01_linear_" + b"attention.reference\\nrecurrent\\n.")
    """,
}


@pytest.fixture(scope="module", autouse=True)
def needs_sandbox():
    problem = sandbox_problem()
    if problem and not os.environ.get("CI"):
        pytest.skip(f"no sandbox here: {problem}")
    assert problem is None, problem


def _trick_source(trick):
    body = textwrap.dedent(TRICKS[trick]).format(repo=REPO_ROOT)
    return body + "\n\ndef recurrent(q, k, v):\n    return answer(q, k, v)\n"


def _inputs():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((1, 8, 1, 4)) for _ in range(3)]


@pytest.mark.parametrize("trick", list(TRICKS))
def test_no_trick_reaches_an_answer(tmp_path, trick):
    exercise = next(e for e in exercises() if e.id == "s01.recurrent")
    (tmp_path / STAGE).mkdir()
    (tmp_path / STAGE / "recurrent.py").write_text(_trick_source(trick))
    assert check_exercise(str(tmp_path), exercise) == []  # past the static checks: the library must hold
    from stages.s01_linear_attention.reference import recurrent

    q, k, v = _inputs()
    trusted = load_module(str(tmp_path), STAGE, "recurrent.py")  # as the grader: the trick works
    assert np.array_equal(trusted.recurrent(q, k, v), recurrent(q, k, v))
    session = RemoteSession(tmp_path)
    try:
        with pytest.raises(NotImplementedError, match="out of the library"):
            session.module(STAGE, "recurrent.py").recurrent(q, k, v)
    except NotImplementedError as error:  # raised by the import itself (the trick ran the stub early)
        assert "out of the library" in str(error)
    finally:
        session.close()


def test_a_stage_of_tricks_scores_zero(tmp_path):
    """Every exercise of stage 1 answered by a trick, graded: zero points, no cheating found, and the
    failures say the library leaves the function out."""
    from kdacourse.grading import grade

    submission = tmp_path / "submission" / STAGE
    submission.mkdir(parents=True)
    reach = textwrap.dedent("""
        import pkgutil
        def _library(module, name):
            return pkgutil.resolve_name("stages.s01_linear_" + "attention." + module + ":" + name)
    """)
    (submission / "recurrent.py").write_text(_trick_source("importlib fetched from sys.modules"))
    (submission / "chunkwise.py").write_text(
        reach + "def chunkwise(q, k, v, chunk_size):\n    return _library('reference', 'chunkwise')(q, k, v, chunk_size)\n")
    (submission / "kernel_mirror.py").write_text(
        reach + "def kernel_mirror(*args, **kwargs):\n    return _library('reference', 'kernel_mirror')(*args, **kwargs)\n")
    reach_kernel = ("    kernel = sys.modules['stages.s01_linear_' + 'attention.kernel']\n"
                    "    return getattr(kernel, 'build_' + 'program')(*args, **kwargs)\n")
    # the kernel fill (its program token by token) handed the library's chunked kernel
    (submission / "kernel_program.py").write_text(
        "import sys\n\nfrom stages.s01_linear_attention.kernel import DEFAULT_BLOCK_DV\n\n"
        "def build_recurrent_program(*args, **kwargs):\n" + reach_kernel)
    # the build exercise writes the chunked program from nothing: the same reach into the library
    (submission / "build_kernel.py").write_text(
        "import sys\n\nfrom stages.s01_linear_attention.kernel import DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE\n\n"
        "def build_program(*args, **kwargs):\n" + reach_kernel)
    for exercise in exercises_of_stage(STAGE):
        assert check_exercise(str(tmp_path / "submission"), exercise) == [], exercise.id
    assert grade(tmp_path / "submission", tmp_path / "out") == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["score"] == 0, [(e["id"], e["points"]) for e in report["exercises"]]
    for entry in report["exercises"]:
        assert not entry["cheating"] and any("out of the library" in failure for failure in entry["failures"]), entry


def test_the_graded_library_has_no_answers():
    library = graded_library() / "stages"
    assert not (library / "common" / "oracles.py").exists()
    stubbed = (library / STAGE / "reference.py").read_text()
    real = (REPO_ROOT / "stages" / STAGE / "reference.py").read_text()
    assert "NotImplementedError" in stubbed and "NotImplementedError" not in real
    assert graded_library() == library.parent  # built once: the same folder again


def test_a_copy_reached_through_pythonpath_grades_with_its_own_library(tmp_path):
    """A second copy of the course, not the one installed in the environment, run with PYTHONPATH:
    its sandbox holds its own library and its solutions score full marks."""
    copy = tmp_path / "copy"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("kdacourse", "stages", "solutions", "exercises", "tests", "pyproject.toml"):
        source = REPO_ROOT / name
        (shutil.copytree(source, copy / name, ignore=ignore) if source.is_dir() else shutil.copy2(source, copy / name))
    submission = tmp_path / "submission"
    shutil.copytree(REPO_ROOT / "solutions" / STAGE, submission / STAGE, ignore=ignore)
    environment = dict(os.environ, PYTHONPATH=str(copy), PYTHONDONTWRITEBYTECODE="1")
    completed = subprocess.run([sys.executable, "-m", "kdacourse.cli", "grade", str(submission), "--out",
                                str(tmp_path / "out")], cwd=copy, env=environment, capture_output=True, text=True,
                               timeout=600, stdin=subprocess.DEVNULL)
    assert completed.returncode == 0, completed.stderr
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["score"] == report["max_score"] > 0, completed.stdout


def test_a_library_function_passed_to_the_code_runs_in_the_grader_and_no_other(tmp_path):
    """A test may hand a library function to the student's code (s07's prefill takes the forward pass):
    the sandbox has no oracles, so the call comes back to the grader, which runs only a function that
    the same call passed. A proxy made up for another function (the answer) is refused."""
    from stages.common.oracles import causal_linear_attention

    (tmp_path / STAGE).mkdir()
    (tmp_path / STAGE / "recurrent.py").write_text(textwrap.dedent("""
        def attack(forward, q, k, v):
            made_up = type(forward)(forward._child, "stages.s01_linear_" + "attention.reference:recurrent")
            try:
                return forward(q, k, v), made_up(q, k, v)
            except RuntimeError as refused:
                return forward(q, k, v), str(refused)
    """))
    session = RemoteSession(tmp_path)
    try:
        q, k, v = _inputs()
        value, refused = session.module(STAGE, "recurrent.py").attack(causal_linear_attention, q, k, v)
    finally:
        session.close()
    assert np.array_equal(value, causal_linear_attention(q, k, v))
    assert "PermissionError" in refused
