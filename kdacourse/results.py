"""The committed results the pages show, read from their files: the one door from the site to them.

The GPU machine writes them and they are committed: benchmarks/results/ (CSV, JSON and logs of
`python -m benchmarks.<name> --out DIR`, and of the archived studies, archive/README.md) and
tests/gpu_results/ (the GPU tests' logs). Every page generator (kdacourse/pages/) reads them here,
and this module imports nothing from benchmarks/: a benchmark writes its files, the site reads the
files, so a benchmark or a study can change or retire without the site (tests/course/test_import_rules.py).
From the library it reads only the kernels' source, to say whether a result's kernel is the
committed one (stages.common.program_digest, which the benchmarks record beside their results).

What a function here returns is the data of a table, not its text: the pages format it.
"""

import csv
import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from kdacourse import REPO_ROOT
from stages.common.program_digest import module_digest

RESULTS = REPO_ROOT / "benchmarks" / "results"

# The roofs of DESIGN.md, for a run that measured none (benchmarks/roofs.py measures them in a run).
SPECIFIED_BANDWIDTH = 4.8e12  # bytes/s: the H200's HBM3e, as the specification gives it
DESIGN_COPY_BANDWIDTH = 4.30e12  # bytes/s: a device-to-device copy on an H200 (DESIGN.md)
DESIGN_GEMM_FLOPS = 672e12  # flop/s: a bf16 torch GEMM on an H200 (DESIGN.md)
ROOF_FIELDS = ("copy_bytes", "copy_ms", "bandwidth_bytes_per_s", "gemm_size", "gemm_ms", "bf16_flops_per_s")


# ------------------------------------------------------------------ files

def read_rows(path: Path) -> list[dict]:
    """The rows of a committed CSV, every value a string ("" where the run wrote none)."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def read_json(path: Path):
    return json.loads(Path(path).read_text())


def committed_run(csv_name: str, meta_name: str | None = None, folder: Path | None = None):
    """(rows, meta) of a committed run in `folder` (benchmarks/results/ unless given); meta is {} for a
    run without a meta file. (None, None) if a file is absent or the CSV has no row."""
    folder = RESULTS if folder is None else Path(folder)
    csv_path = folder / csv_name
    meta_path = folder / meta_name if meta_name else None
    if not csv_path.exists() or (meta_path is not None and not meta_path.exists()):
        return None, None
    rows = read_rows(csv_path)
    if not rows:
        return None, None
    return rows, read_json(meta_path) if meta_path else {}


def shown_command(command: str) -> str:
    """A run's command with its output folder, a path on the machine that ran it, written as DIR."""
    return re.sub(r"(--out[ =])\S+", r"\1DIR", command)


def shape_of(row: dict) -> tuple[int, int, int, int]:
    """(B, N, H, D) of a CSV row."""
    return tuple(int(row[key]) for key in ("B", "N", "H", "D"))


# ------------------------------------------------------------------ which kernel a result measured

def kernel_module(stage: str) -> str:
    """The module whose programs a stage's results were measured on ("s04_kda" -> stages.s04_kda.kernel)."""
    return f"stages.{stage}.kernel"


def current_kernel_digest(stage: str) -> str:
    """The committed kernel's digest, as the benchmarks record it (stages.common.program_digest)."""
    return module_digest(kernel_module(stage))


# ------------------------------------------------------------------ the roofs

def roofs_of(meta: dict) -> dict | None:
    """The roofs a run recorded ({field: value} of ROOF_FIELDS), or None if it has none (older runs),
    an error, or a value that is not a positive number."""
    roofs = meta.get("roofs")
    if not isinstance(roofs, dict) or "error" in roofs:
        return None
    try:
        values = {field: float(roofs[field]) for field in ROOF_FIELDS}
    except (KeyError, TypeError, ValueError):
        return None
    if not all(math.isfinite(value) and value > 0 for value in values.values()):
        return None
    return values


def tb_per_s(bytes_per_s: float) -> str:
    return f"{bytes_per_s / 1e12:.2f} TB/s"


def tflop_per_s(flops_per_s: float) -> str:
    return f"{flops_per_s / 1e12:.0f} TFLOP/s"


# ------------------------------------------------------------------ times over rounds

