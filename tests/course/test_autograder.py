"""`course autograder OUT`: the Gradescope bundle, and its run_autograder in a folder laid out as
Gradescope lays out /autograder (source/, submission/, results/).

RESULTS_SCHEMA is written from Gradescope's specification of results.json,
https://gradescope-autograders.readthedocs.io/en/latest/specs/ ("Output format"), made strict
where the bundle promises more than the format asks (every test has a score, a max_score, a status).

run_autograder runs here as Gradescope runs it, under a temporary root that AUTOGRADER_ROOT names.
setup.sh needs root and apt, so it is only read (`bash -n`, the pinned torch); in place of the
virtual environment it makes, source/.venv is a copy of this one (hard links) whose site-packages
holds the bundle's course instead of this checkout, as setup.sh's `pip install -e` does: the
sandbox binds the bundle's stages/ only, and the library must be imported from there. The bundle
holds the course as committed, so these tests grade HEAD's machinery: commit before running them.

The assignment is stages 1 and 2 (every stage would take many minutes). The tests that grade need
bubblewrap; without it they skip, except in CI (CI set), where a missing sandbox fails them.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from kdacourse import REPO_ROOT
from kdacourse.autograder import (find_stage_folders, grade_upload, gradescope_results, make_autograder,
                                  unpack_bundle, unpack_upload_zip)
from kdacourse.catalog import exercises
from kdacourse.sandbox import sandbox_problem

STAGES = ["s01_linear_attention", "s02_scalar_decay"]
ASSIGNMENT = [exercise for exercise in exercises() if exercise.stage in STAGES]
MAX_SCORE = sum(exercise.points for exercise in ASSIGNMENT)
CONFIG = {"stages": STAGES, "timeout_per_test": 60, "visibility": "visible", "commit": "0" * 40}  # autograder.json

VISIBILITY = {"enum": ["hidden", "after_due_date", "after_published", "visible"]}
TEXT_FORMAT = {"enum": ["text", "html", "simple_format", "md", "ansi"]}
TEST_SCHEMA = {
    "type": "object",
    "required": ["score", "max_score", "status", "name", "number", "output", "visibility"],
    "additionalProperties": False,
    "properties": {
        "score": {"type": "number", "minimum": 0},
        "max_score": {"type": "number", "minimum": 0},
        "status": {"enum": ["passed", "failed"]},
        "name": {"type": "string"},
        "name_format": TEXT_FORMAT,
        "number": {"type": "string"},
        "output": {"type": "string"},
        "output_format": TEXT_FORMAT,
        "tags": {"type": "array", "items": {"type": "string"}},
        "visibility": VISIBILITY,
        "extra_data": {"type": "object"},
    },
}
RESULTS_SCHEMA = {
    "type": "object",
    "required": ["score", "execution_time", "output", "visibility", "stdout_visibility", "tests"],
    "additionalProperties": False,
    "properties": {
        "score": {"type": "number", "minimum": 0},
        "execution_time": {"type": "integer", "minimum": 0},
        "output": {"type": "string"},
        "output_format": TEXT_FORMAT,
        "test_output_format": TEXT_FORMAT,
        "test_name_format": TEXT_FORMAT,
        "visibility": VISIBILITY,
        "stdout_visibility": VISIBILITY,
        "extra_data": {"type": "object"},
        "tests": {"type": "array", "minItems": 1, "items": TEST_SCHEMA},
        "leaderboard": {"type": "array"},
    },
}
JSON_TYPES = {"object": dict, "array": list, "string": str, "number": (int, float), "integer": int}


def schema_errors(value, schema, where="results.json"):
    """Where `value` breaks `schema`, for the JSON Schema keywords the schemas above use."""
    if "type" in schema and (not isinstance(value, JSON_TYPES[schema["type"]]) or isinstance(value, bool)):
        return [f"{where}: {value!r} is not of type {schema['type']}"]
    errors = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where}: {value!r} is not one of {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        errors.append(f"{where}: {value!r} is below {schema['minimum']}")
    if isinstance(value, dict):
        errors += [f"{where}: {key!r} is missing" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if key in schema.get("properties", {}):
                errors += schema_errors(item, schema["properties"][key], f"{where}.{key}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where}: {key!r} is not a field of the format")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            errors.append(f"{where}: fewer than {schema['minItems']} items")
        for position, item in enumerate(value):
            errors += schema_errors(item, schema.get("items", {}), f"{where}[{position}]")
    return errors


def results_errors(results, assignment=ASSIGNMENT):
    """The schema's errors, then what a schema cannot say: no test scores above its maximum, the
    total is the tests' sum, and the tests are the assignment's exercises, each worth its points."""
    errors = schema_errors(results, RESULTS_SCHEMA)
    if errors:
        return errors
    tests = results["tests"]
    errors += [f"test {test['name']!r}: score {test['score']} above max_score {test['max_score']}"
               for test in tests if test["score"] > test["max_score"]]
    if results["score"] != sum(test["score"] for test in tests):
        errors.append(f"score {results['score']} is not the sum of the tests' scores")
    expected = [(exercise.id, exercise.points) for exercise in assignment]
    if [(test["name"].split(":")[0], test["max_score"]) for test in tests] != expected:
        errors.append("the tests are not the assignment's exercises with their points")
    return errors


# ------------------------------------------------------------------------------------------ the bundle


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    """autograder.zip for stages 1 and 2, made by `course autograder`."""
    out = tmp_path_factory.mktemp("bundle") / "out"
    assert make_autograder(out, ["s01", "2"], timeout_per_test=60) == 0
    return out / "autograder.zip"


def test_bundle_holds_the_committed_course_and_gradescopes_two_scripts(bundle):
    committed = subprocess.run(["git", "-C", str(REPO_ROOT), "ls-tree", "-r", "--name-only", "HEAD"],
                               capture_output=True, text=True, check=True).stdout.split()
    with zipfile.ZipFile(bundle) as archive:
        files = {member.filename: member for member in archive.infolist() if not member.is_dir()}
        setup_sh = archive.read("setup.sh").decode()
        config = json.loads(archive.read("autograder.json"))
    assert sorted(files) == sorted([*committed, "setup.sh", "run_autograder", "autograder.json"])
    for script in ("setup.sh", "run_autograder"):  # at the root of the zip, executable
        assert (files[script].external_attr >> 16) & 0o111 == 0o111, script
    assert '"torch==2.13.0"' in setup_sh and "download.pytorch.org/whl/cpu" in setup_sh
    assert "bubblewrap" in setup_sh
    assert config["stages"] == STAGES and config["visibility"] == "visible"
    unpacked = bundle.parent / "autograder"
    for script in ("setup.sh", "run_autograder"):
        checked = subprocess.run(["bash", "-n", str(unpacked / script)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr
    assert (unpacked / "solutions").is_dir() and os.access(unpacked / "run_autograder", os.X_OK)


def test_bundle_goes_to_a_new_folder_outside_the_course(tmp_path, capsys):
    assert make_autograder(REPO_ROOT / "build" / "bundle") == 2
    assert "inside the course" in capsys.readouterr().err
    (tmp_path / "kept.txt").write_text("an instructor's file\n")
    assert make_autograder(tmp_path) == 2
    assert "not empty" in capsys.readouterr().err
    assert make_autograder(tmp_path / "new", ["s99"]) == 2
    assert "unknown stage" in capsys.readouterr().err


# ------------------------------------------------------------------------------------- results.json


def _report_entry(exercise, passed):
    return {"id": exercise.id, "stage": exercise.stage, "passed": passed, "points": exercise.points if passed else 0,
            "max_points": exercise.points, "tests_passed": 3 if passed else 1, "tests_total": 3, "seconds": 1.5,
            "failures": [] if passed else ["test_x: AssertionError: values differ"]}


def test_results_follow_gradescopes_format_and_score_what_was_graded():
    """Stage 1 graded (its first exercise failed), stage 2 not in the upload: it scores zero."""
    graded = [exercise for exercise in ASSIGNMENT if exercise.stage == STAGES[0]]
    report = {"sandbox": True, "exercises": [_report_entry(exercise, position > 0)
                                             for position, exercise in enumerate(graded)]}
    config = {**CONFIG, "visibility": "after_published"}
    results = gradescope_results(ASSIGNMENT, report, config, ["Graded from your upload: s01_linear_attention."])
    results["execution_time"] = 3
    assert results_errors(results) == []
    assert results["score"] == sum(exercise.points for exercise in graded[1:])
    first, *_ = results["tests"]
    assert first["score"] == 0 and first["status"] == "failed" and "values differ" in first["output"]
    assert {test["visibility"] for test in results["tests"]} == {"after_published"}
    not_handed_in = [test for test in results["tests"] if test["name"].startswith("s02.")]
    assert not_handed_in and all(test["score"] == 0 and "no folder s02_scalar_decay" in test["output"]
                                 for test in not_handed_in)
    broken = json.loads(json.dumps(results))
    del broken["tests"][1]["max_score"]
    assert results_errors(broken) == ["results.json.tests[1]: 'max_score' is missing"]


def test_an_upload_without_stage_folders_scores_zero_and_says_what_to_upload(tmp_path):
    (tmp_path / "submission").mkdir()
    (tmp_path / "submission" / "notes.txt").write_text("my work is elsewhere\n")
    results, code = grade_upload(tmp_path / "submission", tmp_path / "scratch", ASSIGNMENT, CONFIG)
    assert code == 0 and results_errors({**results, "execution_time": 0}) == []
    assert results["score"] == 0 and "no folder of this assignment's stages" in results["output"]


def test_without_a_sandbox_no_student_code_runs(tmp_path, monkeypatch):
    import kdacourse.grading
    import kdacourse.sandbox

    def grade(*args, **kwargs):
        raise AssertionError("graded without a sandbox")

    monkeypatch.setattr(kdacourse.sandbox, "sandbox_problem", lambda: "bwrap: creating new namespace failed")
    monkeypatch.setattr(kdacourse.grading, "grade", grade)
    shutil.copytree(REPO_ROOT / "solutions" / STAGES[0], tmp_path / "submission" / STAGES[0])
    results, code = grade_upload(tmp_path / "submission", tmp_path / "scratch", ASSIGNMENT, CONFIG)
    assert code == 1 and results_errors({**results, "execution_time": 0}) == []
    assert results["score"] == 0 and "not your fault" in results["output"]
    assert "namespace failed" in results["extra_data"]["grader_problem"]


# ------------------------------------------------------------------------------------------ the upload


def test_stage_folders_are_found_in_each_layout_without_following_links(tmp_path):
    upload = tmp_path / "submission"
    (upload / "handin" / "exercises" / STAGES[0]).mkdir(parents=True)
    (upload / "handin" / "exercises" / STAGES[0] / "recurrent.py").write_text("# the student's\n")
    (upload / "elsewhere").symlink_to(REPO_ROOT / "solutions")  # a link to a folder: never searched
    found, notes = find_stage_folders(upload, STAGES, tmp_path / "unzipped")
    assert found == {STAGES[0]: upload / "handin" / "exercises" / STAGES[0]} and notes == []

    (upload / STAGES[1]).symlink_to(REPO_ROOT / "solutions" / STAGES[1])  # taken as the link it is
    found, _ = find_stage_folders(upload, STAGES, tmp_path / "unzipped")
    assert found[STAGES[1]].is_symlink()

    zipped = tmp_path / "zipped"
    zipped.mkdir()
    with zipfile.ZipFile(zipped / "handin.zip", "w") as archive:
        archive.writestr(f"{STAGES[1]}/recurrent.py", "# the student's\n")
        archive.writestr("../../escaped.py", "# outside\n")
    (zipped / "broken.zip").write_bytes(b"not a zip")
    found, notes = find_stage_folders(zipped, STAGES, tmp_path / "unzipped")
    assert found == {STAGES[1]: tmp_path / "unzipped" / "handin.zip" / STAGES[1]}
    assert [note.split(":")[0] for note in notes] == ["broken.zip was not unpacked"]
    assert [path.relative_to(tmp_path) for path in tmp_path.rglob("escaped.py")] == [
        Path("unzipped/handin.zip/escaped.py")]  # '..' dropped: the zip stays where it was unpacked


def test_an_assignment_of_one_stage_takes_its_files_loose(tmp_path):
    upload = tmp_path / "submission"
    upload.mkdir()
    (upload / "recurrent.py").write_text("# the student's\n")
    assert find_stage_folders(upload, STAGES[:1], tmp_path / "unzipped")[0] == {STAGES[0]: upload}
    assert find_stage_folders(upload, STAGES, tmp_path / "unzipped")[0] == {}  # two stages: which one?


def test_a_zip_that_unpacks_too_large_is_refused(tmp_path, monkeypatch):
    import kdacourse.autograder as autograder

    monkeypatch.setattr(autograder, "UNZIPPED_BYTES", 1000)
    with zipfile.ZipFile(tmp_path / "bomb.zip", "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("s01_linear_attention/recurrent.py", "#" * 10_000)
    with pytest.raises(autograder.AutograderError, match="more than"):
        unpack_upload_zip(tmp_path / "bomb.zip", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------- run_autograder, as Gradescope


@pytest.fixture(scope="module")
def gradescope(bundle):
    """run(fill_upload) -> results.json: fill_upload(submission folder, root) lays out the upload, then
    root/run_autograder runs as Gradescope runs it (root: the /autograder of a fresh container)."""
    problem = sandbox_problem()
    if problem and not os.environ.get("CI"):
        pytest.skip(f"no sandbox here: {problem}")
    assert problem is None, problem  # in CI the setup installs bubblewrap: a missing one is a broken setup
    venv = Path(sys.prefix)
    assert venv != Path(sys.base_prefix), "run the tests from the course's virtual environment (make setup)"
    # in the course's build/ (ignored by git), on the file system of its .venv: the copy is made of hard links
    (REPO_ROOT / "build").mkdir(exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="gradescope-", dir=REPO_ROOT / "build"))
    try:
        unpack_bundle(bundle, root / "source")
        shutil.copy2(root / "source" / "run_autograder", root / "run_autograder")  # as Gradescope's image build does
        _copy_venv(venv, root / "source" / ".venv", root / "source")

        def run(fill_upload):
            for folder in ("submission", "results"):
                shutil.rmtree(root / folder, ignore_errors=True)
                (root / folder).mkdir()
            fill_upload(root / "submission", root)
            environment = {key: value for key, value in os.environ.items() if not key.startswith(("AUTOGRADER_",
                                                                                                  "PYTHON"))}
            completed = subprocess.run([str(root / "run_autograder")], cwd=root, capture_output=True, text=True,
                                       env={**environment, "AUTOGRADER_ROOT": str(root)}, timeout=600)
            (root / "results" / "stdout").write_text(completed.stdout + completed.stderr)
            assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
            results = json.loads((root / "results" / "results.json").read_text())
            assert results_errors(results) == [], json.dumps(results, indent=1)[:3000]
            return results

        run.root = root
        yield run
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _copy_venv(venv, copy, course):
    """A copy of `venv` made of hard links, whose site-packages imports the course from `course`."""
    subprocess.run(["cp", "-al", str(venv), str(copy)], check=True)
    site_packages = next((copy / "lib").glob("python3*/site-packages"))
    for editable in site_packages.glob("__editable__*kdacourse*"):
        editable.unlink()  # a link of the original's file: unlinking leaves the original alone
    (site_packages / "kdacourse-course.pth").write_text(f"{course}\n")


def _copy_stages(source, upload):
    for stage in STAGES:
        shutil.copytree(source / stage, upload / stage)


def test_the_solutions_score_full_marks(gradescope):
    results = gradescope(lambda upload, root: _copy_stages(REPO_ROOT / "solutions", upload / "exercises"))
    assert results["score"] == MAX_SCORE, results["output"]
    assert all(test["status"] == "passed" and test["score"] == test["max_score"] for test in results["tests"])
    assert results["extra_data"]["sandbox"] is True
    assert "exercises/s01_linear_attention" in results["output"]


def test_the_shipped_exercises_score_zero_from_a_zip(gradescope):
    def zip_of_the_exercises(upload, root):
        with zipfile.ZipFile(upload / "handin.zip", "w") as archive:
            for path in sorted((REPO_ROOT / "exercises").rglob("*.py")):
                if path.parent.name in STAGES:
                    archive.write(path, path.relative_to(REPO_ROOT / "exercises"))

    results = gradescope(zip_of_the_exercises)
    assert results["score"] == 0
    assert all(test["status"] == "failed" and test["output"].startswith("failed (") for test in results["tests"])


THIEF = '''\
import subprocess


def recurrent(q, k, v):
    solution = subprocess.run(["cat", "{source}/solutions/s01_linear_attention/recurrent.py"],
                              capture_output=True, text=True).stdout
    subprocess.run(["sh", "-c", "echo pwned >> {source}/tests/exercises/s01_linear_attention/test_recurrent.py; "
                                "echo pwned > {root}/outside.txt"])
    raise RuntimeError(f"read {{len(solution)}} characters of the solution")
'''


def test_the_sandbox_holds_in_the_container(gradescope):
    """s01's recurrent.py reads the solution and writes outside (past the static checks: subprocess),
    s02's folder is a link to the solutions; chunkwise.py, a correct file beside them, still scores."""
    test_file = gradescope.root / "source" / "tests" / "exercises" / STAGES[0] / "test_recurrent.py"
    before = hashlib.sha256(test_file.read_bytes()).hexdigest()

    def upload_a_thief(upload, root):
        (upload / STAGES[0]).mkdir()
        (upload / STAGES[0] / "recurrent.py").write_text(THIEF.format(source=root / "source", root=root))
        shutil.copy(REPO_ROOT / "solutions" / STAGES[0] / "chunkwise.py", upload / STAGES[0])
        (upload / STAGES[1]).symlink_to(root / "source" / "solutions" / STAGES[1])

    results = gradescope(upload_a_thief)
    tests = {test["name"].split(":")[0]: test for test in results["tests"]}
    assert tests["s01.recurrent"]["score"] == 0
    assert "read 0 characters of the solution" in tests["s01.recurrent"]["output"], tests["s01.recurrent"]["output"]
    assert hashlib.sha256(test_file.read_bytes()).hexdigest() == before
    assert not (gradescope.root / "outside.txt").exists()
    assert tests["s01.chunkwise"]["score"] == tests["s01.chunkwise"]["max_score"]
    for exercise in ASSIGNMENT:
        if exercise.stage == STAGES[1]:
            assert tests[exercise.id]["score"] == 0 and "symbolic link" in tests[exercise.id]["output"]
    assert results["score"] == tests["s01.chunkwise"]["max_score"]
