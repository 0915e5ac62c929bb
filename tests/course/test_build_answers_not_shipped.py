"""No build exercise is answered by a file the handout ships.

A build exercise (exercises/<stage>/build_kernel.py) asks for the stage's chunked kernel written from
an empty body. The other kernel exercises of its stage ship whole programs: the kernel_program.py
exercise a kernel of its own (the recurrence token by token, a fix or a fill), and the tune exercise
(tune_kernel.py) a right but wasteful start that computes the chunked algorithm element by element.

Two measures. The first puts each shipped program in the build answer's place, the fix exercise's
with its bug repaired (its solution), the tune exercise's as shipped, and expects the build
exercise's cost test to fail on it: it asks for the course kernel's counted global bytes and GEMM
FLOPs within BUILD_COST_FACTOR and for at least BUILD_MIN_GEMM_SHARE of its GEMM FLOPs
(tests/exercises/build_checks.py), and these programs make their products element by element. The
second measures what each file of the stage holds of a build answer, so that no edit of a few lines
turns one into the answer: the lines of the build exercise's solution region that its shipped file
lacks (the answer, as `course handout` reads it: kdacourse.handout.answer_lines). No file of the
stage, as shipped or (a fix exercise) repaired, may hold more than SHARED_ANSWER_BOUND of them.
"""

import pytest

from kdacourse import REPO_ROOT
from kdacourse.catalog import exercises
from kdacourse.handout import answer_lines
from kdacourse.prefork import run_many

BUILD_FILE = "build_kernel.py"
BUILD_EXERCISES = {e.stage: e for e in exercises() if e.file == BUILD_FILE}
COST_TEST = "test_cost_near_the_course_kernel"


def _builder_name(source):
    """The build exercise's builder that `source` defines under this name or another one."""
    return next(line.split("(")[0].removeprefix("def ") for line in source.splitlines()
                if line.startswith("def build_") and "program(" in line)


def shipped_programs():
    """(stage, description, path) of every whole program of the output a build exercise computes that
    a student holds: a kernel_program exercise's, repaired or filled (its solution), unless it is
    another kernel of the library (stage 5's prepare, whose output is not o), and a tune exercise's
    start program."""
    import importlib

    programs = []
    for exercise in exercises():
        if exercise.stage not in BUILD_EXERCISES:
            continue
        if exercise.file == "kernel_program.py":
            path = REPO_ROOT / "solutions" / exercise.stage / exercise.file
            library = importlib.import_module(f"stages.{exercise.stage}.kernel")
            if not hasattr(library, _builder_name(path.read_text())):
                programs.append((exercise.stage, f"{exercise.id}, {'repaired' if exercise.kind == 'fix' else 'filled'}",
                                 path))
        elif exercise.kind == "tune":
            programs.append((exercise.stage, f"{exercise.id} as shipped",
                             REPO_ROOT / "exercises" / exercise.stage / exercise.file))
    return programs


PROGRAMS = shipped_programs()


def _in_the_build_answers_place(stage, path):
    """The program of `path` as the build exercise's file: its builder called by the build exercise's name,
    the tile arguments it lacks dropped, when it is another kernel's."""
    wanted = _builder_name((REPO_ROOT / "solutions" / stage / BUILD_FILE).read_text())
    source = path.read_text()
    if (given := _builder_name(source)) != wanted:
        source += (f"\n\ndef {wanted}(*args, **kwargs):\n    import inspect\n\n"
                   f"    accepted = inspect.signature({given}).parameters\n"
                   f"    return {given}(*args, **{{key: value for key, value in kwargs.items() if key in accepted}})\n")
    return source


def _test_file(stage):
    return BUILD_EXERCISES[stage].test_path.relative_to(REPO_ROOT).as_posix()


