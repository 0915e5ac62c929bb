"""FLA's own KDA tests, unchanged, run against the course's chunk_kda and fused_recurrent_kda: the count
of cases that pass, fail, are refused (the course raises for an option or a value it does not take,
and says why) or are skipped (FLA's own markers), case by case.

    python scripts/fla_test_grid.py --test-file FILE [--against course|fla] [--out DIR] [-k EXPR]

FILE is FLA's tests/ops/test_kda.py as it is (the version nearest fla-core 0.6.0 is in FLA's git history
at bc3b101d: `git -C <mirror of fla-org/flash-linear-attention> show bc3b101d:tests/ops/test_kda.py`).
It runs in a temporary folder beside a conftest that, with --against course (the default), swaps FLA's
`chunk_kda`, `fused_recurrent_kda` and `fused_recurrent_kda_fwd` for the course's before the file imports
them; FLA's references (naive_recurrent_kda, naive_chunk_kda, the naive gates) stay FLA's, and so do
its parametrizations and tolerances. --against fla runs FLA's own kernels (a GPU is needed), the
count the course's is held to. Only the tests that call those three functions run (-k below); the
others test FLA's references against each other or FLA's gate kernel alone.

Needs fla-core 0.6.0 and triton importable beside the course (triton installs on a machine without a
GPU: FLA then takes the CPU, where the conftest puts FLA's tensors, its `device`, on the CPU too). Not
part of CI: FLA's sizes take minutes on a CPU. Writes DIR/fla_test_grid.json and .txt.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COURSE_FUNCTIONS = "test_chunk or test_fused_recurrent or test_flash_kda or test_triton_ascend"

CONFTEST = '''
import json
import os

import pytest
import torch

if os.environ["KDA_GRID_AGAINST"] == "course":
    import fla.ops.kda
    import fla.ops.kda.fused_recurrent
    import fla.utils

    from stages.kda import autograd, fused_recurrent

    if not torch.cuda.is_available():
        fla.utils.device = "cpu"  # without a GPU FLA names "cuda" for autocast's sake; its tests put tensors there
    fla.ops.kda.chunk_kda = autograd.chunk_kda
    fla.ops.kda.fused_recurrent_kda = fused_recurrent.fused_recurrent_kda
    fla.ops.kda.fused_recurrent.fused_recurrent_kda_fwd = fused_recurrent.fused_recurrent_kda_fwd

RESULTS = []
REFUSALS = (NotImplementedError, ValueError, TypeError)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    if report.when != "call" and report.passed:
        return
    outcome, reason = report.outcome, ""
    if report.skipped:
        reason = str(report.longrepr[-1]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
    elif report.failed and call.excinfo is not None:
        error = call.excinfo
        raised_by_course = any("/stages/" in str(entry.path) for entry in error.traceback[-3:])
        if error.errisinstance(REFUSALS) and raised_by_course:
            outcome = "refused"
        reason = f"{error.typename}: " + (str(error.value).strip().splitlines() or [""])[0][:300]
    RESULTS.append({"case": item.nodeid.split("::", 1)[1], "outcome": outcome, "reason": reason})


def pytest_sessionfinish(session):
    with open(os.environ["KDA_GRID_REPORT"], "w") as file:
        json.dump(RESULTS, file, indent=1)
'''


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--test-file", type=Path, required=True, help="FLA's tests/ops/test_kda.py, unchanged")
    parser.add_argument("--against", choices=("course", "fla"), default="course")
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("-k", default=COURSE_FUNCTIONS, help="pytest's -k over FLA's cases")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        (folder / "test_kda.py").write_bytes(args.test_file.read_bytes())
        (folder / "conftest.py").write_text(CONFTEST)
        report = folder / "report.json"
        env = dict(os.environ, KDA_GRID_AGAINST=args.against, KDA_GRID_REPORT=str(report),
                   PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        command = [sys.executable, "-m", "pytest", "test_kda.py", "-q", "-p", "no:cacheprovider", "-k", args.k,
                   "--tb=no", "-rN"]
        subprocess.run(command, cwd=folder, env=env, check=False)
        results = json.loads(report.read_text())
    counts = Counter(result["outcome"] for result in results)
    lines = [f"{result['outcome']:8} {result['case']}" + (f"  -- {result['reason']}" if result["reason"] else "")
             for result in results]
    summary = (f"against {args.against}: {counts['passed']} passed, {counts['failed']} failed, {counts['refused']} "
               f"refused, {counts['skipped']} skipped of {len(results)}")
    (args.out / "fla_test_grid.json").write_text(json.dumps({"summary": summary, "cases": results}, indent=1))
    (args.out / "fla_test_grid.txt").write_text("\n".join(lines + [summary]) + "\n")
    print("\n".join(lines + [summary]))


if __name__ == "__main__":
    main()
