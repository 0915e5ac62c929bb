"""benchmarks.gpu_check on a CPU: its parts are well formed (each fits a device call, names commands
and modules that exist, with arguments its benchmarks accept), its GPU test steps run every GPU test
exactly once, and a part's mechanics (logs, the chatter dropped, a step killed at its limit, what
--collect puts where) on small commands of its own."""

import subprocess
import sys

import pytest

from benchmarks import gpu_check
from kdacourse import REPO_ROOT

PARTS = gpu_check.parts()


def test_the_list_names_every_part_and_step():
    listed = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "--list"], cwd=REPO_ROOT,
                            capture_output=True, text=True, check=True).stdout
    for part in PARTS.values():
        assert f"{part.name} (at most {part.limit_s()} s" in listed
        assert all(f"    {step.name} ({step.limit_s} s)" in listed for step in part.steps)
    assert sys.executable not in listed  # written as a person types it


@pytest.mark.parametrize("name", PARTS)
def test_each_part_fits_a_device_call_and_names_what_exists(name):
    assert gpu_check.problems(PARTS[name]) == []
    assert PARTS[name].limit_s() <= gpu_check.PART_LIMIT_S < 540  # 9 minutes


def test_problems_are_found():
    slow = gpu_check.Step("slow", gpu_check.python("-m", "benchmarks.no_such_module"), 400)
    imports = gpu_check.Step("imports", gpu_check.python("-c", "from benchmarks.profile_s05 import no_such_function"),
                             200)
    found = gpu_check.problems(gpu_check.Part("p", "", (slow, imports, slow)))
    assert found == ["p: its steps' limits come to 1000 s, past 530 s", "p: two steps share a name",
                     "p/slow: no module benchmarks.no_such_module",
                     "p/imports: benchmarks.profile_s05 defines no no_such_function", "p/slow: no module "
                     "benchmarks.no_such_module"]
    assert gpu_check.problems(gpu_check.Part("p", "", (slow, imports), side_by_side=True))[0].startswith("p/slow")
    missing = gpu_check.Step("missing", gpu_check.python("scripts/no_such_script.py"), 100)
    assert gpu_check.problems(gpu_check.Part("p", "", (missing,))) == ["p/missing: no script scripts/no_such_script.py"]


def test_the_scripts_accept_their_steps_arguments(tmp_path):
    import importlib.util

    steps = [step for part in PARTS.values() for step in part.steps if step.command[1].endswith(".py")]
    assert steps, "no part runs a script"
    for step in steps:
        spec = importlib.util.spec_from_file_location("script", REPO_ROOT / step.command[1])
        script = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(script)
        script.parse_args(step.argv(tmp_path)[2:])  # argparse exits on an argument it does not know
        with pytest.raises(SystemExit):
            script.parse_args([*step.argv(tmp_path)[2:], "--no-such-option"])


def test_a_dry_run_checks_and_prints_without_running(tmp_path):
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "all", str(tmp_path / "out"), "--dry-run"],
                          cwd=REPO_ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert sum(len(part.steps) for part in PARTS.values()) == len(done.stdout.splitlines())
    assert not (tmp_path / "out").exists()
    unknown = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check", "no-such-part", str(tmp_path)],
                             cwd=REPO_ROOT, capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown part 'no-such-part'" in unknown.stderr


def _steps_running(module):
    return [(part, step) for part in PARTS.values() for step in part.steps
            if list(step.command[:3]) == [sys.executable, "-m", module]]


@pytest.mark.parametrize("module", ["benchmarks.fair", "benchmarks.backward", "benchmarks.varlen",
                                    "benchmarks.decode", "benchmarks.train_kda"])
def test_the_benchmarks_accept_their_steps_arguments(module, tmp_path):
    import importlib

    parse_args = importlib.import_module(module).parse_args
    steps = _steps_running(module)
    assert steps, f"no part runs {module}"
    for _, step in steps:
        parse_args(step.argv(tmp_path)[3:])  # argparse exits on an argument it does not know


def test_bench_accepts_its_steps_arguments(tmp_path, capsys):
    """bench parses its arguments in main, then needs CUDA: a known argument list gets that far (2 and
    its message), an unknown one stops argparse (SystemExit)."""
    from benchmarks import bench

    steps = _steps_running("benchmarks.bench")
    assert {stage for _, step in steps for stage in step.command[step.command.index("--stages") + 1].split(",")} \
        == set(bench.STAGES)  # every stage timed and studied
    for _, step in steps:
        assert bench.main(step.argv(tmp_path)[3:]) == 2
    assert "torch sees none" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--no-such-flag"])