@dataclass(frozen=True)
class Spread:
    """The median of values over rounds, their min and max, and how many there were."""

    median: float
    low: float
    high: float
    count: int

    @classmethod
    def of(cls, values):
        """The Spread of `values` (None entries left out), or None if none is left."""
        values = [v for v in values if v is not None]
        if not values:
            return None
        return cls(statistics.median(values), min(values), max(values), len(values))

    def text(self, form: str = "{:.3f}") -> str:
        """"median (min to max)", or the median alone for one value."""
        if self.count == 1:
            return form.format(self.median)
        return f"{form.format(self.median)} ({form.format(self.low)} to {form.format(self.high)})"


def times(rows: list[dict]) -> dict:
    """{(B, N, H, D): {(impl, what): {round: ms}}} from a timing CSV's rows (rows without a time left out)."""
    table = {}
    for row in rows:
        if row.get("time_ms"):
            table.setdefault(shape_of(row), {}).setdefault((row["impl"], row["what"]), {})[int(row["round"])] = \
                float(row["time_ms"])
    return table


def summarize(rows: list[dict]) -> dict:
    """{shape: {(impl, what): Spread of the time over rounds}}."""
    return {shape: {key: Spread.of(by_round.values()) for key, by_round in measured.items()}
            for shape, measured in times(rows).items()}


def paired(measured: dict, numerator, denominator, combine):
    """Spread over rounds of combine(numerator's time, denominator's time), taken round by round (both
    measured in the same round, minutes apart at most); None if no round has both.
    measured: {(impl, what): {round: ms}}."""
    top, bottom = measured.get(numerator, {}), measured.get(denominator, {})
    return Spread.of([combine(top[r], bottom[r]) for r in sorted(set(top) & set(bottom))])


def ratio(a: float, b: float) -> float:
    return a / b


def difference(a: float, b: float) -> float:
    return a - b


def share_of_kernels(measured: dict, with_it: str, without_it: str):
    """Spread over rounds of (with_it - without_it) / ours' kernels' time, in percent: what one prepare
    kernel's addition costs the forward's kernels."""
    kernels = measured.get(("ours", "kernels"), {})
    top, bottom = measured.get(("ours", with_it), {}), measured.get(("ours", without_it), {})
    return Spread.of([100 * (top[r] - bottom[r]) / kernels[r] for r in sorted(set(top) & set(bottom) & set(kernels))])


# ------------------------------------------------------------------ benchmarks.fair: stage 5 measured fairly

FAIR_CSV, FAIR_META = "fair.csv", "fair_meta.json"


def fair_comparisons(rows: list[dict]) -> dict:
    """{shape: {name: Spread}} of a fair run: FLA / ours for the kernels alone and for the whole call
    (checks off and on), what the value check costs (the call against the call unchecked, and the
    check timed alone), and what the prepare's flags and any-gate branch cost the kernels."""
    result = {}
    for shape, measured in times(rows).items():
        result[shape] = {
            "kernels FLA / ours": paired(measured, ("fla", "kernels"), ("ours", "kernels"), ratio),
            "call FLA / ours unchecked": paired(measured, ("fla", "call"), ("ours", "call_unchecked"), ratio),
            "call FLA / ours checked": paired(measured, ("fla", "call"), ("ours", "call"), ratio),
            "check alone": Spread.of(measured.get(("ours", "value_check"), {}).values()),
            "call, checks on / off": paired(measured, ("ours", "call"), ("ours", "call_unchecked"), ratio),
            "flags in the prepare (% of the kernels)": share_of_kernels(measured, "prepare_flagged", "prepare"),
            "any-gate branch (% of the kernels)": share_of_kernels(measured, "prepare", "prepare_bounded_gate"),
        }
    return result


def kernel_costs(rows: list[dict]) -> dict:
    """{(shape, kernel): {gemm_flops, elementwise_flops, bytes_read, bytes_written}} from the rows that
    carry them (a fair run counts them from the kernels' programs: stages.common.program_cost)."""
    return {(shape_of(row), row["what"]): {key: int(row[key]) for key in
                                           ("gemm_flops", "elementwise_flops", "bytes_read", "bytes_written")}
            for row in rows if row.get("gemm_flops")}


# ------------------------------------------------------------------ benchmarks.backward: forward + backward

