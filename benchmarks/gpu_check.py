"""The GPU check: every GPU test and every committed GPU result, in parts that each fit one device call.

    python -m benchmarks.gpu_check --list                 the parts, their steps and time limits
    python -m benchmarks.gpu_check PART OUT_DIR [--dry-run]   run one part on a CUDA machine
    python -m benchmarks.gpu_check all OUT_DIR            every part, one after another
    python -m benchmarks.gpu_check --collect OUT_DIR      on the course machine: put what the parts
                                                          wrote where the repository keeps it

(`make gpu PART=... OUT=...` runs a part.) The GPU tests are selected by their marker and folder
(`pytest -m gpu tests`) and split by name: stages 1-4, stages 5-7 without FLA, and the comparisons
with FLA (`-k "fla_ or as_fla or on_fla"`), forward and backward apart; together the parts run every
GPU test once (tests/benchmarks/test_gpu_check.py checks that on the collected tests). The other parts run the
benchmarks whose results the pages show (benchmarks/results/): bench's timings and precision study,
the fair comparison, forward + backward, the varlen prefill, the decode step, the training demo on
CUDA, the profiles. The results of runs kept as records of earlier kernels (the pages say which,
and archive/README.md) are not made again.

Each part fits a device call of 9 minutes on a fresh H200, FLA's Triton autotuning (about 90 s a
shape, once per process) and TileLang's compiles (about 15 s each) included: every step runs under
its own time limit, steps that time something run one after another, the others side by side, and
a part's limits add up to PART_LIMIT_S at most (its steps side by side: the longest). Tests run in
pytest-xdist workers where they are independent, each under pytest-timeout's --timeout. Those limits
assume the GPU to the part: a second check started on the machine while one runs is refused
(one_check_at_a_time).

A part writes under OUT_DIR/PART/: machine.log (the GPU, the driver, the commit, and the files' git
tree, which names the commit where the copy's .git is stale), steps.log (when each step began and how
it ended), <step>.log (its output, TileLang's compile chatter dropped), <step>.failures.txt (a test
step's failing tests, each traceback written as it fails) and <step>/ (the files a benchmark writes).
`--collect OUT_DIR` then copies each step's files and log to where the pages read them and folds
bench's runs in (benchmarks.merge); `course regenerate` puts them on the pages.
"""

import argparse
import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PART_LIMIT_S = 530  # a device call ends at 600 s; the machine's set-up and the copy back take the rest
CHATTER = r"TileLang begins|TileLang completes|^==PROF=="  # lines no log keeps
FILES = "{files}"  # in a step's command: its folder, OUT_DIR/PART/<step>
MERGE = "merge"  # a step's files_to for a bench run: folded in by benchmarks.merge
GPU_TEST_RESULTS = "tests/gpu_results"
RESULTS = "benchmarks/results"

FLA_TESTS = "fla_ or as_fla or on_fla"  # the tests that compare with FLA (its autotuning: minutes a process)
EARLY_STAGES = "s01 or s02 or s03 or s04"
TIMED_TESTS = "tune"  # the tune exercises time kernels against a target: alone on the GPU
DROP_IN_TESTS = "drop_in"  # FLA's grid and layer against the course's FLA drop-in: a step of their own
# held while parts run: one GPU check at a time on a machine (one_check_at_a_time)
LOCK_FILE = Path(os.environ.get("TMPDIR", "/tmp")) / "kdacourse-gpu-check.lock"


@dataclass(frozen=True)
class Step:
    """One command of a part: its log is OUT_DIR/PART/<name>.log, its files OUT_DIR/PART/<name>/."""

    name: str
    command: tuple[str, ...]  # argv; FILES stands for the step's folder
    limit_s: int
    log_to: str | None = None  # where --collect puts its log, relative to the repository
    files_to: str | None = None  # where --collect puts the files of its folder (a folder), or MERGE
    renamed: dict = field(default_factory=dict)  # {name in its folder: name in files_to}

    def argv(self, folder: Path) -> list[str]:
        return [str(folder) if word == FILES else word.replace(FILES, str(folder)) for word in self.command]


