"""`course autograder OUT`: a Gradescope autograder bundle, so that a class grades on the service,
one container per submission.

Gradescope's format (https://gradescope-autograders.readthedocs.io/en/latest/specs/): a zip whose
root holds `setup.sh`, run once as root when Gradescope builds the image (Ubuntu), and
`run_autograder`, run once per submission. The zip is unpacked into /autograder/source, the student's
upload lies in /autograder/submission, and run_autograder writes /autograder/results/results.json.

OUT receives autograder.zip, and the same files unpacked in OUT/autograder/ to read. The zip holds:

- the course as committed (`git archive` of HEAD), never the working tree, where an instructor's
  solved exercises or notes may lie uncommitted. Its solutions/ and tests/ are the grader's: the
  student's code runs in the sandbox, which holds only the library stages/ (kdacourse.sandbox), or
  where no namespace can be made runs as a user of its own, to whom protect_course makes the course
  unreadable;
- setup.sh: bubblewrap, a Python of at least 3.11 and a virtual environment with torch (the CPU
  build, pinned as scripts/install_torch.sh pins it) and the course, as `make setup` makes for
  grading; its last line says whether the sandbox works in the image, and which isolation;
- run_autograder: `python -m kdacourse.autograder` in the course, which is `run()` below;
- autograder.json: the assignment: its stages, the time limit per test, the tests' visibility.

`run()` finds the stage folders in the upload (exercises/s01_.../, s01_.../ at the top, or either in
a zip), grades them with kdacourse.grading.grade, untrusted (in the sandbox), and turns its
report.json into results.json: one Gradescope test per exercise of the assignment, worth its points.
Every path comes from an environment variable (AUTOGRADER_ROOT, AUTOGRADER_SUBMISSION,
AUTOGRADER_RESULTS; the scripts also read AUTOGRADER_SOURCE, AUTOGRADER_VENV, AUTOGRADER_PYTHON),
so that a test lays out a folder as Gradescope does.
"""

import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from pathlib import Path

from kdacourse import REPO_ROOT
from kdacourse.catalog import exercises, resolve_stage, stages

CONFIG = "autograder.json"
# Gradescope's options for a test's visibility, but "hidden": every test here carries points, and
# Gradescope hides the total score from a student who has a hidden test.
VISIBILITIES = ("visible", "after_due_date", "after_published")
# How deep under the upload (or a zip in it) a stage folder is looked for: exercises/s01_.../ inside
# the folder a zip was made of is depth 3. No deeper walk through a hostile upload.
SEARCH_DEPTH = 4
UNZIPPED_BYTES = 256 * 2**20  # a zip that unpacks to more is not unpacked (a zip bomb)
UNZIPPED_FILES = 10_000
FAILURES_SHOWN = 10  # failed tests named in one Gradescope test's output
NOT_YOUR_FAULT = ("Nothing graded: the grader could not run here (no sandbox to run your code in, or a fault "
                  "of its own), so it ran none of your code. This is not your fault: tell your instructor, "
                  "whose Gradescope log says why.")
UNIX = 3  # a zip member's create_system: made on Unix, its permissions in the high bits of external_attr

SETUP_SH = """\
#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu; apt-get update
# has run). It installs what grading needs, as `make setup` does: bubblewrap, the sandbox the
# students' code runs in; a virtual environment with torch (CPU build, pinned) and the course.
set -euo pipefail
source_dir=${AUTOGRADER_SOURCE:-${AUTOGRADER_ROOT:-/autograder}/source}
venv=${AUTOGRADER_VENV:-$source_dir/.venv}
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends bubblewrap python3 python3-venv ca-certificates >/dev/null
# the course reads its catalog with tomllib (Python 3.11); Ubuntu 22.04's python3 is 3.10
python=python3
if ! python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  apt-get install -y -qq --no-install-recommends python3.11 python3.11-venv >/dev/null
  python=python3.11
fi
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
# the CPU build of torch, pinned: PyPI's default for Linux is a CUDA build of several GB
"$venv/bin/python" -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu
"$venv/bin/python" -m pip install -q -e "$source_dir"
# the sandbox runs the students' code as nobody: it must be able to read the library and Python
chmod -R a+rX "$source_dir/stages" "$venv"
chmod +x "$source_dir/run_autograder"
# whether the sandbox works in this image, the course made private first as run_autograder makes it:
# where it does not, every submission is refused, not run
"$venv/bin/python" -c 'import kdacourse.autograder as autograder, kdacourse.sandbox as sandbox
autograder.protect_course()
problem = sandbox.sandbox_problem()
print("sandbox:", problem or "works, isolated by " + sandbox.describe(sandbox.chosen_isolation()))'
"""