BACKWARD_CSV, BACKWARD_META = "backward.csv", "backward_meta.json"
BACKWARD_KERNELS = ("prepare", "states", "state_gradient", "state_products", "intra")  # in the order they run
BACKWARD_GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta")  # the columns of a backward meta's rel_l2_ours_vs_fla
BACKWARD_RATIOS = {  # name: (numerator, denominator), each (impl, what)
    "fwd+bwd FLA call / ours kernels": (("fla", "fwd_bwd_call"), ("ours", "fwd_bwd_kernels")),
    "fwd+bwd call FLA / ours": (("fla", "fwd_bwd_call"), ("ours", "fwd_bwd_call")),
    "fwd+bwd call FLA / ours, forward tensors kept": (("fla", "fwd_bwd_call"), ("ours", "fwd_bwd_call_kept")),
    "fwd+bwd call, both keeping, FLA / ours": (("fla", "fwd_bwd_call_kept"), ("ours", "fwd_bwd_call_kept")),
    "fwd+bwd call FLA / ours, default checks": (("fla", "fwd_bwd_call"), ("ours", "fwd_bwd_call_default")),
    "ours fwd+bwd call, default checks / checks off": (("ours", "fwd_bwd_call_default"), ("ours", "fwd_bwd_call")),
    "backward FLA call / ours kernels": (("fla", "backward_call"), ("ours", "backward_kernels")),
}


def backward_comparisons(rows: list[dict]) -> dict:
    """{shape: {name of BACKWARD_RATIOS: Spread}}, each ratio taken round by round."""
    return {shape: {name: paired(measured, top, bottom, ratio) for name, (top, bottom) in BACKWARD_RATIOS.items()}
            for shape, measured in times(rows).items()}


# ------------------------------------------------------------------ benchmarks.varlen and decode

def varlen_times(rows: list[dict]) -> dict:
    """{mix: {(impl, what): {round: ms}}} from varlen.csv's rows (rows without a time left out), the
    form paired and Spread read."""
    table = {}
    for row in rows:
        if row.get("time_ms"):
            table.setdefault(row["mix"], {}).setdefault((row["impl"], row["what"]), {})[int(row["round"])] = \
                float(row["time_ms"])
    return table


def varlen_mix_lengths(meta: dict) -> dict:
    """{mix: [sequence lengths]} as a varlen run drew them (its meta file's "mixes")."""
    return {mix: list(values["lengths"]) for mix, values in meta.get("mixes", {}).items()}


# ------------------------------------------------------------------ benchmarks.kimi_call: the call as Kimi Linear makes it

KIMI_CALL = RESULTS / "kimi_call"
KIMI_CALL_CSV, KIMI_CALL_META, KIMI_CALL_ACCURACY = "kimi_call.csv", "kimi_call_meta.json", "kimi_call_accuracy.csv"
KIMI_CALL_PEERS = ("fla", "flashkda", "course")
# benchmarks.kimi_call's CASES in its order (the site imports nothing from benchmarks): a run of several
# parts shows its cases so
KIMI_CALL_CASE_ORDER = ("T8192_H64", "T8192_H96", "packed6_H96", "8x1024_H96", "T16384_H32", "T65536_H32", "8x4096_H16")
KIMI_CALL_RATIOS = {  # name: (numerator, denominator), each (impl, what): the course's speed-up on each peer
    "FLA call / course call": (("fla", "call"), ("course", "call")),
    "FlashKDA call / course call": (("flashkda", "call"), ("course", "call")),
    "FLA graph / course graph": (("fla", "kernels"), ("course", "kernels")),
    "FlashKDA graph / course graph": (("flashkda", "kernels"), ("course", "kernels")),
}


@dataclass(frozen=True)
class KimiCallCase:
    """One case of a kimi_call run: its tokens, sequences and heads, the Spread of each (impl, what)'s
    time over the rounds, each ratio of KIMI_CALL_RATIOS taken round by round (None where a side was
    not measured), and why a measurement has no time ({(impl, what): the run's words})."""

    tokens: int
    sequences: int
    H: int
    times: dict
    ratios: dict
    missing: dict


@dataclass(frozen=True)
class KimiCallRun:
    """A committed run of `python -m benchmarks.kimi_call`: {case name: KimiCallCase} in the run's
    order, its meta (machine, versions, command) and {impl: (o rel L2, final state rel L2)} against
    float64 ({} where the run made no accuracy check)."""

    cases: dict
    meta: dict
    accuracy: dict


