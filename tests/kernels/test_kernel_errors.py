"""Errors in a student's kernel program name the student's file, line and buffer: a program that
TileLang cannot build (tests.exercises.kernel_checks.build), and a run of the tile interpreter that
reads a buffer before writing it. Each program is stage 1's solution with one change, written to a
file of its own as a student's would be.
"""

import importlib.util
from pathlib import Path

import pytest

from stages.common.inputs import make_inputs
from stages.common.interpreter import ReadBeforeWrite, interpret
from tests.exercises.kernel_checks import build

# stage 1's chunked kernel as its build exercise's solution writes it
SOLUTION = Path(__file__).parents[2] / "solutions" / "s01_linear_attention" / "build_kernel.py"
SHAPE = (1, 32, 2, 32, 16)  # B, N, H, d_k, d_v: two chunks; d_k != chunk size, so a missing transpose shows
TILES = dict(chunk_size=16, block_dv=16)


def _student_program(tmp_path, old, new):
    """(build_program, the file, its text) of the solution with `old` replaced by `new` once."""
    source = SOLUTION.read_text()
    assert source.count(old) == 1, f"{SOLUTION.name} no longer holds {old!r}"
    path = tmp_path / SOLUTION.name
    path.write_text(source.replace(old, new))
    spec = importlib.util.spec_from_file_location(f"student_{tmp_path.name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.build_program, path, path.read_text()


def _line_of(text, statement):
    """The number of the one line of `text` that holds `statement`."""
    numbers = [n for n, line in enumerate(text.splitlines(), start=1) if statement in line]
    assert len(numbers) == 1, f"{statement!r} is on lines {numbers}"
    return numbers[0]


def _build_failure(build_program):
    with pytest.raises(pytest.fail.Exception) as failure:
        build(build_program, *SHAPE, dtype="float64", **TILES)
    return str(failure.value)


def test_a_gemm_without_its_transpose_names_the_line_and_the_shapes(tmp_path):
    build_program, path, text = _student_program(
        tmp_path, "T.gemm(K_s, V_s, S_f, transpose_A=True)", "T.gemm(K_s, V_s, S_f)")
    message = _build_failure(build_program)
    line = _line_of(text, "T.gemm(K_s, V_s, S_f)")
    assert f"{path}, line {line}: `T.gemm(K_s, V_s, S_f)`" in message
    assert "T.gemm M shape check failed: M_A = 16, M_C = 32" in message  # what TileLang said
    assert "A gives M = 16 rows, C has 32" in message and "transpose_A=True?" in message  # in plain words


def test_a_name_the_program_does_not_define_names_the_line(tmp_path):
    build_program, path, text = _student_program(
        tmp_path, "T.gemm(scores_s, V_s, acc_o)", "T.gemm(scores_shared, V_s, acc_o)")
    message = _build_failure(build_program)
    line = _line_of(text, "T.gemm(scores_shared, V_s, acc_o)")
    assert f"{path}, line {line}: `T.gemm(scores_shared, V_s, acc_o)`" in message
    assert "scores_shared" in message.split("`: ", 1)[1], "TileLang's own words name the undefined name"


def _interpret(build_program):
    x = make_inputs(*SHAPE, seed=5)
    return interpret(build(build_program, *SHAPE, dtype="float16", **TILES), out_idx=[3])(x.q, x.k, x.v)


def test_a_buffer_never_loaded_names_the_buffer_and_the_line_that_reads_it(tmp_path):
    build_program, path, text = _student_program(tmp_path, "T.copy(K[b, t0:t0 + C, h, :], K_s)", "pass")
    with pytest.raises(ReadBeforeWrite) as error:
        _interpret(build_program)
    message = str(error.value)
    line = _line_of(text, "T.gemm(Q_s, K_s, scores")  # the first statement that reads K_s
    assert message.startswith(f"{path}, line {line}: `T.gemm(Q_s, K_s, scores, transpose_B=True, clear_accum=True)`")
    assert "reads `K_s` before writing it: K_s[0, 0] holds no value yet" in message
    assert f"declared at line {_line_of(text, 'K_s = T.alloc_shared')}" in message


def test_an_accumulator_never_cleared_names_the_gemm_that_adds_into_it(tmp_path):
    build_program, path, text = _student_program(
        tmp_path, "T.gemm(Q_s, S_s, acc_o, clear_accum=True)", "T.gemm(Q_s, S_s, acc_o)")
    with pytest.raises(ReadBeforeWrite) as error:
        _interpret(build_program)
    message = str(error.value)
    assert message.startswith(f"{path}, line {_line_of(text, 'T.gemm(Q_s, S_s, acc_o)')}: `T.gemm(Q_s, S_s, acc_o)`")
    assert "reads `acc_o` before writing it" in message and "clear_accum=True" in message
    # the GEMM adds into it without stopping (its rows may be unused); the copy out is what uses them
    assert f"used at {path}, line {_line_of(text, 'T.copy(acc_o, O[')}" in message


def test_a_program_that_does_not_build_in_the_grading_sandbox_names_the_line(tmp_path):
    """Graded untrusted, build_program runs in the sandboxed child, and only its error's text comes back:
    the child names the student's line in it (kdacourse/sandbox_child.py, where_in_student_file)."""
    import json
    import shutil

    from kdacourse.grading import grade
    from kdacourse.sandbox import sandbox_problem

    problem = sandbox_problem()
    if problem:
        pytest.skip(problem)
    stage = tmp_path / "submission" / "s01_linear_attention"
    stage.mkdir(parents=True)
    shutil.copytree(SOLUTION.parent, stage, dirs_exist_ok=True)
    source = SOLUTION.read_text().replace("T.gemm(K_s, V_s, S_f, transpose_A=True)", "T.gemm(K_s, V_s, S_f)")
    (stage / SOLUTION.name).write_text(source)
    grade(str(tmp_path / "submission"), str(tmp_path / "report"), timeout_per_test=60, trust=False)
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    [entry] = [entry for entry in report["exercises"] if entry["id"] == "s01.build_kernel"]
    line = _line_of(source, "T.gemm(K_s, V_s, S_f)")
    assert not entry["passed"]
    assert any(f"(at s01_linear_attention/{SOLUTION.name}, line {line}: `T.gemm(K_s, V_s, S_f)`)" in failure
               for failure in entry["failures"]), entry["failures"]