RUN_AUTOGRADER = """\
#!/usr/bin/env bash
# Gradescope runs this once per submission, as root, in a fresh container: it grades
# /autograder/submission and writes /autograder/results/results.json (kdacourse/autograder.py).
source_dir=${AUTOGRADER_SOURCE:-${AUTOGRADER_ROOT:-/autograder}/source}
python=${AUTOGRADER_PYTHON:-${AUTOGRADER_VENV:-$source_dir/.venv}/bin/python}
cd "$source_dir" || exit 1
# the course in source_dir, whatever else the Python has installed
PYTHONPATH="$source_dir" exec "$python" -m kdacourse.autograder
"""


class AutograderError(Exception):
    """The bundle cannot be made (the message says why)."""


# ------------------------------------------------------------------------------------- the bundle


def make_autograder(out, assignment_stages=None, timeout_per_test=60, visibility="visible"):
    """Write OUT/autograder.zip and OUT/autograder/ for the given stages (default: all); the exit code."""
    from kdacourse.handout import refuse_in_handout

    refused = refuse_in_handout("autograder")
    if refused:
        return refused
    out = Path(out).expanduser().resolve()
    try:
        chosen = _assignment_stages(assignment_stages)
        if visibility not in VISIBILITIES:
            raise AutograderError(f"visibility {visibility!r}: choose one of {', '.join(VISIBILITIES)}")
        if out.exists() and any(out.iterdir()):
            raise AutograderError(f"{out} exists and is not empty")
        if out.is_relative_to(REPO_ROOT):
            raise AutograderError(f"{out} is inside the course: write the bundle somewhere else")
        commit, course_zip, uncommitted = committed_course()
    except AutograderError as error:
        print(f"course autograder: {error}", file=sys.stderr)
        return 2
    config = {"stages": chosen, "timeout_per_test": timeout_per_test, "visibility": visibility, "commit": commit}
    out.mkdir(parents=True, exist_ok=True)
    bundle = out / "autograder.zip"
    write_bundle(bundle, course_zip, config)
    unpack_bundle(bundle, out / "autograder")
    points = sum(exercise.points for exercise in exercises() if exercise.stage in chosen)
    print(f"wrote {bundle} ({bundle.stat().st_size / 2**20:.1f} MiB): the course at commit {commit[:12]}, "
          f"graded on {', '.join(chosen)} ({points} points), {timeout_per_test:g} s per test, tests {visibility}",
          flush=True)
    if uncommitted:
        print(f"left out: {len(uncommitted)} uncommitted change{'s' if len(uncommitted) > 1 else ''} "
              f"(the bundle holds the course as committed)", flush=True)
    print(f"upload it on Gradescope: a Programming Assignment, Configure Autograder, Zip file upload; unpacked in "
          f"{out / 'autograder'}", flush=True)
    return 0


def _assignment_stages(names):
    """The stage folders the assignment grades, in course order; all of them when names is empty."""
    if not names:
        return stages()
    try:
        chosen = {resolve_stage(name) for name in names}
    except ValueError as error:
        raise AutograderError(str(error)) from None
    return [stage for stage in stages() if stage in chosen]


def committed_course():
    """(HEAD's commit, the committed course as zip bytes from `git archive`, the uncommitted changes)."""

    def git(*args):
        try:
            return subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError) as error:
            detail = getattr(error, "stderr", b"") or b""
            raise AutograderError(f"the bundle holds the course as committed, read with git, which failed "
                                  f"(git {' '.join(args)}): {detail.decode(errors='replace').strip() or error}"
                                  ) from None

    commit = git("rev-parse", "HEAD").decode().strip()
    course_zip = git("archive", "--format=zip", commit)
    uncommitted = git("status", "--porcelain").decode().splitlines()
    return commit, course_zip, uncommitted


