"""kdacourse.prefork: runs forked from one server give what fresh pytest processes give, and a run
past its limit is killed without taking the others with it."""

from kdacourse.catalog import bugs
from kdacourse.killmatrix import file_tests
from kdacourse.prefork import run_many
from kdacourse.runner import run_tests

# a bug of a NumPy exercise and one of a kernel exercise (TileLang imported, its program run through the
# interpreter), both quick to run: a puzzle's; and a kernel exercise whose tests outlast a short limit
NUMPY_BUG = next(bug for bug in bugs() if bug.stage.startswith("s04") and bug.file == "chunkwise.py")
KERNEL_BUG = next(bug for bug in bugs() if bug.stage.startswith("s00"))
SLOW_BUG = next(bug for bug in bugs() if bug.stage.startswith("s04") and bug.file == "kernel_program.py")


def runs_of(bug):
    """The bug's run and the solutions' run of the bug's exercise tests."""
    tests = [file_tests(bug.stage, bug.file)]
    return [{"target": f"bug:{bug.id}", "test_paths": tests, "extra_args": ("-m", "not compile")},
            {"target": "solutions", "test_paths": tests, "extra_args": ("-m", "not compile")}]


def test_forked_runs_give_what_fresh_processes_give():
    runs = runs_of(NUMPY_BUG) + runs_of(KERNEL_BUG)
    forked = run_many(runs, workers=2)
    for run, result in zip(runs, forked):
        fresh = run_tests(**run)
        assert result.outcomes and result.outcomes == fresh.outcomes, (run, result.output[-2000:])
        assert result.returncode == fresh.returncode
    bug_runs, solution_runs = forked[0::2], forked[1::2]
    assert all(result.failed() for result in bug_runs), "a forked run lost its target's bug"
    assert all(result.all_passed() for result in solution_runs)


def test_a_run_past_its_limit_is_killed_and_the_others_end():
    slow, quick = runs_of(SLOW_BUG)[1], runs_of(NUMPY_BUG)[1]
    killed, ended = run_many([{**slow, "timeout_total": 0.5}, quick], workers=1)
    assert killed.timed_out and killed.returncode == -1 and "[stopped after 0.5 s]" in killed.output
    assert not ended.timed_out and ended.all_passed()