@dataclass(frozen=True)
class Part:
    name: str
    what: str
    steps: tuple[Step, ...]
    side_by_side: bool = False  # nothing in it is timed: its steps share the GPU

    def limit_s(self) -> int:
        limits = [step.limit_s for step in self.steps]
        return max(limits) if self.side_by_side else sum(limits)


def python(*arguments: str) -> tuple[str, ...]:
    return (sys.executable, *arguments)


def gpu_tests(selection: str, *options: str) -> tuple[str, ...]:
    """pytest over every GPU test under tests/ that `selection` (a -k expression) names, the exercise
    tests on the solutions, verbose, no cache written."""
    return python("-m", "pytest", "tests", "-m", "gpu", "-k", selection, "--target=solutions", "-v",
                  "-p", "no:cacheprovider", *options)


def gpu_test_steps():
    """{step name: (-k expression, pytest options, limit)} of the GPU tests, each test in one step."""
    return {
        "s01_linear_attention": (f"({EARLY_STAGES}) and s01 and not {TIMED_TESTS}", ("-s", "--timeout", "150"), 170),
        "gpu_tests_s02_s04": (f"({EARLY_STAGES}) and not s01 and not {TIMED_TESTS}",
                              ("-n", "4", "--timeout", "240"), 250),
        "gpu_tests_tune": (TIMED_TESTS, ("-s", "--timeout", "100"), 110),
        "gpu_tests_s05_s07": (f"not ({EARLY_STAGES}) and not ({FLA_TESTS}) and not {TIMED_TESTS} "
                              f"and not {DROP_IN_TESTS}", ("-n", "6", "--timeout", "480"), 520),
        "gpu_tests_fla_forward": (f"({FLA_TESTS}) and not s06 and not ({EARLY_STAGES}) and not {TIMED_TESTS} "
                                  f"and not {DROP_IN_TESTS}", ("-n", "5", "--timeout", "480"), 520),
        "gpu_tests_fla_backward": (f"({FLA_TESTS}) and s06 and not ({EARLY_STAGES}) and not {TIMED_TESTS} "
                                   f"and not {DROP_IN_TESTS}", ("-n", "6", "--timeout", "480"), 520),
        # the drop-in's 26 tests each compile their own shapes and FLA's autotuning for them: about
        # 30 s of a call apiece with eight workers on a fresh H100, so three steps of eight to eleven
        "gpu_tests_drop_in_grid": (f"{DROP_IN_TESTS} and chunk_kda_within", ("-n", "8", "--timeout", "480"), 520),
        "gpu_tests_drop_in_packed": (f"{DROP_IN_TESTS} and (packed_training or packed_and_dense)",
                                     ("-n", "8", "--timeout", "480"), 520),
        "gpu_tests_drop_in_layer": (f"{DROP_IN_TESTS} and not chunk_kda_within and not packed_training "
                                    f"and not packed_and_dense", ("-n", "8", "--timeout", "480"), 520),
    }


def _tests(name):
    selection, options, limit = gpu_test_steps()[name]
    return Step(name, gpu_tests(selection, *options), limit, log_to=f"{GPU_TEST_RESULTS}/{name}.log")


def _bench(name, stages, *options, limit=520):
    return Step(name, python("-m", "benchmarks.bench", "--stages", stages, "--out", FILES, *options), limit,
                log_to=f"{RESULTS}/{name}.log", files_to=MERGE)


def _decode(name, csv_name, *options, limit):
    return Step(name, python("-m", "benchmarks.decode", "--out", FILES, "--H", "32", "--d", "128", "--pool", "256",
                             *options), limit, log_to=f"{RESULTS}/{csv_name.removesuffix('.csv')}.log",
                files_to=RESULTS, renamed={"decode.csv": csv_name})