def write_bundle(path, course_zip, config):
    """The zip Gradescope takes: the committed course, with setup.sh, run_autograder and the
    assignment's autograder.json at its root (the scripts executable)."""
    added = {"setup.sh": (SETUP_SH, 0o755), "run_autograder": (RUN_AUTOGRADER, 0o755),
             CONFIG: (json.dumps(config, indent=2) + "\n", 0o644)}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as bundle, \
            zipfile.ZipFile(io.BytesIO(course_zip)) as course:
        members = course.infolist()
        clashes = sorted(set(added) & {member.filename for member in members})
        if clashes:
            raise AutograderError(f"the course has files named as the bundle's own: {', '.join(clashes)}")
        for member in members:
            executable = member.create_system == UNIX and (member.external_attr >> 16) & 0o111
            bundle.writestr(_unix_member(member, 0o755 if executable or member.is_dir() else 0o644),
                            course.read(member))
        stamp = members[0].date_time if members else (1980, 1, 1, 0, 0, 0)  # the commit's time
        for name, (text, mode) in added.items():
            info = zipfile.ZipInfo(name, date_time=stamp)
            info.compress_type = zipfile.ZIP_DEFLATED
            bundle.writestr(_unix_member(info, mode), text)


def _unix_member(member, mode):
    """The member marked as made on Unix, with permissions `mode`: git archive marks the files that are
    not executable as made on MS-DOS, without permissions, which unzip tools then read each their own way."""
    member.create_system = UNIX
    kind = stat.S_IFDIR if member.is_dir() else stat.S_IFREG
    member.external_attr = ((kind | mode) << 16) | (member.external_attr & 0xFFFF)
    return member


def unpack_bundle(path, into):
    """Unpack the bundle into `into` as Gradescope does, keeping the executable bits of its files."""
    into = Path(into)
    with zipfile.ZipFile(path) as bundle:
        for member in bundle.infolist():
            target = Path(bundle.extract(member, into))
            if member.create_system == UNIX:
                target.chmod((member.external_attr >> 16) & 0o777)


# -------------------------------------------------------------------------- grading one submission


def environment_paths(environ=None):
    """(submission folder, results folder) as Gradescope lays them out, or as AUTOGRADER_* say."""
    environ = os.environ if environ is None else environ
    root = Path(environ.get("AUTOGRADER_ROOT", "/autograder"))
    return (Path(environ.get("AUTOGRADER_SUBMISSION", root / "submission")),
            Path(environ.get("AUTOGRADER_RESULTS", root / "results")))


def run(environ=None):
    """Grade the upload and write results.json (always, even when grading could not run); the exit
    code: 0 once graded, 1 when the grader could not grade (no sandbox here: results.json says so)."""
    submission, results_folder = environment_paths(environ)
    if not (REPO_ROOT / CONFIG).is_file():
        print(f"{REPO_ROOT} is not an autograder bundle (no {CONFIG}): make one with `course autograder OUT`",
              file=sys.stderr)
        return 2
    config = json.loads((REPO_ROOT / CONFIG).read_text(encoding="utf-8"))
    assignment = [exercise for exercise in exercises() if exercise.stage in config["stages"]]
    started = time.monotonic()
    try:
        protect_course(results_folder)
        with tempfile.TemporaryDirectory(prefix="autograder-") as scratch:
            results, code = grade_upload(submission, Path(scratch), assignment, config)
    except Exception:  # the grader's own failure: results.json still says that nothing was graded
        results, code = gradescope_results(assignment, None, config, [NOT_YOUR_FAULT],
                                           grader_problem=traceback.format_exc()), 1
    results["execution_time"] = round(time.monotonic() - started)
    if results["extra_data"]["grader_problem"]:
        print(f"the grader could not grade: {results['extra_data']['grader_problem']}", flush=True)
    results_folder.mkdir(parents=True, exist_ok=True)
    written = results_folder / "results.json.part"
    written.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    written.replace(results_folder / "results.json")
    print(f"results.json: {results['output'].splitlines()[0]}", flush=True)
    return code


