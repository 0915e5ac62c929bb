"""The `course` command: the entry point for students and instructors.

    course check [STAGE|EXERCISE]   run your exercises (a stage's, or one), see what passes and what to read next
    course grade FOLDER --out DIR   grade a folder laid out like exercises/ (instructors)
    course grade-all DIR --out DIR  grade a class, one folder per student: a gradebook CSV and each one's reports
    course serve                    build the site and serve it on http://127.0.0.1:8000
    course build                    build the site into site/ (mkdocs build --strict)
    course regenerate               rewrite every generated table, plot and report under docs/
    course test [PYTEST ARGS]       lint with ruff, then run the test suite on the solutions (what CI runs)
    course handout OUT              write what a student receives into OUT: no solutions, no solution code on the pages
    course autograder OUT           write a Gradescope autograder bundle into OUT: graded one container per submission
"""

import argparse
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(prog="course", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    check = commands.add_parser("check", help="run your exercises and say what to read next")
    check.add_argument("stage", nargs="?", help="s01, 1 or s01_linear_attention, or one exercise such as "
                       "s02.build_kernel (default: every stage)")
    check.add_argument("--target", default="exercises", help="folder to check (default: exercises/)")
    check.add_argument("--compile", action="store_true",
                       help="also run the compile-only tests (lower the kernels for sm_90a with nvcc; slow)")

    grade = commands.add_parser("grade", help="grade a folder laid out like exercises/")
    grade.add_argument("folder", help="the submission: a folder with s01_linear_attention/... inside")
    _grading_options(grade, "folder for report.md, report.json and junit.xml")

    grade_all = commands.add_parser("grade-all", help="grade every student folder of a folder, in parallel")
    grade_all.add_argument("submissions", help="a folder with one folder per student, each laid out like exercises/")
    _grading_options(grade_all, "folder for gradebook.csv and each student's reports")
    grade_all.add_argument("--stages", nargs="+", metavar="STAGE",
                           help="grade only these stages: s01, 1 or s01_linear_attention (default: every stage a "
                                "student handed in); the gradebook's max counts them")
    grade_all.add_argument("--leaderboard", action="store_true",
                           help="add each passed tune exercise's counted cost to the gradebook and rank the class "
                                "by it in leaderboard.csv (builds each program once more, in the sandbox)")

    serve = commands.add_parser("serve", help="build the course site and serve it locally")
    serve.add_argument("--port", type=int, default=8000, help="the port to serve on (default: 8000)")
    serve.add_argument("--no-browser", action="store_true", help="do not open a browser")

    commands.add_parser("build", help="build the site into site/ with mkdocs --strict")
    commands.add_parser("regenerate", help="rewrite every generated file under docs/")

    handout = commands.add_parser("handout", help="write a student handout: the course without its answers")
    handout.add_argument("out", help="a new or empty folder outside the course")

    autograder = commands.add_parser("autograder", help="write a Gradescope autograder bundle (autograder.zip)")
    autograder.add_argument("out", help="a new or empty folder outside the course")
    autograder.add_argument("--stages", nargs="+", metavar="STAGE",
                            help="the stages the assignment grades: s01, 1 or s01_linear_attention (default: all)")
    autograder.add_argument("--timeout", type=float, default=60, help="seconds allowed per test (default 60)")
    autograder.add_argument("--visibility", default="visible",
                            choices=["visible", "after_due_date", "after_published"],
                            help="when students see the tests' results (Gradescope's setting; default visible)")

    test = commands.add_parser("test", help="run the test suite (what .ci/run runs)",
                               description="Lint with ruff, then run the test suite on the solutions (what .ci/run "
                               "runs). Every argument goes to pytest, e.g. `course test tests/course/test_handout.py -x -q`; "
                               "pytest's own options: python -m pytest --help.")
    test.add_argument("pytest_args", nargs=argparse.REMAINDER, help="passed on to pytest")

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["test"] and argv[1:] in (["-h"], ["--help"]):  # the course's help, not pytest's
        test.print_help()
        return 0
    if argv[:1] == ["test"]:  # everything after `test` belongs to pytest, options included
        from kdacourse.handout import refuse_in_handout

        return refuse_in_handout("test") or _test(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "check":
        from kdacourse.grading import check

        return check(args.stage, args.target, compile=args.compile)
    if args.command == "grade":
        from kdacourse.grading import grade

        return grade(args.folder, args.out, timeout_per_test=args.timeout, trust=args.trust)
    if args.command == "grade-all":
        from kdacourse.gradeall import grade_all

        return grade_all(args.submissions, args.out, timeout_per_test=args.timeout, trust=args.trust,
                         leaderboard=args.leaderboard, only_stages=args.stages)
    if args.command == "serve":
        from kdacourse.site import serve

        return serve(port=args.port, open_browser=not args.no_browser)
    if args.command == "build":
        from kdacourse.site import build

        return build()
    if args.command == "regenerate":
        from kdacourse.handout import refuse_in_handout

        refused = refuse_in_handout("regenerate")
        if refused:
            return refused
        from kdacourse.pages import regenerate

        return regenerate()
    if args.command == "handout":
        from kdacourse.handout import make_handout

        return make_handout(args.out)
    if args.command == "autograder":
        from kdacourse.autograder import make_autograder

        return make_autograder(args.out, args.stages, timeout_per_test=args.timeout, visibility=args.visibility)
    parser.error(f"unknown command {args.command}")


def _grading_options(parser, out_help):
    parser.add_argument("--out", required=True, help=out_help)
    parser.add_argument("--timeout", type=float, default=60,
                        help="wall-clock seconds one call of the graded code may run before it is stopped and its test "
                        "fails (with --trust: the whole test function); the exercise's other tests then fail at once; "
                        "a whole exercise may take 5 times this, and 30 s to start (default 60)")
    parser.add_argument("--trust", action="store_true",
                        help="run the code as yourself, without the sandbox (only for code you trust: your own)")


def _test(pytest_args):
    import os
    import shutil
    import tempfile

    import pytest

    lint = _lint()
    if lint:
        return lint
    # One pytest worker per core (pytest-xdist), unless the arguments choose: the suite is mostly
    # NumPy, TileLang's lowering and nvcc, each on one core. Tests that share one computation in a
    # process (the kill matrix, the built site) are kept on one worker by their xdist_group.
    chosen = any(arg in ("-n", "--numprocesses", "no:xdist") or arg.startswith(("--numprocesses=", "-n="))
                 or (arg.startswith("-n") and arg[2:].isdigit()) for arg in pytest_args)
    workers = [] if chosen else ["-n", "auto", "--dist", "loadgroup"]
    # The workers, and the pytest processes the tests start, share the kernels lowered and nvcc's logs
    # (tilelang_tools.lower_kernel, ptxas_log).
    cache = None if os.environ.get("KDACOURSE_COMPILE_CACHE") else tempfile.mkdtemp(prefix="course-compile-")
    if cache:
        os.environ["KDACOURSE_COMPILE_CACHE"] = cache
    try:
        # The exercise tests check the solutions here; the student's copy is checked by `course check`,
        # and tests/course/test_exercise_model.py checks that the shipped exercises fail and every bug is caught.
        return int(pytest.main(["-p", "no:cacheprovider", "--target=solutions", *workers, *pytest_args]))
    finally:
        if cache:
            del os.environ["KDACOURSE_COMPILE_CACHE"]
            shutil.rmtree(cache, ignore_errors=True)


def _lint():
    """ruff over the repository, with the rules of pyproject.toml's [tool.ruff]; its exit code (0: clean)."""
    import importlib.util
    import subprocess

    from kdacourse import REPO_ROOT

    if importlib.util.find_spec("ruff") is None:
        print("course test lints with ruff, which is not installed: pip install -e '.[test]'", file=sys.stderr)
        return 2
    print("ruff check (pyproject.toml's [tool.ruff])", flush=True)
    return subprocess.run([sys.executable, "-m", "ruff", "check", str(REPO_ROOT)], cwd=REPO_ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