def _train(name, folder, *options):
    return Step(name, python("-m", "benchmarks.train_kda", "--device", "cuda", "--steps", "300", "--vocab", "32",
                             "--compare-fla", "--out", FILES, *options), 500,
                log_to=f"{RESULTS}/{folder}/train_kda.log", files_to=f"{RESULTS}/{folder}")


def _context_parallel(direction, limit):
    return Step(f"context_parallel_{direction}", python("-m", "benchmarks.context_parallel", "--direction", direction,
                                                        "--out", FILES), limit,
                log_to=f"{RESULTS}/context_parallel_{direction}.log", files_to=RESULTS)


def _ncu(module, *arguments):
    """The Nsight Compute command of a profile module (its NCU_COMMAND, then `arguments`), as an argv."""
    return (*shlex.split(importlib.import_module(module).NCU_COMMAND), *arguments)


# benchmarks.kimi_call's cases in three parts: FLA's autotuning takes about 90 s a case on a fresh machine,
# so three a part at most, the accuracy check (a case of its own) with the first; each part's results in a
# folder of its own under benchmarks/results/kimi_call/, read as one run (kdacourse.results.kimi_call_run)
KIMI_CALL_GROUPS = {  # part's group: (cases, whether it checks the accuracy, what they are)
    "one-sequence": (("T8192_H64", "T8192_H96"), True, "one sequence of 8192 tokens at 64 and 96 heads, and the "
                     "error against float64"),
    "packed": (("packed6_H96", "8x1024_H96", "8x4096_H16"), False, "packed batches as a server makes them"),
    "long": (("T16384_H32", "T65536_H32"), False, "long sequences at 32 heads"),
}


# the profiles-kimi part's cases: the dense prepare and the packed one at the same 8192 tokens and 96 heads
KIMI_PREPARE_PROFILES = {"dense": "T8192_H96", "packed": "8x1024_H96"}


def _kimi_call(group, cases, accuracy, what):
    """A kimi-call part: the course's programs of its cases compiled first on the machine's cores, side by
    side (the benchmark builds them one at a time, four or five a case), then the benchmark."""
    names = ",".join(cases)
    folder = group.replace("-", "_")
    return Part(f"kimi-call-{group}", f"KDA as Kimi Linear calls it (raw gate, norms and beta's sigmoid in the "
                f"kernels) beside FLA's own path and FlashKDA, calls and CUDA graphs: {what}",
                (Step(f"kimi_call_{folder}_precompile", python("scripts/precompile_kimi_call.py", "--cases",
                                                               names + (",accuracy" if accuracy else ""), "--jobs", "8"),
                      150),
                 Step(f"kimi_call_{folder}", python("-m", "benchmarks.kimi_call", "--out", FILES, "--rounds", "3",
                                                    "--cases", names, *(() if accuracy else ("--no-accuracy",)),
                                                    "--deadline", "290"), 370,
                      log_to=f"{RESULTS}/kimi_call/{folder}/kimi_call.log", files_to=f"{RESULTS}/kimi_call/{folder}")))


def _kimi_train(gate):
    """A kimi-train part: the course's programs of every case compiled first on the machine's cores, side
    by side (the benchmark builds them one at a time, about 90 s a case), then the benchmark; its results
    in benchmarks/results/kimi_train/<gate>/, read with the folder's other runs as one
    (kdacourse.results.kimi_train_run: a (case, gate) from the newest run that timed it)."""
    return Part(f"kimi-train-{gate}", f"KDA's forward and backward as Kimi Linear trains (the gate, norms and "
                f"beta's sigmoid in the kernels) beside FLA's, the {gate} gate, and every gradient's error against "
                "float64 (FLA's first call autotunes for about 3 minutes on a fresh machine)",
                (Step(f"kimi_train_{gate}_precompile", python("scripts/precompile_kimi_train.py", "--gates", gate,
                                                              "--jobs", "4"), 120),
                 Step(f"kimi_train_{gate}", python("-m", "benchmarks.kimi_train", "--out", FILES, "--gates", gate,
                                                   "--rounds", "3", "--deadline", "320"), 400,
                      log_to=f"{RESULTS}/kimi_train/{gate}/kimi_train.log", files_to=f"{RESULTS}/kimi_train/{gate}")))