def kimi_call_run(folder: Path = KIMI_CALL) -> KimiCallRun | None:
    """The run committed in `folder`, or None where it holds none. A folder with a CSV and a meta is one
    run; benchmarks/results/kimi_call/ holds one folder per GPU-check part (benchmarks.gpu_check's
    KIMI_CALL_GROUPS), read as one run: the parts' cases in their order, meta {"runs": [each part's
    meta]}, the accuracy of the part that checked it."""
    folder = Path(folder)
    if (folder / KIMI_CALL_CSV).exists():
        return _one_kimi_call_run(folder)
    parts = [run for run in map(_one_kimi_call_run, sorted(path for path in folder.glob("*/") if path.is_dir()))
             if run is not None] if folder.is_dir() else []
    if not parts:
        return None
    parts.sort(key=lambda run: min((KIMI_CALL_CASE_ORDER.index(name) for name in run.cases
                                    if name in KIMI_CALL_CASE_ORDER), default=len(KIMI_CALL_CASE_ORDER)))
    return KimiCallRun(cases={name: case for run in parts for name, case in run.cases.items()},
                       meta={"runs": [run.meta for run in parts]},
                       accuracy=next((run.accuracy for run in parts if run.accuracy), {}))


def provenance(meta: dict) -> str:
    """Where a run's numbers come from, for a page, from its meta: its command (the output folder as DIR)
    on its machine, with its date and, where the meta has one, its commit."""
    when = ", ".join(filter(None, (meta.get("date", "no date"), meta.get("commit") and f"commit {meta['commit']}")))
    return f"`{shown_command(meta.get('command', ''))}` on {meta.get('device', 'the GPU')} ({when})"


def kimi_call_provenance(run: KimiCallRun) -> str:
    """provenance() of a kimi_call run, "; " between the parts of a run of several."""
    return "; ".join(map(provenance, run.meta.get("runs", [run.meta])))


def _one_kimi_call_run(folder: Path) -> KimiCallRun | None:
    """One run's CSV, meta and accuracy in `folder`; None where its CSV or meta is absent or has no row.
    The CSV has a row per case, round, impl and measurement: time_ms, or error."""
    rows, meta = committed_run(KIMI_CALL_CSV, KIMI_CALL_META, folder)
    if rows is None:
        return None
    by_case = {}
    for row in rows:
        by_case.setdefault(row["case"], []).append(row)
    cases = {}
    for name, case_rows in by_case.items():
        measured, missing = {}, {}
        for row in case_rows:
            key = (row["impl"], row["what"])
            if row.get("time_ms"):
                measured.setdefault(key, {})[int(row["round"])] = float(row["time_ms"])
            elif row.get("error"):
                missing.setdefault(key, row["error"])
        first = case_rows[0]
        cases[name] = KimiCallCase(
            tokens=int(first["tokens"]), sequences=int(first["sequences"]), H=int(first["H"]),
            times={key: Spread.of(by_round.values()) for key, by_round in measured.items()},
            ratios={ratio_name: paired(measured, top, bottom, ratio)
                    for ratio_name, (top, bottom) in KIMI_CALL_RATIOS.items()},
            missing={key: why for key, why in missing.items() if key not in measured})
    accuracy_path = Path(folder) / KIMI_CALL_ACCURACY
    accuracy = {row["impl"]: (float(row["o_rel_l2"]), float(row["state_rel_l2"]))
                for row in read_rows(accuracy_path)} if accuracy_path.exists() else {}
    return KimiCallRun(cases, meta, accuracy)


# ------------------------------------------------------------------ benchmarks.kimi_train: training as Kimi trains

KIMI_TRAIN = RESULTS / "kimi_train"
KIMI_TRAIN_CSV, KIMI_TRAIN_META = "kimi_train.csv", "kimi_train_meta.json"
KIMI_TRAIN_ACCURACY = "kimi_train_accuracy.csv"
# benchmarks.kimi_train's GATES and CASES in the order the pages show them: the layer's default gate first
KIMI_TRAIN_GATES = ("softplus", "bounded")
KIMI_TRAIN_CASE_ORDER = ("T4096_H32", "T16384_H32", "T65536_H32")
KIMI_TRAIN_ACCURACY_SHAPE = (1024, 4)  # benchmarks.kimi_train's ACCURACY_CASE: (T, H) of the float64 comparison


@dataclass(frozen=True)
class KimiTrainCase:
    """One (case, gate) of a kimi_train run: its tokens and heads, the Spread of each peer's forward +
    backward time over the rounds, FLA's time over the course's taken round by round (None where a
    side has no time), and why a peer has no time ({impl: the run's words})."""

    tokens: int
    H: int
    times: dict
    speedup: "Spread | None"
    missing: dict