def test_every_committed_result_a_step_writes_is_one_the_repository_holds_or_a_new_name():
    """Each step's destinations lie in benchmarks/results/ or tests/gpu_results/; no two steps write one file."""
    destinations = []
    for part in PARTS.values():
        for step in part.steps:
            if step.log_to:
                destinations.append(step.log_to)
            if step.files_to and step.files_to != gpu_check.MERGE:
                destinations += [f"{step.files_to}/{name}" for name in step.renamed.values()]
    assert all(d.startswith((gpu_check.RESULTS + "/", gpu_check.GPU_TEST_RESULTS + "/")) for d in destinations)
    assert len(set(destinations)) == len(destinations)
    decode_csvs = {d.rsplit("/", 1)[1] for d in destinations if d.endswith(".csv")}
    from kdacourse.pages.serving_benchmarks import DECODE_BATCH_RUNS, DECODE_THREAD_RUNS

    assert set(DECODE_BATCH_RUNS) | set(DECODE_THREAD_RUNS) == decode_csvs  # every decode CSV a page reads


@pytest.fixture(scope="module")
def gpu_test_ids():
    """The node ids of every GPU test, as `pytest -m gpu tests` collects them."""
    done = subprocess.run([sys.executable, "-m", "pytest", "tests", "-m", "gpu", "--collect-only", "-q",
                           "--target=solutions", "-p", "no:cacheprovider"], cwd=REPO_ROOT, capture_output=True,
                          text=True)
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    assert ids, done.stdout + done.stderr
    return ids


def selected(expression, node_id):
    """Whether `pytest -k expression` selects the test `node_id`: each name of the expression matched, as
    pytest matches it, case-insensitively against the names along the test's id (its folders, file,
    function and parameters)."""
    from _pytest.mark.expression import Expression

    return Expression.compile(expression).evaluate(lambda name: name.lower() in node_id.lower())


def test_the_kimi_call_parts_run_every_case_once_and_the_accuracy_once(monkeypatch):
    """Every case of benchmarks.kimi_call in exactly one kimi-call part, three at most a part (FLA's
    autotuning, about 90 s a case), the float64 check in one part alone."""
    import os

    monkeypatch.setenv("FLA_FLASH_KDA", os.environ.get("FLA_FLASH_KDA", "0"))  # kimi_call sets it on import
    from benchmarks import kimi_call

    groups = gpu_check.KIMI_CALL_GROUPS.values()
    cases = [case for group_cases, _, _ in groups for case in group_cases]
    assert sorted(cases) == sorted(kimi_call.CASES) and all(len(group_cases) <= 3 for group_cases, _, _ in groups)
    steps = [step for name, part in gpu_check.parts().items() if name.startswith("kimi-call-")
             for step in part.steps if "benchmarks.kimi_call" in step.command]
    assert len(steps) == len(gpu_check.KIMI_CALL_GROUPS)
    assert sum("--no-accuracy" not in step.command for step in steps) == 1


def test_the_gpu_test_steps_run_every_gpu_test_exactly_once(gpu_test_ids):
    steps = gpu_check.gpu_test_steps()
    for node_id in gpu_test_ids:
        taken = [name for name, (expression, _, _) in steps.items() if selected(expression, node_id)]
        assert len(taken) == 1, f"{node_id} is run by {taken or 'no step'}"
    ran = {name: sum(selected(expression, node_id) for node_id in gpu_test_ids)
           for name, (expression, _, _) in steps.items()}
    assert all(ran.values()), f"steps that run no test: {[name for name, count in ran.items() if not count]}"


def test_the_fla_steps_take_the_comparisons_with_fla_and_nothing_else(gpu_test_ids):
    """FLA's autotuning costs minutes a process: its comparisons have parts of their own, one test a worker."""
    steps = gpu_check.gpu_test_steps()
    fla = [node_id for node_id in gpu_test_ids
           if any(selected(steps[name][0], node_id) for name in ("gpu_tests_fla_forward", "gpu_tests_fla_backward"))]
    assert fla and all("fla" in node_id.split("::")[-1].replace("flags", "") for node_id in fla)
    for name in ("gpu_tests_fla_forward", "gpu_tests_fla_backward"):
        workers = int(steps[name][1][steps[name][1].index("-n") + 1])
        assert sum(selected(steps[name][0], node_id) for node_id in gpu_test_ids) <= workers


def _fake_part():
    say = gpu_check.python("-c", "print('TileLang ' + 'begins to compile'); print('kept'); "
                           f"open('{gpu_check.FILES}/r.csv', 'w').write('a\\n')")
    sleep = gpu_check.python("-c", "import time; print('slow', flush=True); time.sleep(60)")
    return gpu_check.Part("fake", "a part of two steps", (
        gpu_check.Step("quick", say, 30, log_to="tests/gpu_results/quick.log", files_to="benchmarks/results",
                       renamed={"r.csv": "renamed.csv"}),
        gpu_check.Step("stuck", sleep, 2, log_to="tests/gpu_results/stuck.log")))