def parts() -> dict[str, Part]:
    listed = [
        Part("tests-s01-s04", "stages 1-4's GPU tests and kernel exercises (stage 1's log is its page's), then "
             "the tune exercises alone (they time kernels)",
             (_tests("s01_linear_attention"), _tests("gpu_tests_s02_s04"), _tests("gpu_tests_tune"))),
        Part("tests-s05-s07", "stages 5-7's GPU tests and kernel exercises, the device checks, FLA's comparisons "
             "apart", (_tests("gpu_tests_s05_s07"),)),
        Part("tests-fla-forward", "the forward's comparisons with FLA (stages 5 and 7), a test a worker",
             (_tests("gpu_tests_fla_forward"),)),
        Part("tests-fla-backward", "stage 6's comparisons with FLA (the backward, the layer), a test a worker",
             (_tests("gpu_tests_fla_backward"),)),
        Part("tests-drop-in-grid", "the FLA drop-in's chunk_kda against FLA's kernels on FLA's test grid",
             (_tests("gpu_tests_drop_in_grid"),)),
        Part("tests-drop-in-packed", "the FLA drop-in on packed sequences, training and inference",
             (_tests("gpu_tests_drop_in_packed"),)),
        Part("tests-drop-in-layer", "the FLA drop-in's fused_recurrent_kda and decode, and FLA's layer through the "
             "backend (its layer tests need scripts/pack_fla_models.sh's pack)", (_tests("gpu_tests_drop_in_layer"),)),
        Part("bench-s01-s02", "bench's timings of stages 1 and 2 beside FLA and plain torch",
             (_bench("bench_s01", "s01", "--no-precision", "--deadline", "300", limit=350),
              _bench("bench_s02", "s02", "--no-precision", "--deadline", "120", limit=170))),
        Part("bench-s03", "bench's timings of stage 3", (_bench("bench_s03", "s03", "--no-precision", "--deadline", "420"),)),
        Part("bench-s04", "bench's timings of stage 4", (_bench("bench_s04", "s04", "--no-precision", "--deadline", "420"),)),
        Part("bench-s05", "bench's timings of stage 5", (_bench("bench_s05", "s05", "--no-precision", "--deadline", "420"),)),
        Part("precision-s01-s03", "bench's precision study of stages 1-3 (fp16 and bf16 against float64 as N grows)",
             (_bench("precision_s01_s03", "s01,s02,s03", "--no-timings", "--precision-lengths", "4096,16384,65536",
                     "--deadline", "440"),)),
        Part("precision-s04", "bench's precision study of stage 4",
             (_bench("precision_s04", "s04", "--no-timings", "--precision-lengths", "4096,16384,65536",
                     "--deadline", "440"),)),
        Part("precision-s05", "bench's precision study of stage 5",
             (_bench("precision_s05", "s05", "--no-timings", "--precision-lengths", "4096,16384", "--deadline", "440"),)),
        Part("fair", "stage 5 measured fairly beside FLA: kernels alone, whole calls, the roofs",
             (Step("fair", python("-m", "benchmarks.fair", "--out", FILES, "--deadline", "420"), 520,
                   log_to=f"{RESULTS}/fair.log", files_to=RESULTS),)),
        Part("backward", "stage 6's forward + backward beside FLA, at as many benchmark shapes as fit",
             (Step("backward", python("-m", "benchmarks.backward", "--out", FILES, "--deadline", "400"), 520,
                   log_to=f"{RESULTS}/backward.log", files_to=RESULTS),)),
        Part("varlen", "stage 7's prefill of packed sequences beside FLA",
             (Step("varlen", python("-m", "benchmarks.varlen", "--out", FILES, "--rounds", "3"), 400,
                   log_to=f"{RESULTS}/varlen.log", files_to=RESULTS),)),
        Part("decode-batches", "stage 7's decode step beside FLA at B = 1, 8, 64 and 256",
             tuple(_decode(f"decode_b{B}", "decode.csv" if B == 64 else f"decode_b{B}.csv", "--B", str(B),
                           "--block-dv", "32,64", limit=125) for B in (1, 8, 64, 256))),
        Part("decode-threads", "the decode kernel at B = 64 by threads a program and block_dv",
             (_decode("decode_b64_t128", "decode_b64_blocks.csv", "--B", "64", "--block-dv", "32,64,128",
                      "--threads", "128", limit=170),
              _decode("decode_b64_t256", "decode_b64_t256.csv", "--B", "64", "--block-dv", "32,64,128",
                      "--threads", "256", limit=170),
              _decode("decode_b64_t64", "decode_b64_t64.csv", "--B", "64", "--block-dv", "16,32,64",
                      "--threads", "64", limit=170))),
        Part("context-parallel-forward", "stage 8's forward pieces at 1M tokens over 2, 4 and 8 ranks, one rank's "
             "part at a time on the one GPU, and one device's forward over all the tokens",
             (_context_parallel("forward", 500),)),
        Part("context-parallel-backward", "stage 8's backward pieces at 1M tokens over 2, 4 and 8 ranks",
             (_context_parallel("backward", 520),)),
        *(_kimi_call(group, *spec) for group, spec in KIMI_CALL_GROUPS.items()),
        *(_kimi_train(gate) for gate in ("softplus", "bounded")),
        Part("fla-backend-train", "a small KDA model from fla.models trained 200 steps on FLA's kernels and through "
             "the course's backend (needs scripts/pack_fla_models.sh's pack)",
             (Step("fla_backend_train", python("-m", "benchmarks.fla_backend_train", "--out", FILES, "--steps", "200"),
                   420, log_to=f"{RESULTS}/fla_backend_train/fla_backend_train.log",
                   files_to=f"{RESULTS}/fla_backend_train"),)),
        Part("train", "the training demo on CUDA beside FLA: the bounded gate, and Kimi Linear's unbounded one "
             "with the NaN trap (nothing timed)",
             (_train("train_cuda", "train_kda_cuda"),
              _train("train_cuda_unbounded", "train_kda_cuda_unbounded_fla", "--lower-bound", "none", "--nan-trap")),
             side_by_side=True),
        Part("profiles", "stage 5's kernels timed alone, Nsight Compute on its prepare kernel and on stage 6's "
             "intra kernel",
             (Step("s05_kernel_parts", python("-c", "from benchmarks.profile_s05 import time_each_kernel; "
                                                    "time_each_kernel()"), 120, log_to=f"{RESULTS}/s05_kernel_parts.txt"),
              Step("s05_prepare_ncu", _ncu("benchmarks.profile_s05"), 170, log_to=f"{RESULTS}/s05_prepare_ncu.txt"),
              Step("s06_intra_ncu", _ncu("benchmarks.profile_s06_intra"), 240,
                   log_to=f"{RESULTS}/s06_intra_ncu_registers.txt"))),
        Part("profiles-kimi", "Nsight Compute on the fused prepare as Kimi Linear calls it, one sequence and a packed "
             "batch of the same tokens and heads (why the packed one is slower)",
             (Step("kimi_prepare_precompile", python("scripts/precompile_kimi_call.py", "--cases",
                                                     ",".join(KIMI_PREPARE_PROFILES.values()), "--jobs", "4"), 150),
              *(Step(f"kimi_prepare_ncu_{name}", _ncu("benchmarks.profile_kimi_prepare", case), 170,
                     log_to=f"{RESULTS}/kimi_prepare_ncu/{name}.txt") for name, case in KIMI_PREPARE_PROFILES.items()))),
    ]
    return {part.name: part for part in listed}