@dataclass(frozen=True)
class KimiTrainRun:
    """Committed runs of `python -m benchmarks.kimi_train`, read as one: {(case, gate): KimiTrainCase} in
    the pages' order, {gate: {impl: {quantity: relative L2 against float64}}} (impl "fla", "course" and
    "course/fla", the quantities o and the gradients, as the run wrote them), and the metas of the runs
    that gave them, oldest first."""

    cases: dict
    accuracy: dict
    metas: list


def kimi_train_run(folder: Path = KIMI_TRAIN) -> KimiTrainRun | None:
    """The runs in `folder` (a run's files, or one folder per run: the GPU check's kimi-train parts
    write softplus/ and bounded/), or None where it holds none. A (case, gate) timed by several runs
    takes the newest run's times, a gate's accuracy the newest run's that measured it: newest by the
    meta's start (bench.run_meta's "started"; its date for a run that has none), then by the folder's
    name. The metas are those of the runs whose numbers the result holds."""
    folder = Path(folder)
    if (folder / KIMI_TRAIN_META).exists():
        folders = [folder]
    elif folder.is_dir():
        folders = [path for path in folder.glob("*/") if (path / KIMI_TRAIN_META).exists()]
    else:
        folders = []
    runs = sorted(((read_json(path / KIMI_TRAIN_META), path) for path in folders),
                  key=lambda run: (run[0].get("started", run[0].get("date", "")), run[1].name))
    cases, accuracy, source = {}, {}, {}  # source: {(case, gate) or gate: the index of the run that gave it}
    for index, (_, path) in enumerate(runs):
        rows = read_rows(path / KIMI_TRAIN_CSV) if (path / KIMI_TRAIN_CSV).exists() else []
        for key, case in _kimi_train_cases(rows).items():
            cases[key], source[key] = case, index
        if (path / KIMI_TRAIN_ACCURACY).exists():
            by_gate = {}
            for row in read_rows(path / KIMI_TRAIN_ACCURACY):
                by_gate.setdefault(row["gate"], {})[row["impl"]] = {
                    key: float(value) for key, value in row.items() if key not in ("gate", "impl")}
            for gate, by_impl in by_gate.items():
                accuracy[gate], source[gate] = by_impl, index
    if not source:
        return None

    def place(name, order):  # a name the site does not know yet goes last
        return order.index(name) if name in order else len(order)

    case_order = sorted(cases, key=lambda key: (place(key[1], KIMI_TRAIN_GATES), place(key[0], KIMI_TRAIN_CASE_ORDER)))
    gate_order = sorted(accuracy, key=lambda gate: place(gate, KIMI_TRAIN_GATES))
    return KimiTrainRun(cases={key: cases[key] for key in case_order},
                        accuracy={gate: accuracy[gate] for gate in gate_order},
                        metas=[runs[index][0] for index in sorted(set(source.values()))])


def _kimi_train_cases(rows: list[dict]) -> dict:
    """{(case, gate): KimiTrainCase} of one run's rows (one per case, gate, round and peer: time_ms, or
    error)."""
    grouped = {}
    for row in rows:
        grouped.setdefault((row["case"], row["gate"]), []).append(row)
    cases = {}
    for key, case_rows in grouped.items():
        measured, missing = {}, {}
        for row in case_rows:
            if row.get("time_ms"):
                measured.setdefault(row["impl"], {})[int(row["round"])] = float(row["time_ms"])
            elif row.get("error"):
                missing.setdefault(row["impl"], row["error"])
        cases[key] = KimiTrainCase(
            tokens=int(case_rows[0]["tokens"]), H=int(case_rows[0]["H"]),
            times={impl: Spread.of(by_round.values()) for impl, by_round in measured.items()},
            speedup=paired(measured, "fla", "course", ratio),
            missing={impl: why for impl, why in missing.items() if impl not in measured})
    return cases


def kimi_train_provenance(run: KimiTrainRun) -> str:
    """provenance() of each run that gave a kimi_train table its numbers, "; " between them."""
    return "; ".join(map(provenance, run.metas))


# ------------------------------------------------------------------ benchmarks.context_parallel

def context_parallel_times(rows: list[dict]) -> dict:
    """{ranks: {piece: {round: ms}}} from the rows of context_parallel_<direction>.csv (rows without a time
    left out), the form Spread reads."""
    table = {}
    for row in rows:
        if row.get("time_ms"):
            table.setdefault(int(row["ranks"]), {}).setdefault(row["what"], {})[int(row["round"])] = float(row["time_ms"])
    return table


