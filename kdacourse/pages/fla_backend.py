"""The page on the course's kernels in a model (docs/fla_backend.md): FLA's test grid against the course,
the training run through the backend, and the speed of the call as Kimi Linear makes it.

Reads, from benchmarks/results/:
- fla_test_grid/fla_test_grid.json: `python scripts/fla_test_grid.py --test-file FILE --out DIR` (FLA's
  own tests/ops/test_kda.py against the course's chunk_kda, case by case);
- fla_backend_train/fla_backend_train.csv and _meta.json: `python -m benchmarks.fla_backend_train --out DIR`;
- kimi_call/: `python -m benchmarks.kimi_call --out DIR`, the call as Kimi Linear makes it, FLA's
  (FLA_FLASH_KDA=0), FlashKDA's and the course's, in one process (read by kdacourse.results.kimi_call_run);
and writes docs/generated/fla_backend_{grid,training,speed}.md. Without a run's file its section says
which command writes it.
"""

from collections import Counter

from kdacourse import results
from kdacourse.pages.tables import markdown_table

RESULTS = results.RESULTS
GRID = RESULTS / "fla_test_grid" / "fla_test_grid.json"
TRAINING = RESULTS / "fla_backend_train"
# the committed runs, oldest first: kimi_call_four_passes/ timed the prepare in four channel passes beside
# the two that were then the default at C = 32 (four since: config.default_channel_passes)
SPEED_RUNS = (RESULTS / "kimi_call", RESULTS / "kimi_call_four_passes")
FOUR_PASS_PEER = ("course_4_passes", "the course, four passes")
IMPLEMENTATIONS = (("fla", "FLA's call"), ("flashkda", "FlashKDA"), ("course", "the course's call"))


def write_grid(path):
    """The count of FLA's cases by outcome, and every case that did not pass with its reason."""
    if not GRID.exists():
        path.write_text("FLA's test grid has not been run against the course yet: `python scripts/fla_test_grid.py "
                        "--test-file FILE --out DIR`, its JSON copied to benchmarks/results/fla_test_grid/.\n")
        return
    run = results.read_json(GRID)
    counts = Counter(case["outcome"] for case in run["cases"])
    rows = [[case["case"].replace("|", "/"), case["outcome"], case["reason"].replace("|", "/")]
            for case in run["cases"] if case["outcome"] != "passed"]
    kernels = "the course's" if run["summary"].startswith("against course") else "FLA's own"
    text = (f"Against {kernels} kernels: {counts['passed']} passed, {counts['failed']} failed, {counts['refused']} "
            f"refused, {counts['skipped']} skipped of {len(run['cases'])} cases.\n\n")
    if rows:
        text += markdown_table(["FLA's case", "outcome", "why"], rows)
    path.write_text(text)


def write_training(path):
    """The loss of both runs every 20 steps, and the mean of their last 10 steps."""
    rows, meta = results.committed_run("fla_backend_train.csv", "fla_backend_train_meta.json", TRAINING)
    if rows is None:
        path.write_text("The training run has not been committed yet: `python -m benchmarks.fla_backend_train --out "
                        "DIR` on the GPU machine, copied to benchmarks/results/fla_backend_train/.\n")
        return
    shown = [row for row in rows if int(row["step"]) % 20 == 0 or row is rows[-1]]
    table = markdown_table(["step", "loss, FLA's kernels", "loss, the course's backend"],
                           [[row["step"], row["loss_fla"], row["loss_course"]] for row in shown])
    last = {name: sum(float(row[f"loss_{name}"]) for row in rows[-10:]) / len(rows[-10:]) for name in ("fla", "course")}
    path.write_text(f"`{results.shown_command(meta.get('command', ''))}` on {meta.get('device', 'the GPU')}; the mean "
                    f"loss of the last 10 steps: FLA's kernels {last['fla']:.4f}, the course's {last['course']:.4f}.\n\n"
                    + table)


def write_speed(path):
    """Per committed run (SPEED_RUNS), each case's call per implementation (medians over the rounds) and
    the course's speed-up on the other two, taken round by round; the course in four channel passes too
    where the run timed it."""
    runs = [(folder, results.kimi_call_run(folder)) for folder in SPEED_RUNS]
    if all(run is None for _, run in runs):
        path.write_text("Not measured yet: `python -m benchmarks.kimi_call --out DIR` on the GPU machine writes "
                        f"{results.KIMI_CALL_CSV} and {results.KIMI_CALL_META}; committed in "
                        "benchmarks/results/kimi_call/, `course regenerate` puts its table here.\n")
        return
    sections = []
    for folder, run in runs:
        if run is None:
            continue
        four_passes = any((FOUR_PASS_PEER[0], "call") in case.times for case in run.cases.values())
        shown = IMPLEMENTATIONS + ((FOUR_PASS_PEER,) if four_passes else ())
        table_rows = []
        for case in run.cases.values():
            shape = f"{case.tokens} in {case.sequences}, {case.H}" if case.sequences > 1 else f"{case.tokens}, {case.H}"
            if not case.times:
                continue
            cells = [f"{case.times[impl, 'call'].median:.2f} ms" if (impl, "call") in case.times else "–"
                     for impl, _ in shown]
            ratios = [case.ratios[name].text("{:.2f}") + "x" if case.ratios[name] else "–"
                      for name in ("FLA call / course call", "FlashKDA call / course call")]
            table_rows.append([shape, *cells, *ratios])
        header = ["T, H", *(label for _, label in shown), "course's speed-up on FLA", "on FlashKDA"]
        sections.append(f"{results.kimi_call_provenance(run)} (benchmarks/results/{folder.name}/):\n\n"
                        + markdown_table(header, table_rows))
    path.write_text("\n".join(sections))


def generated_files():
    return {"docs/generated/fla_backend_grid.md": write_grid,
            "docs/generated/fla_backend_training.md": write_training,
            "docs/generated/fla_backend_speed.md": write_speed}