# ------------------------------------------------------------------ checking a part without running it

def modules_named(command) -> list[str]:
    """The project modules a command runs: `-m module` and the modules `-c` code imports from."""
    modules = [command[i + 1] for i, word in enumerate(command[:-1]) if word == "-m"]
    for i, word in enumerate(command[:-1]):
        if word == "-c":
            modules += [node.module for node in ast.walk(ast.parse(command[i + 1]))
                        if isinstance(node, ast.ImportFrom)]
    return [module for module in modules if module.split(".")[0] in ("benchmarks", "stages", "kdacourse")]


def problems(part: Part) -> list[str]:
    """What is wrong with a part without running it: a limit past PART_LIMIT_S, a module, a script or a
    name it imports that does not exist, two steps of one name, a test step outside tests/."""
    found = []
    if part.limit_s() > PART_LIMIT_S:
        found.append(f"{part.name}: its steps' limits come to {part.limit_s()} s, past {PART_LIMIT_S} s")
    names = [step.name for step in part.steps]
    if len(set(names)) != len(names):
        found.append(f"{part.name}: two steps share a name")
    for step in part.steps:
        for module in modules_named(step.command):
            if importlib.util.find_spec(module) is None:
                found.append(f"{part.name}/{step.name}: no module {module}")
        if len(step.command) > 1 and step.command[1].endswith(".py") and not (REPO_ROOT / step.command[1]).is_file():
            found.append(f"{part.name}/{step.name}: no script {step.command[1]}")
        for i, word in enumerate(step.command[:-1]):
            if word == "-c":
                for node in ast.walk(ast.parse(step.command[i + 1])):
                    if isinstance(node, ast.ImportFrom) and importlib.util.find_spec(node.module):
                        tree = ast.parse(Path(importlib.util.find_spec(node.module).origin).read_text())
                        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                        found += [f"{part.name}/{step.name}: {node.module} defines no {alias.name}"
                                  for alias in node.names if alias.name not in defined]
        if "pytest" in step.command and not (REPO_ROOT / "tests").is_dir():
            found.append(f"{part.name}/{step.name}: no tests/ folder")
    return found