# ------------------------------------------------------------------ benchmarks.train_kda

def training_run(folder: Path) -> tuple[list[dict], int]:
    """(rows of a committed training run's train_kda.csv, the step an int and the rest floats; the
    vocabulary size its log's command gave)."""
    folder = Path(folder)
    with (folder / "train_kda.csv").open(newline="") as file:
        rows = [{key: int(value) if key == "step" else float(value) for key, value in row.items()}
                for row in csv.DictReader(file)]
    vocab = re.search(r"--vocab (\d+)", (folder / "train_kda.log").read_text())
    if vocab is None:
        raise ValueError(f"{folder / 'train_kda.log'} names no --vocab")
    return rows, int(vocab.group(1))


def training_summary(rows: list[dict], window: int = 10) -> dict:
    """Mean loss and accuracy over the first and last `window` steps of each model (the loss_<name>
    columns); with FLA's curve beside ours, how far apart the losses are (max, mean, last window's)."""
    window = min(window, len(rows))
    first, last = rows[:window], rows[-window:]
    names = [key.removeprefix("loss_") for key in rows[0] if key.startswith("loss_")]
    result = {}
    for name in names:
        result[f"first_loss_{name}"] = sum(r[f"loss_{name}"] for r in first) / window
        result[f"last_loss_{name}"] = sum(r[f"loss_{name}"] for r in last) / window
        result[f"last_accuracy_{name}"] = sum(r[f"accuracy_{name}"] for r in last) / window
    if "fla" in names:
        gaps = [abs(r["loss_ours"] - r["loss_fla"]) for r in rows]
        result["max_loss_gap"], result["mean_loss_gap"] = max(gaps), sum(gaps) / len(gaps)
        result["last_loss_gap"] = result["last_loss_ours"] - result["last_loss_fla"]
    return result


# ------------------------------------------------------------------ Nsight Compute and the GPU tests' logs

def read_ncu(path: Path) -> dict:
    """{(metric name, unit): value} from `ncu --print-details all` text, the first value of each metric.

    A metric line is "name  unit  value" or "name  value" (no unit), columns two or more spaces apart.
    """
    metrics = {}
    for line in Path(path).read_text().splitlines():
        columns = re.split(r"\s{2,}", line.strip())
        if len(columns) not in (2, 3) or not re.fullmatch(r"[\d,]+(\.\d+)?", columns[-1]):
            continue
        name, unit = columns[0], columns[1] if len(columns) == 3 else ""
        metrics.setdefault((name, unit), float(columns[-1].replace(",", "")))
    return metrics


def gpu_test_errors(log_path: str) -> list[tuple[str, str, str]]:
    """[(what, max abs, rel L2)] of a committed GPU test log (a path relative to the repository), one
    per line '<what>: max abs <x>, rel L2 <y>' (how the gpu tests print an ErrorReport)."""
    pattern = re.compile(r"^(?P<what>[^:\[\]]+): max abs (?P<max_abs>\S+), rel L2 (?P<rel_l2>\S+)$")
    rows = [(m["what"], m["max_abs"], m["rel_l2"])
            for line in (REPO_ROOT / log_path).read_text().splitlines() if (m := pattern.match(line.strip()))]
    if not rows:
        raise ValueError(f"{log_path} has no line '<what>: max abs <x>, rel L2 <y>'")
    return rows


# ------------------------------------------------------------------ the archived studies' results

# The one-off studies ran as `python -m benchmarks.studies.<name>` at this commit; they are kept, as
# they ran, in STUDIES_ARCHIVE, where nothing imports, tests or runs them (archive/README.md).
STUDIES_COMMIT = "7e017db"
STUDIES_ARCHIVE = "archive/studies"


def study_command(name: str, arguments: str = "") -> str:
    """How an archived study was run, for a page to cite beside its results."""
    return (f"`python -m benchmarks.studies.{name}{' ' + arguments if arguments else ''}` "
            f"({STUDIES_ARCHIVE}/{name}.py, run at commit {STUDIES_COMMIT})")


S05_VARIANT_OUTPUTS = ("w", "u", "q_decayed", "k_to_chunk_end", "a_qk", "chunk_decay")