def test_a_part_writes_each_steps_log_without_the_chatter_and_stops_a_step_at_its_limit(tmp_path, monkeypatch):
    part = _fake_part()
    assert gpu_check.run_part(part, tmp_path / "out") == 1  # one step failed
    folder = tmp_path / "out" / "fake"
    quick = (folder / "quick.log").read_text()
    assert "kept" in quick and "TileLang begins" not in quick and quick.startswith("command: ")
    assert quick.rstrip().splitlines()[-1].startswith("exit: 0")
    assert "killed at its limit" in (folder / "stuck.log").read_text()
    steps = (folder / "steps.log").read_text()
    assert "end quick: rc=0" in steps and "timed out" in steps.split("end stuck")[1]
    assert (folder / "quick" / "r.csv").read_text() == "a\n" and (folder / "machine.log").exists()

    monkeypatch.setattr(gpu_check, "parts", lambda: {"fake": part})
    root = tmp_path / "repository"
    done = gpu_check.collect(tmp_path / "out", root=root, merge=lambda runs: pytest.fail("no bench step here"))
    assert (root / "benchmarks/results/renamed.csv").read_text() == "a\n"
    collected = (root / "tests/gpu_results/quick.log").read_text()
    assert "kept" in collected and collected.splitlines()[1].startswith("command: ")
    assert collected.startswith("ran on: ") and "; commit " in collected.splitlines()[0]  # where it ran
    assert not (root / "tests/gpu_results/stuck.log").exists()  # a failed step is not collected
    assert any("stuck: not collected" in line for line in done)


def test_the_machine_line_names_the_card_and_the_commit(tmp_path):
    log = tmp_path / "machine.log"
    log.write_text("$ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader\n"
                   "NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB\n$ git -C /r rev-parse --short HEAD\n9970f56\n"
                   "the files' git tree (benchmarks.gpu_check.files_tree): acd6ddf\n")
    assert gpu_check.machine_line(log) == "ran on: NVIDIA H100 80GB HBM3, 580.159.04, 81559 MiB; commit 9970f56\n"
    log.write_text("$ nvidia-smi --query-gpu=name --format=csv,noheader\n[Errno 2] No such file\n$ git rev-parse\n"
                   "\n")
    assert gpu_check.machine_line(log) == "ran on: [Errno 2] No such file; commit ?\n"
    assert gpu_check.machine_line(tmp_path / "none.log") == ""


def test_collect_folds_bench_runs_in_with_merge(tmp_path, monkeypatch):
    step = gpu_check.Step("bench_x", gpu_check.python("-c", "pass"), 10, files_to=gpu_check.MERGE)
    monkeypatch.setattr(gpu_check, "parts", lambda: {"b": gpu_check.Part("b", "", (step,))})
    (tmp_path / "out" / "b" / "bench_x").mkdir(parents=True)
    (tmp_path / "out" / "b" / "bench_x.log").write_text("log")
    (tmp_path / "out" / "b" / "steps.json").write_text('[{"step": "bench_x", "rc": 0}]')
    merged = []
    gpu_check.collect(tmp_path / "out", root=tmp_path, merge=merged.extend)
    assert merged == [str(tmp_path / "out" / "b" / "bench_x")]


def test_a_second_check_on_one_machine_is_refused_while_a_part_runs(tmp_path, monkeypatch, capsys):
    """Parts run one after another: while a process holds the machine's lock, another check refuses
    (before it reads the GPU) and says why; once the lock is let go, it may take it."""
    monkeypatch.setattr(gpu_check, "LOCK_FILE", tmp_path / "gpu-check.lock")
    held = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                             "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)",
                             str(tmp_path / "gpu-check.lock")], stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout.readline().strip() == "held"
        assert gpu_check.main(["tests-s05-s07", str(tmp_path / "out")]) == 2
        assert "another GPU check is running on this machine" in capsys.readouterr().err
    finally:
        held.kill()
        held.wait()
    lock = gpu_check.one_check_at_a_time()
    assert lock is not None
    lock.close()


def test_the_files_tree_names_the_commit_the_files_are_and_changes_with_them(tmp_path):
    """machine.log's tree: a copy's files, tracked or not, give the tree of the commit they are, whatever its
    .git's HEAD says; one changed byte gives another."""
    def git(*arguments):
        return subprocess.run(["git", "-C", str(tmp_path), *arguments], capture_output=True, text=True,
                              check=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    first = git("rev-parse", "HEAD^{tree}")
    assert gpu_check.files_tree(tmp_path) == first
    (tmp_path / "b.py").write_text("y = 2\n")  # a file the stale index does not know, as a later commit adds
    git("add", "b.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two")
    second = git("rev-parse", "HEAD^{tree}")
    git("reset", "-q", "HEAD~1")  # the .git of the earlier commit under the later commit's files
    assert gpu_check.files_tree(tmp_path) == second != first
    assert git("status", "--short") == "?? b.py"  # the real index untouched
    (tmp_path / "a.py").write_text("x = 3\n")
    assert gpu_check.files_tree(tmp_path) not in (first, second)