# ------------------------------------------------------------------ running a part

def files_tree(root: Path = REPO_ROOT) -> str:
    """The git tree hash of the files under `root` as they are (tracked and untracked, the ignored left
    out), written through a scratch index: `git rev-parse COMMIT^{tree}` of the commit they are, even where
    the copy's own .git is older than its files (a device machine gets the working tree copied over a
    .git of an earlier call). `git log --format="%h %T"` finds that commit on the course machine."""
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        environment = dict(os.environ, GIT_INDEX_FILE=str(Path(scratch) / "index"))
        for command in (["add", "-A", "."], ["write-tree"]):
            done = subprocess.run(["git", "-C", str(root), *command], capture_output=True, text=True, timeout=60,
                                  env=environment, check=True)
    return done.stdout.strip()


def _machine_log(folder: Path):
    lines = []
    for command in (["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                    ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"]):
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
            lines.append(f"$ {' '.join(command)}\n{done.stdout}{done.stderr}")
        except (OSError, subprocess.TimeoutExpired) as error:
            lines.append(f"$ {' '.join(command)}\n{error}\n")
    try:
        lines.append(f"the files' git tree (benchmarks.gpu_check.files_tree): {files_tree()}\n")
    except (OSError, subprocess.SubprocessError) as error:
        lines.append(f"the files' git tree: not taken ({error})\n")
    (folder / "machine.log").write_text("".join(lines))