def protect_course(results_folder=None):
    """Make the course the grader's alone, as root in Gradescope's container: each entry of the course
    but its Python environment loses every permission of group and others, and the results folder
    their write permission. A sandbox that runs the student's code as a user of its own (where no
    namespace can be made: kdacourse.sandbox's own-user isolation) then reaches neither the solutions
    nor the tests, and cannot write what Gradescope reads; under bubblewrap this changes nothing."""
    if os.geteuid() != 0:
        return
    environment = os.path.realpath(sys.prefix)
    for entry in REPO_ROOT.iterdir():
        real = os.path.realpath(entry)
        if entry.is_symlink() or environment == real or environment.startswith(real + os.sep):
            continue
        entry.chmod(stat.S_IMODE(entry.stat().st_mode) & ~0o077)
    if results_folder is not None:
        results_folder.mkdir(parents=True, exist_ok=True)
        results_folder.chmod(stat.S_IMODE(results_folder.stat().st_mode) & ~0o022)


def grade_upload(submission, scratch, assignment, config):
    """(results.json's content, exit code) for the upload in `submission`; `scratch` is the grader's."""
    from kdacourse.grading import grade
    from kdacourse.sandbox import sandbox_problem

    found, notes = find_stage_folders(submission, config["stages"], scratch / "unzipped")
    if not found:
        expected = ", ".join(config["stages"])
        loose = " (or, for this one stage, its files)" if len(config["stages"]) == 1 else ""
        return gradescope_results(assignment, None, config, notes + [
            f"Nothing graded: your upload has no folder of this assignment's stages ({expected}). Upload your "
            f"exercises/ folder, its stage folders{loose}, or a zip of either."]), 0
    problem = sandbox_problem()
    if problem:
        return gradescope_results(assignment, None, config, notes + [NOT_YOUR_FAULT],
                                  grader_problem=f"no sandbox in this container: {problem}"), 1
    folder = scratch / "graded"
    copy_stage_folders(found, folder)
    reports = scratch / "reports"
    code = grade(folder, reports, timeout_per_test=config["timeout_per_test"], trust=False)
    if code != 0:
        return gradescope_results(assignment, None, config, notes + [NOT_YOUR_FAULT],
                                  grader_problem=f"course grade ended with exit code {code}"), 1
    report = json.loads((reports / "report.json").read_text(encoding="utf-8"))
    where = ", ".join(_shown_path(path, submission, scratch / "unzipped") for path in found.values())
    return gradescope_results(assignment, report, config, notes + [f"Graded from your upload: {where}."]), 0


def _shown_path(path, submission, unzipped):
    """A found folder as the student would name it: relative to the upload, a zip's name first."""
    for root in (submission, unzipped):
        if path.is_relative_to(root):
            return "the files at its top" if path == root else str(path.relative_to(root))
    return path.name


def find_stage_folders(submission, wanted, unzip_into):
    """({stage: its folder}, notes for the student) for the stages `wanted` in the upload.

    The upload may hold the exercises/ folder, stage folders at its top, or zips of either (each
    unpacked into unzip_into/<zip's name>/). A stage's folder is the shallowest folder of its name,
    the upload before the zips. An assignment of one stage also takes its exercise files loose at
    the top of the upload or of a zip (students drag files). Links are never followed: a stage folder
    that is a link is taken as it is (the cheating checks then score it zero, and say why), a link to
    another folder is not searched.
    """
    submission = Path(submission)
    roots, notes = [], []
    if submission.is_dir():
        roots.append(submission)
        for archive in sorted(submission.glob("*.zip")):
            if archive.is_symlink() or not archive.is_file():
                continue
            try:
                roots.append(unpack_upload_zip(archive, Path(unzip_into) / archive.name))
            except (zipfile.BadZipFile, AutograderError, OSError) as error:
                notes.append(f"{archive.name} was not unpacked: {error}")
    found = {}
    level = roots
    for _ in range(SEARCH_DEPTH):
        deeper = []
        for folder in level:
            for child in sorted(folder.iterdir()):
                if child.name in wanted and child.name not in found and (child.is_dir() or child.is_symlink()):
                    found[child.name] = child
                elif child.is_dir() and not child.is_symlink() and not child.name.startswith((".", "__")):
                    deeper.append(child)
        level = deeper
    if len(wanted) == 1 and not found:
        files = [exercise.file for exercise in exercises() if exercise.stage == wanted[0]]
        loose = [root for root in roots if any(os.path.lexists(root / file) for file in files)]
        if loose:
            found[wanted[0]] = loose[0]
    return {stage: found[stage] for stage in wanted if stage in found}, notes