def prepare_variants(rows: list[dict]) -> dict:
    """{(B, N, H, D): {variant: (median prepare ms, median kernels ms, median FLA ms, max rel L2 of the
    six outputs against the kernel the run started from, error)}} of a run of the prepare kernel's
    variants (archive/studies/s05_variants.py: s05_variants*.csv), variants in the run's order."""
    table = {}
    for row in rows:
        table.setdefault(shape_of(row), {}).setdefault(row["variant"], []).append(row)

    def median_of(named, field):
        values = [float(r[field]) for r in named if r.get(field) not in (None, "")]
        return statistics.median(values) if values else None

    summary = {}
    for shape, variants in table.items():
        summary[shape] = {}
        for name, named in variants.items():
            errors = [float(named[0][f"rel_l2_{output}"]) for output in S05_VARIANT_OUTPUTS
                      if named[0].get(f"rel_l2_{output}") not in (None, "")]
            summary[shape][name] = (median_of(named, "prepare_ms"), median_of(named, "kernels_ms"),
                                    median_of(named, "fla_ms"), max(errors) if errors else None,
                                    named[0].get("error", ""))
    return summary


def recurrence_variants(rows: list[dict]) -> dict:
    """{variant: {(B, N, H, D): median recurrence ms}} of a run of the recurrence's variants
    (archive/studies/s05_recurrence_variants.py: s05_recurrence_variants.csv), in the run's order."""
    by_variant = {}
    for row in rows:
        by_variant.setdefault(row["variant"], {}).setdefault(shape_of(row), []).append(float(row["recurrence_ms"]))
    return {name: {shape: statistics.median(ms) for shape, ms in per_shape.items()}
            for name, per_shape in by_variant.items()}


PROGRAMS_PER_SM = RESULTS / "kda_recurrence_programs_per_sm_h100_registers"  # the latest run


def programs_per_sm_run(folder: Path = PROGRAMS_PER_SM) -> tuple[dict, dict, dict]:
    """({case: {variant: (median ms, min, max)}}, {(case, variant): (calls that differ from the first, calls,
    o's rel L2 against float64)}, the run's meta) of archive/studies/kda_recurrence_programs_per_sm.py's
    run: its CSV, the repeat lines of its log (empty where it ran without --repeats) and the log's first
    line (the machine, versions and command, as JSON); cases and variants in the run's order."""
    times = {}
    for row in read_rows(folder / "programs_per_sm.csv"):
        times.setdefault(row["case"], {}).setdefault(row["variant"], []).append(float(row["time_ms"]))
    summary = {case: {variant: (statistics.median(ms), min(ms), max(ms)) for variant, ms in variants.items()}
               for case, variants in times.items()}
    repeats, errors = {}, {}
    for line in (folder / "programs_per_sm.log").read_text().splitlines():
        if found := re.match(r"(\S+) (\S+): against float64: o ([0-9.e+-]+)", line):
            errors[found[1], found[2]] = float(found[3])
        elif found := re.match(r"(\S+) (\S+): (\d+) of (\d+) calls differ", line):
            repeats[found[1], found[2]] = (int(found[3]), int(found[4]))
    meta = json.loads((folder / "programs_per_sm.log").read_text().splitlines()[0])
    return summary, {key: (*counts, errors.get(key)) for key, counts in repeats.items()}, meta


def gradient_accuracy(rows) -> dict:
    """{(shape, mode, layout, tensor): (geometric mean of ours / FLA's error over the seeds, the worst
    seed's, how many seeds)} of a gradient accuracy run (archive/studies/s06_gradient_accuracy.py:
    gradient_accuracy.csv, one row per shape, mode, layout, seed and tensor), in the rows' order."""
    groups = {}
    for row in rows:
        groups.setdefault((row["shape"], row["mode"], row["layout"], row["tensor"]), []).append(float(row["ratio"]))
    return {key: (math.exp(sum(math.log(r) for r in ratios) / len(ratios)), max(ratios), len(ratios))
            for key, ratios in groups.items()}


def round_times(text: str) -> dict:
    """{label: [ms per round]} from a log's `round N: <label> <ms> ms, <label> <ms> ms, ...` lines (the
    archived studies s06_intra_sections and s07_decode_variants print them), labels in their order."""
    times = {}
    for line in re.findall(r"^round \d+: (.*)$", text, re.M):
        for label, ms in re.findall(r"(.+?) (\d+\.\d+) ms(?:, |$)", line):
            times.setdefault(label, []).append(float(ms))
    return times