def run_step(step: Step, folder: Path, say) -> dict:
    """Run one step under its limit, its output to folder/<name>.log without the chatter; a step past
    its limit is killed with its whole process group. Returns {"step", "rc", "seconds", "timed_out"}."""
    files = folder / step.name
    files.mkdir(parents=True, exist_ok=True)
    argv = step.argv(files)
    chatter = re.compile(CHATTER)
    say(f"start {step.name} ({step.limit_s} s): {shown(argv)}")
    started = time.monotonic()
    with open(folder / f"{step.name}.log", "w") as log:
        log.write(f"command: {shown(argv)}\nlimit: {step.limit_s} s\n\n")
        log.flush()
        # a test step's failures, each written as it happens (tests/conftest.py): a step killed at its
        # limit still says why its tests failed, which pytest's summary at the end would have said
        failures = dict(os.environ, KDACOURSE_FAILURES=str(folder / f"{step.name}.failures.txt"))
        process = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   errors="replace", start_new_session=True, env=failures)
        timed_out = threading.Event()

        def stop():
            timed_out.set()
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended as its limit came
                pass

        timer = threading.Timer(step.limit_s, stop)
        timer.start()
        try:
            for line in process.stdout:
                if not chatter.search(line):
                    log.write(line)
                    log.flush()
            rc = process.wait()
        finally:
            timer.cancel()
        seconds = round(time.monotonic() - started, 1)
        log.write(f"\nexit: {rc}{' (killed at its limit)' if timed_out.is_set() else ''}, {seconds} s\n")
    if not any(files.iterdir()):
        files.rmdir()
    say(f"end {step.name}: rc={rc}{' timed out' if timed_out.is_set() else ''} ({seconds} s)")
    return {"step": step.name, "rc": rc, "seconds": seconds, "timed_out": timed_out.is_set()}


def run_part(part: Part, out: Path) -> int:
    """Run `part` into out/<part>/; 0 if every step exited 0."""
    folder = Path(out) / part.name
    folder.mkdir(parents=True, exist_ok=True)
    steps_log = folder / "steps.log"

    def say(message):
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        with open(steps_log, "a") as f:
            f.write(line + "\n")

    _machine_log(folder)
    say(f"part {part.name}: {part.what}")
    if part.side_by_side:
        ended = [None] * len(part.steps)
        threads = [threading.Thread(target=lambda i=i, step=step: ended.__setitem__(i, run_step(step, folder, say)))
                   for i, step in enumerate(part.steps)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        ended = [run_step(step, folder, say) for step in part.steps]
    (folder / "steps.json").write_text(json.dumps(ended, indent=1))
    failed = [result["step"] for result in ended if result["rc"] != 0]
    say(f"done: {'every step passed' if not failed else 'failed: ' + ', '.join(failed)}")
    return 1 if failed else 0


# ------------------------------------------------------------------ putting the results in place

def machine_line(machine_log: Path) -> str:
    """Where a part ran, in one line from its machine.log (_machine_log): the GPU as nvidia-smi names it and
    the commit; "" where the part wrote none. A collected log starts with it, so that a page showing the
    log says on which card it ran."""
    if not machine_log.exists():
        return ""
    outputs, command = {}, None
    for line in machine_log.read_text().splitlines():
        if line.startswith("$ "):
            command = line.split()[1]
        elif command and line.strip() and command not in outputs:
            outputs[command] = line.strip()
    return f"ran on: {outputs.get('nvidia-smi', 'no GPU named')}; commit {outputs.get('git', '?')}\n"


def collect(out: Path, root: Path = REPO_ROOT, merge=None) -> list[str]:
    """Copy what the parts wrote under `out` to where the repository keeps it (each step's log_to, headed
    by the part's machine_line, and files_to), bench's runs folded in by `merge` (benchmarks.merge.merge
    unless given); steps that failed or did not run are left out. Returns what it did, one line each."""
    if merge is None:
        from benchmarks.merge import merge
    done = []
    for part in parts().values():
        results = Path(out) / part.name / "steps.json"
        if not results.exists():
            continue
        passed = {result["step"] for result in json.loads(results.read_text()) if result["rc"] == 0}
        for step in part.steps:
            if step.name not in passed:
                done.append(f"{part.name}/{step.name}: not collected (it failed or did not run)")
                continue
            log, files = Path(out) / part.name / f"{step.name}.log", Path(out) / part.name / step.name
            if step.log_to:
                destination = Path(root) / step.log_to
                destination.parent.mkdir(parents=True, exist_ok=True)
                destination.write_text(machine_line(Path(out) / part.name / "machine.log") + log.read_text())
                done.append(f"{log} -> {step.log_to}")
            if step.files_to == MERGE:
                merge([str(files)])
                done.append(f"{files} -> merged into {RESULTS}")
            elif step.files_to:
                for path in sorted(files.iterdir()) if files.is_dir() else []:
                    name = step.renamed.get(path.name, path.name)
                    destination = Path(root) / step.files_to / name
                    destination.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, destination)
                    done.append(f"{path} -> {step.files_to}/{name}")
    return done