def unpack_upload_zip(archive, into):
    """Unpack a student's zip into `into`, refusing one that unpacks too large. zipfile drops
    absolute paths and '..' from member names, and writes a link as a file holding its target."""
    with zipfile.ZipFile(archive) as upload:
        members = [member for member in upload.infolist() if not member.is_dir()]
        size = sum(member.file_size for member in members)
        if size > UNZIPPED_BYTES or len(members) > UNZIPPED_FILES:
            raise AutograderError(f"it unpacks to {len(members)} files, {size / 2**20:.0f} MiB, more than the "
                                  f"{UNZIPPED_FILES} files or {UNZIPPED_BYTES / 2**20:.0f} MiB allowed")
        for member in members:
            upload.extract(member, into)
    return into


def copy_stage_folders(found, folder):
    """Copy each found stage folder into `folder` (links copied as links, never followed), so that
    grade() sees one folder laid out like exercises/ holding only the assignment's stages."""
    folder.mkdir(parents=True)
    for stage, source in found.items():
        if source.is_symlink():
            os.symlink(os.readlink(source), folder / stage)
        else:
            shutil.copytree(source, folder / stage, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))


# ------------------------------------------------------------------------------------ results.json


def gradescope_results(assignment, report, config, notes, grader_problem=None):
    """results.json (Gradescope's format) from grade's report.json: one test per exercise of the
    assignment, scored with its points; an exercise that was not graded scores 0 and says why.

    report None: nothing was graded (the notes say why). grader_problem: why the grader could not
    grade, for the instructor (in extra_data; run() prints it to the log Gradescope shows them).
    """
    entries = {entry["id"]: entry for entry in (report or {}).get("exercises", [])}
    tests = []
    position = {}
    for exercise in assignment:
        stage_number = int(exercise.stage[1:3])
        position[stage_number] = position.get(stage_number, 0) + 1
        entry = entries.get(exercise.id)
        score = entry["points"] if entry else 0
        tests.append({
            "name": f"{exercise.id}: {exercise.file} ({exercise.kind})",
            "number": f"{stage_number}.{position[stage_number]}",
            "score": score,
            "max_score": exercise.points,
            "status": "passed" if entry and entry["passed"] else "failed",
            "output": _test_output(exercise, entry, report is not None),
            "output_format": "text",
            "tags": [exercise.stage, exercise.kind],
            "visibility": config["visibility"],
        })
    score = sum(test["score"] for test in tests)
    maximum = sum(exercise.points for exercise in assignment)
    passed = sum(test["status"] == "passed" for test in tests)
    summary = [f"{score} of {maximum} points: {passed} of {len(tests)} exercises pass."]
    if report is not None:
        summary.append(f"Your code ran in a sandbox, isolated by {report.get('isolation_described', 'bubblewrap')}; "
                       f"{config['timeout_per_test']:g} s per test. An exercise earns its points when all "
                       f"of its tests pass.")
    return {
        "score": score,
        "output": "\n".join(summary + notes),
        "output_format": "text",
        "visibility": config["visibility"],
        "stdout_visibility": "hidden",
        "tests": tests,
        "extra_data": {"course_commit": config.get("commit"), "stages": config["stages"],
                       "sandbox": bool(report and report.get("sandbox")),
                       "isolation": (report or {}).get("isolation"), "grader_problem": grader_problem},
    }


def _test_output(exercise, entry, graded):
    """What one exercise's Gradescope test shows: the verdict, the failed tests, the section to read."""
    from kdacourse.sitelinks import read_location

    if entry is None:
        return (f"not graded: your upload has no folder {exercise.stage}/" if graded
                else "not graded: see the submission's output above")
    head = f"{entry['tests_passed']} of {entry['tests_total']} tests pass, {entry['seconds']:g} s"
    if entry["passed"]:
        skipped = entry["tests_total"] - entry["tests_passed"]  # compile-only and GPU tests skip in the sandbox
        return f"passed ({head}{f'; {skipped} skipped here' if skipped else ''})"
    failures = entry["failures"]
    lines = [f"failed ({head})", *(f"- {failure}" for failure in failures[:FAILURES_SHOWN])]
    if len(failures) > FAILURES_SHOWN:
        lines.append(f"- and {len(failures) - FAILURES_SHOWN} more")
    lines.append(f"read: {read_location(exercise.read)}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(run())
