"""`course test` runs a pytest worker per core (pytest-xdist, --dist loadgroup); the tests that share
one computation in a process must land on one worker (tests/conftest.py's xdist_group), or the
computation is made once per worker and CI pays for it twice. This runs a small suite that way."""

import os
import subprocess
import sys
import textwrap

from kdacourse import REPO_ROOT

SUITE = {
    "conftest.py": f"""
        import sys
        sys.path.insert(0, {str(REPO_ROOT)!r})
        from tests.conftest import pytest_collection_modifyitems  # noqa: F401  (the hook under test)
    """,
    "test_shared.py": """
        import os
        import pytest

        def note(log):
            with open(os.path.join(os.environ["WORKER_LOGS"], log), "a") as file:
                file.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")

        @pytest.fixture(scope="module")
        def computed_once():
            note("fixture.log")

        @pytest.mark.parametrize("case", range(6))
        def test_reads_the_shared_computation(computed_once, case):
            pass

        @pytest.mark.parametrize("case", range(6))
        def test_kill_matrix_reader(case):
            note("kill_matrix.log")

        @pytest.mark.parametrize("case", range(12))
        def test_alone(case):
            pass
    """,
}


def run_suite(folder, dist):
    """Run SUITE in `folder` with two workers under `dist`; {log name: the workers it names}."""
    for name, text in SUITE.items():
        (folder / name).write_text(textwrap.dedent(text))
    completed = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", dist, "-p", "no:cacheprovider", "-q",
         "--rootdir", str(folder), str(folder)],
        cwd=folder, capture_output=True, text=True, timeout=300, env={**os.environ, "WORKER_LOGS": str(folder)},
    )
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert "24 passed" in completed.stdout, completed.stdout[-2000:]
    return {log: set((folder / log).read_text().split()) for log in ("fixture.log", "kill_matrix.log")}


def test_a_group_runs_on_one_worker(tmp_path):
    workers = run_suite(tmp_path, "loadgroup")
    assert len(workers["fixture.log"]) == 1, "a module-scoped fixture was made on both workers"
    assert len(workers["kill_matrix.log"]) == 1, "the kill matrix's readers ran on both workers"


def test_the_groups_are_handed_out_first(tmp_path):
    """The scheduler hands tests out in collection order: a long group collected last would run alone
    at the end of the run, the other worker idle."""
    (tmp_path / "conftest.py").write_text(textwrap.dedent(SUITE["conftest.py"]))
    (tmp_path / "test_a_alone.py").write_text("def test_alone():\n    pass\n")
    (tmp_path / "test_b_shared.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.fixture(scope="module")
        def computed_once():
            return 1

        def test_reads_the_shared_computation(computed_once):
            pass
    """))
    completed = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                                "--rootdir", str(tmp_path), str(tmp_path)],
                               cwd=tmp_path, capture_output=True, text=True, timeout=120)
    collected = [line for line in completed.stdout.splitlines() if "::" in line]
    assert [line.split("::")[0] for line in collected] == ["test_b_shared.py", "test_a_alone.py"], completed.stdout