def shown(argv) -> str:
    """A command as a person would type it: this interpreter written as `python`."""
    return shlex.join(["python" if word == sys.executable else word for word in argv])


def list_text() -> str:
    lines = []
    for part in parts().values():
        how = "side by side" if part.side_by_side else "one after another"
        lines.append(f"{part.name} (at most {part.limit_s()} s, {how}): {part.what}")
        for step in part.steps:
            where = " -> " + ", ".join(filter(None, (step.log_to, step.files_to))) if step.log_to or step.files_to else ""
            lines.append(f"    {step.name} ({step.limit_s} s){where}: {shown(step.argv(Path('OUT_DIR') / part.name / step.name))}")
    return "\n".join(lines)


def one_check_at_a_time():
    """The machine's GPU check lock, held until the returned file is closed (or the process ends), or
    None where another process holds it. A part's limits assume the GPU to itself: three of the drop-in
    parts started side by side (24 pytest workers) ran an 80 GB H100 out of memory, every failure an
    allocation's (tests/gpu_results/drop_in_h100/README.md)."""
    import fcntl

    handle = open(LOCK_FILE, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("part", nargs="?", help="a part's name (--list names them), or all")
    parser.add_argument("out", nargs="?", type=Path, help="the folder for the part's logs and files")
    parser.add_argument("--list", action="store_true", help="list the parts and their steps")
    parser.add_argument("--dry-run", action="store_true", help="check the part and print its commands; run nothing")
    parser.add_argument("--collect", type=Path, metavar="OUT_DIR",
                        help="copy what the parts wrote under OUT_DIR to where the repository keeps it")
    args = parser.parse_args(argv)
    table = parts()
    if args.list:
        print(list_text())
        return 0
    if args.collect:
        for line in collect(args.collect):
            print(line)
        return 0
    if args.part is None or args.out is None:
        parser.error("give PART and OUT_DIR (or --list, or --collect OUT_DIR)")
    if args.part != "all" and args.part not in table:
        parser.error(f"unknown part {args.part!r}; the parts: {', '.join(table)}, or all")
    selected = list(table.values()) if args.part == "all" else [table[args.part]]
    found = [problem for part in selected for problem in problems(part)]
    if found:
        print("\n".join(found), file=sys.stderr)
        return 2
    if args.dry_run:
        for part in selected:
            for step in part.steps:
                print(f"{part.name}/{step.name} ({step.limit_s} s): {shown(step.argv(args.out / part.name / step.name))}")
        return 0
    lock = one_check_at_a_time()
    if lock is None:
        print(f"another GPU check is running on this machine (it holds {LOCK_FILE}): parts run one after "
              f"another, each with the GPU to itself", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():  # the GPU tests would all skip, and pass
        print("the GPU check needs a CUDA device; torch sees none", file=sys.stderr)
        return 2
    return max(run_part(part, args.out) for part in selected)


if __name__ == "__main__":
    sys.exit(main())