@pytest.fixture(scope="module")
def cost_runs(tmp_path_factory):
    """{(stage, description): the build exercise's cost test with that shipped program in the build
    answer's place}. The programs are dealt into folders, at most one of a stage in each, and each
    folder's cost tests run in one pytest process, forked from one that imported TileLang once
    (kdacourse.prefork): a few seconds a program, not a fresh interpreter's start for each."""
    folders = []  # [{stage: description}]
    root = tmp_path_factory.mktemp("shipped_programs")
    for stage, description, path in PROGRAMS:
        folder = next((f for f in folders if stage not in f), None)
        if folder is None:
            folders.append(folder := {})
        folder[stage] = description
        (root / str(folders.index(folder)) / stage).mkdir(parents=True)
        (root / str(folders.index(folder)) / stage / BUILD_FILE).write_text(_in_the_build_answers_place(stage, path))
    runs = [{"target": str(root / str(number)), "test_paths": [_test_file(stage) for stage in folder],
             "extra_args": ("-k", COST_TEST), "timeout_per_test": 600, "timeout_total": 1800}
            for number, folder in enumerate(folders)]
    return {(stage, description): result.of_file(_test_file(stage))
            for folder, result in zip(folders, run_many(runs, workers=1)) for stage, description in folder.items()}


@pytest.mark.parametrize("stage, description, path", PROGRAMS, ids=[d.split(",")[0].split(" ")[0] for _, d, _ in PROGRAMS])
def test_a_shipped_program_fails_the_build_exercise(stage, description, path, cost_runs):
    """The shipped program, called as the build exercise's builder (the tile arguments it lacks
    dropped), fails the build exercise's cost test. Only that test runs (a few seconds, not the whole
    file's interpreter runs): the value tests pass on these programs, which are right; their cost is
    what gives them away."""
    exercise = BUILD_EXERCISES[stage]
    run = cost_runs[(stage, description)]
    assert run.outcomes, f"the cost test of {exercise.id} did not run on {description}:\n{run.output[-3000:]}"
    assert any(test.endswith(f"::{COST_TEST}") for test in run.failed()), (
        f"{description} passes the cost test of {exercise.id}:\n{run.output[-3000:]}")


# A program of the same kernel written apart from the course's, from the signature, the layout and the
# page, shares its signature, launch, loads and tile idioms: tests/build_alternatives/ holds one per
# build exercise, each 24% to 39% of the course's answer lines. A file that shares no more than such a
# program tells a student nothing that writing the kernel does not. (The stages' kernel_program and
# tune files share their signature and loop headers: 16% to 33%.)
SHARED_ANSWER_BOUND = 0.40


def stage_files():
    """(build exercise, description, path) of every file of a build exercise's stage that a student
    holds: each other exercise's file as shipped, and a fix exercise's repaired (its solution)."""
    cases = []
    for build_exercise in BUILD_EXERCISES.values():
        for exercise in exercises():
            if exercise.stage != build_exercise.stage or exercise is build_exercise:
                continue
            cases.append((build_exercise, f"{exercise.id} shipped", REPO_ROOT / "exercises" / exercise.stage / exercise.file))
            if exercise.kind == "fix":
                cases.append((build_exercise, f"{exercise.id} repaired",
                              REPO_ROOT / "solutions" / exercise.stage / exercise.file))
    return cases


STAGE_FILES = stage_files()


@pytest.mark.parametrize("build_exercise, description, path", STAGE_FILES,
                         ids=[f"{build.id}-{description.replace(' ', '-')}" for build, description, _ in STAGE_FILES])
def test_no_file_of_the_stage_holds_the_build_answer(build_exercise, description, path):
    answer = answer_lines(build_exercise)
    held = answer & {line.strip() for line in path.read_text().splitlines()}
    assert len(held) <= SHARED_ANSWER_BOUND * len(answer), (
        f"{description} ({path.relative_to(REPO_ROOT)}) holds {len(held)} of the {len(answer)} lines of the answer to "
        f"{build_exercise.id} ({len(held) / len(answer):.0%}; at most {SHARED_ANSWER_BOUND:.0%}): ship another kernel "
        "of the stage, or a program that shares no more than the signature. Held, for example:\n  "
        + "\n  ".join(sorted(held)[:5]))


def test_the_bound_admits_a_program_written_apart():
    """The bound is not below what an independent program of the kernel shares: it would then ask the
    handout's files for less than any other answer holds."""
    for build_exercise in BUILD_EXERCISES.values():
        answer = answer_lines(build_exercise)
        alternative = REPO_ROOT / "tests" / "build_alternatives" / build_exercise.stage / BUILD_FILE
        held = answer & {line.strip() for line in alternative.read_text().splitlines()}
        assert len(held) <= SHARED_ANSWER_BOUND * len(answer), (
            f"the second program of {build_exercise.id} holds {len(held)} of {len(answer)} answer lines")
