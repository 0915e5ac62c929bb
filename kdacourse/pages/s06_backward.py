"""Stage 6's generated files: the gradients of references B and C against reference A, the identities
and the refuted mistakes, and what storing or recomputing the chunk states costs."""

import inspect

import numpy as np

from kdacourse.pages.stage_tables import identities_table
from kdacourse.pages.tables import (ROUNDING_NOTE, banner, markdown_table, not_yet_run, rounding_level, save_svg,
                                    spread_cell)
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.s05_fast_kda.numerics import FAST_SPAN_LOG
from stages.s06_backward.reference import chunkwise_backward, kernel_mirror_backward, recurrent_backward

SOURCE = "kdacourse/pages/s06_backward.py"
GRADIENTS = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state")

# B, N, H, d_k, d_v, chunk_size, block_dv, sub_block: one chunk, many chunks with a short last one,
# the kernels' chunk and sub-block
ERROR_TABLE_SHAPES = [
    (2, 16, 2, 4, 4, 16, 2, 4),
    (2, 50, 2, 8, 8, 16, 4, 8),
    (1, 128, 2, 32, 32, 64, 16, 16),
]


def _backward_inputs(B, N, H, d_k, d_v, seed=0):
    """The course's inputs (a in [0.9, 0.999], beta in [0.1, 0.9], unit q and k) with a random do,
    initial state S_0^T and dLoss/dS_N^T."""
    x = make_inputs(B, N, H, d_k, d_v, gate="channel", gate_range=(0.9, 0.999), beta_range=(0.1, 0.9), seed=seed)
    rng = np.random.default_rng(seed + 1)
    return (x.q, x.k, x.v, x.g, x.beta, rng.standard_normal((B, N, H, d_v))), \
        rng.standard_normal((B, H, d_k, d_v)), rng.standard_normal((B, H, d_k, d_v))


def write_error_table(path):
    rows = []
    for B, N, H, d_k, d_v, C, block_dv, sub in ERROR_TABLE_SHAPES:
        arguments, S_0, dS_N = _backward_inputs(B, N, H, d_k, d_v)
        expected = recurrent_backward(*arguments, S_0, dS_N)
        shape = f"B={B}, N={N}, H={H}, d_k={d_k}, d_v={d_v}, C={C}, block_dv={block_dv}, sub-block={sub}"
        for name, actual in (("B chunkwise", chunkwise_backward(*arguments, C, S_0, dS_N)),
                             ("C kernel mirror", kernel_mirror_backward(*arguments, C, S_0, dS_N, block_dv, sub))):
            errors = [error_report(getattr(actual, g), getattr(expected, g)) for g in GRADIENTS]
            rows.append([shape, f"{name} vs A"] + [f"{rounding_level(e.max_abs)} / {rounding_level(e.rel_l2)}" for e in errors])
    path.write_text(
        banner(SOURCE) + "Each cell: max abs error / relative L2 against reference A, float64; gates a in [0.9, 0.999], "
        "beta in [0.1, 0.9], random do, S_0 and dLoss/dS_N.\n\n"
        + markdown_table(["shape", "comparison", "dq", "dk", "dv", "dg", "dbeta", "dS_0"], rows) + "\n" + ROUNDING_NOTE)


def write_identities_table(path):
    from stages.common.symbolic import counterexample
    from stages.s06_backward.identities import IDENTITIES, REFUTED

    refuted = []
    for build in REFUTED:
        identity = build()
        if inspect.signature(build).parameters:  # the builder's docstring ends with where it hides
            where, there = build.__doc__.split(". ")[-1].rstrip("."), "proved" if build(True).holds() else "**FAILS**"
        else:
            where, there = "nowhere", "-"
        refuted.append((f"`{build.__name__}`", identity.name, identity.statement,
                        "refuted at one rational point" if counterexample(identity) else "**not refuted**", where, there))
    path.write_text(identities_table(IDENTITIES, SOURCE) + "\n" + markdown_table(
        ["function", "not an identity", "statement", "SymPy", "where it hides", "SymPy there"], refuted))


# --8<-- [start:storage]
def held_from_forward_to_backward(B, N, H, D=128, C=64, element=2):
    """Bytes one layer keeps from its forward to its backward beside its inputs, per choice (d_k = d_v = D,
    tensors of `element` bytes): every chunk's state, or FLA 0.6.0's default (A^qk and A^kk, one row of
    C scores per token and head each; chunk_kda_fwd frees w, u and the states), or nothing (ours)."""
    token_heads = B * N * H
    return {
        "store every chunk's state": (token_heads // C) * D * D * element,  # one d_k x d_v S^T per chunk and head
        "store A^qk and A^kk (FLA's default)": token_heads * 2 * C * element,
        "recompute everything (ours)": 0,
    }
# --8<-- [end:storage]


BACKWARD_RUN = "benchmarks/results/backward.csv"  # committed by `python -m benchmarks.backward --out DIR`


def write_storage_table(path):
    """Per shape of the committed backward run: what each choice holds, and the measured times of what
    our backward recomputes (the prepare kernel again, the states kernel) beside the whole backward."""
    from kdacourse import REPO_ROOT, results

    summary = results.summarize(results.read_rows(REPO_ROOT / BACKWARD_RUN))
    rows = []
    for (B, N, H, D), measured in sorted(summary.items()):
        held = held_from_forward_to_backward(B, N, H, D)
        backward = measured[("ours", "backward_kernels")].median
        prepare, states = (measured[("ours", kernel)].median for kernel in ("prepare", "states"))
        rows.append([f"B={B}, N={N}, H={H}", *(f"{held[key] / 2**20:.0f}" for key in list(held)[:2]),
                     f"{backward:.2f}", f"{prepare:.3f} ({prepare / backward:.0%})",
                     f"{states:.3f} ({states / backward:.0%})"])
    path.write_text(
        banner(f"{SOURCE}, from {BACKWARD_RUN}") + "d_k = d_v = 128, C = 64, bf16, one layer. Memory: what the "
        "layer holds from its forward to its backward, beside its inputs. Times: medians over the committed run's "
        "rounds on the H200, each kernel alone.\n\n" + markdown_table(
            ["shape", "states held (MiB)", "A^qk and A^kk held (MiB)", "our backward kernels (ms)",
             "prepare again (ms, share)", "states kernel (ms, share)"], rows))


TRAINING_RUN = "benchmarks/results/train_kda_cpu"  # committed by `python -m benchmarks.train_kda --out ...`
CUDA_TRAINING_RUN = "benchmarks/results/train_kda_cuda"  # `... --device cuda --compare-fla`, on the H200
# `... --device cuda --lower-bound none --compare-fla --nan-trap`, on the H200
UNBOUNDED_TRAINING_RUN = "benchmarks/results/train_kda_cuda_unbounded_fla"
CPU_LABELS = {"ours": "stage 5 forward + stage 6 backward (CPU references)"}
CUDA_LABELS = {"ours": "stage 5 + stage 6 kernels (H200)", "fla": "FLA chunk_kda (H200)"}


def _training_run(run):
    """(rows of a committed run's CSV, the loss of a guess among the values: log(vocab))."""
    import math

    from kdacourse import REPO_ROOT, results

    rows, vocab = results.training_run(REPO_ROOT / run)
    return rows, math.log(vocab)


def write_training_table(path):
    from kdacourse.results import training_summary as summary

    rows, guess = _training_run(TRAINING_RUN)
    result = summary(rows)
    path.write_text(
        banner(f"{SOURCE}, from {TRAINING_RUN}/train_kda.csv") + markdown_table(
            ["steps", "loss, first 10 steps", "loss, last 10 steps", "a guess among the values (log vocab)",
             "query accuracy, last 10 steps"],
            [(len(rows), f"{result['first_loss_ours']:.3f}", f"{result['last_loss_ours']:.3f}", f"{guess:.3f}",
              f"{result['last_accuracy_ours']:.3f}")])
        + f"\n`{TRAINING_RUN}/train_kda.log` holds the command and the machine.\n")


def write_cuda_training_table(path, run=CUDA_TRAINING_RUN):
    """The H200 run of our kernels beside FLA's: first and last losses, accuracy, the gap between them."""
    from kdacourse.results import training_summary as summary

    rows, guess = _training_run(run)
    result = summary(rows)
    gaps = [abs(r["loss_ours"] - r["loss_fla"]) for r in rows]
    widest = rows[gaps.index(max(gaps))]["step"]
    path.write_text(
        banner(f"{SOURCE}, from {run}/train_kda.csv") + markdown_table(
            ["kernels", "loss, first 10 steps", "loss, last 10 steps", "query accuracy, last 10 steps"],
            [(label, f"{result[f'first_loss_{name}']:.3f}", f"{result[f'last_loss_{name}']:.3f}",
              f"{result[f'last_accuracy_{name}']:.3f}") for name, label in CUDA_LABELS.items()])
        + f"\nOver the {len(rows)} steps the two losses differ by {result['mean_loss_gap']:.4f} on average and by "
        f"{result['max_loss_gap']:.3f} at most (step {widest}); a guess among the values scores {guess:.3f}. "
        f"`{run}/train_kda.log` holds the command and the machine.\n")


def _write_loss_plot(path, run, labels):
    """Each labelled run's loss against the step, and a guess's loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, guess = _training_run(run)
    figure, axes = plt.subplots(figsize=(6.4, 3.6))
    for (name, label), style in zip(labels.items(), ("-", "--")):
        axes.plot([r["step"] for r in rows], [r[f"loss_{name}"] for r in rows], linewidth=1.0, linestyle=style,
                  label=label)
    axes.axhline(guess, color="grey", linewidth=0.8, linestyle=":", label="a guess among the values")
    axes.set_xlabel("step")
    axes.set_ylabel("cross-entropy on the queries")
    axes.legend()
    save_svg(figure, path)
    plt.close(figure)


def write_training_plot(path):
    _write_loss_plot(path, TRAINING_RUN, CPU_LABELS)


def write_cuda_training_plot(path):
    _write_loss_plot(path, CUDA_TRAINING_RUN, CUDA_LABELS)


ANY_GATE_CHUNK, ANY_GATE_BLOCK_DV = 32, 16  # the interpreter's small shapes: two sub-blocks a chunk


def _interpreted_backward(arguments, S_0, dS_N, dtype, anchored_only):
    """The six gradients of stage 6's five kernels through the tile interpreter, on inputs of whole
    chunks; anchored_only builds the intra kernel as it was before its any-gate path (the span
    bound infinite: no sub-block flagged, no exponent clamped), stage 5's prepare as it is."""
    import math
    from unittest import mock

    from stages.common.interpreter import interpret
    from stages.s06_backward.kernel import BUILDERS, kernel_arguments, run_kernels

    q, v = arguments[0], arguments[2]
    B, N, H, d_k = q.shape
    builds = kernel_arguments(B, N, H, d_k, v.shape[3], ANY_GATE_CHUNK, ANY_GATE_BLOCK_DV, dtype)
    kernels = {}
    for name, (build, outputs) in BUILDERS.items():
        spans = {dtype_name: math.inf for dtype_name in FAST_SPAN_LOG} if anchored_only and name == "intra" else {}
        with mock.patch.dict(FAST_SPAN_LOG, spans):
            kernels[name] = interpret(build(*builds[name]), out_idx=outputs)
    return run_kernels(kernels, *arguments, S_0, dS_N)


def write_any_gate_table(path):
    """The backward's failing case and its fix, through the tile interpreter on the CPU: stage 5's
    table's inputs (gentle gates, one channel's log gates at `strength` on tokens 1 to 8, so that the
    first sub-block's anchored factor above its middle row is e^{-8 strength}), with a random do, S_0
    and dLoss/dS_N; the largest rel L2 of the six gradients against float64 (reference A) for the
    intra kernel with the anchored GEMMs alone (before) and with its any-gate path (after)."""
    from kdacourse.pages.s05_fast_kda import ANY_GATE_STRENGTHS

    rows = []
    for strength in ANY_GATE_STRENGTHS:
        x = make_inputs(1, 2 * ANY_GATE_CHUNK, 1, 32, 32, gate="channel", gate_range=(0.9, 0.999),
                        beta_range=(0.0, 1.0), seed=5)
        x.g[0, 1:9, 0, 3] = strength
        rng = np.random.default_rng(5)
        do, S_0, dS_N = (rng.standard_normal(shape) for shape in (x.v.shape, (1, 1, 32, 32), (1, 1, 32, 32)))
        arguments = (x.q, x.k, x.v, x.g, x.beta, do)
        expected = recurrent_backward(*arguments, S_0, dS_N)
        row = [f"{strength:g}", f"{-8 * strength:g}"]
        for dtype in ("float16", "bfloat16"):
            takes_gemms = -8 * strength <= FAST_SPAN_LOG[dtype]
            worst = []
            for anchored_only in (True, False):
                gradients = _interpreted_backward(arguments, S_0, dS_N, dtype, anchored_only)
                finite = all(np.all(np.isfinite(a)) for a in gradients)
                worst.append(f"{max(error_report(a, getattr(expected, name)).rel_l2 for name, a in zip(GRADIENTS, gradients)):.2e}"
                             if finite else "NaN")
            row += ["GEMMs" if takes_gemms else "term by term", *worst]
        rows.append(row)
    headers = ["log gate, tokens 1-8", "span (e-folds)"] + [
        f"{name}: {column}" for name in ("fp16", "bf16") for column in ("sub-block 0 takes", "before", "after")]
    path.write_text(banner(SOURCE) + markdown_table(headers, rows))


GRADIENT_ACCURACY_RUNS = {  # the archived study s06_gradient_accuracy's runs on the H200, oldest first
    "dq in bf16": "benchmarks/results/gradient_accuracy_before",  # the intra kernel rounded dq, dk to bf16
    "dq in fp32": "benchmarks/results/gradient_accuracy_fp32_dq",  # dq, dk in fp32 to the norm's backward
    "A_hat split": "benchmarks/results/gradient_accuracy_dv_split",  # dv's GEMM: A_hat's rounding + remainder
    "scores split": "benchmarks/results/gradient_accuracy",  # the diagonal score-gradient GEMMs, both sides
    "A_kk, T from the prepare": "benchmarks/results/gradient_accuracy_solve",  # the intra kernel reads the prepare's
}
GRADIENT_ACCURACY_SHAPE = "2,300,2,128"  # the shape every run measured at every seed
GRADIENT_ACCURACY_GOAL = 1.1  # ours within 1.1 times FLA's error (issue 27, item 5)
GRADIENT_ACCURACY_TENSORS = ("o", "final_state", "q", "k", "v", "g", "beta", "initial_state")  # the runs' order


def write_gradient_accuracy_table(path):
    """Ours / FLA's rel L2 from float64 per tensor, the geometric mean over seeds (the worst seed after
    it): the newest run at every layout and mode, then every run at gentle gates, oldest first."""
    from kdacourse import REPO_ROOT, results

    GOAL, NAMES = GRADIENT_ACCURACY_GOAL, GRADIENT_ACCURACY_TENSORS
    runs = {}
    for label, folder in GRADIENT_ACCURACY_RUNS.items():
        rows = results.read_rows(REPO_ROOT / folder / "gradient_accuracy.csv")
        runs[label] = results.gradient_accuracy(row for row in rows if row["shape"] == GRADIENT_ACCURACY_SHAPE)
    newest = list(runs)[-1]

    def cell(label, mode, layout, name):
        mean, worst, seeds = runs[label][(GRADIENT_ACCURACY_SHAPE, mode, layout, name)]
        return f"{mean:.2f} ({worst:.2f})" + ("" if mean <= GOAL else " **over**")

    groups = [key[1:3] for key in runs[newest] if key[3] == NAMES[0]]
    now = markdown_table(["tensor"] + [f"{mode}, {layout}" for mode, layout in groups],
                         [[name] + [cell(newest, mode, layout, name) for mode, layout in groups] for name in NAMES])
    gentle = [(mode, layout) for mode, layout in groups if layout == "gentle"]
    history = markdown_table(["tensor"] + [f"{mode}: {label}" for mode, layout in gentle for label in runs],
                             [[name] + [cell(label, mode, layout, name) for mode, layout in gentle for label in runs]
                              for name in NAMES])
    seeds = runs[newest][(GRADIENT_ACCURACY_SHAPE, *groups[0], NAMES[0])][2]
    path.write_text(
        banner(f"{SOURCE}, from "
               + ", ".join(f"{folder}/gradient_accuracy.csv" for folder in GRADIENT_ACCURACY_RUNS.values()))
        + f"The kernels now ({newest}):\n\n" + now
        + f"\nAt gentle gates, run by run ({', '.join(runs)}):\n\n" + history
        + f"\nB, N, H, d = {GRADIENT_ACCURACY_SHAPE}, bf16, {seeds} seeds: ours / FLA's rel L2 from float64, the "
        f"geometric mean over the seeds (the worst seed's in brackets); **over** marks a mean past {GOAL}. Each run: "
        f"{results.study_command('s06_gradient_accuracy', '--out DIR --shapes 2,300,2,128')}.\n")


INTRA_SECTIONS_LOG = "benchmarks/results/s06_intra_sections.log"  # the archived study's run on the H200
WHOLE_KERNEL, EVERY_GEMM_WAITED = "the kernel", "every GEMM waited for"  # the log's labels of the two controls


def intra_sections_table(times):
    """The Markdown table of the medians of `times` ({label: [ms per round]}, the sections in the log's
    order): the kernel, the kernel with every GEMM waited for, then each section's time (the kernel
    with the section run twice, less the kernel)."""
    import statistics

    whole = statistics.median(times[WHOLE_KERNEL])
    waited = statistics.median(times[EVERY_GEMM_WAITED])
    rows = [("(the kernel)", f"{whole:.4f}", "", ""),
            (f"(the kernel, {EVERY_GEMM_WAITED})", f"{waited:.4f}", f"{waited - whole:+.4f} (the shared waits' saving)", "")]
    for label, ms in times.items():
        if label not in (WHOLE_KERNEL, EVERY_GEMM_WAITED):
            section = statistics.median(ms) - whole
            rows.append((label, f"{statistics.median(ms):.4f}", f"{section:.4f}", f"{section / whole:.0%}"))
    return markdown_table(["section", "kernel with it twice (ms)", "the section (ms)", "share of the kernel"], rows)


def write_intra_sections_table(path):
    """Where the intra kernel's time goes: the archived study s06_intra_sections' H200 run, from its log
    (the GPU's round times)."""
    from kdacourse import REPO_ROOT, results

    times = results.round_times((REPO_ROOT / INTRA_SECTIONS_LOG).read_text())
    rounds = len(times[WHOLE_KERNEL])
    path.write_text(
        banner(f"{SOURCE}, from {INTRA_SECTIONS_LOG}")
        + f"NVIDIA H200, 2026-12-02, B, N, H, D = 1, 16384, 32, 128, bf16, {rounds} rounds, medians (CUDA graphs): "
        f"the time of the kernel with the section run twice, less the kernel's "
        f"({results.study_command('s06_intra_sections', '--rounds 3')}).\n\n" + intra_sections_table(times))


KIMI_TRAIN_GATE_LABELS = {"softplus": "softplus (the layer's default)", "bounded": "bounded (lower_bound -5)"}
# the quantities of a kimi_train accuracy row, as the page names them: o and the gradients of the inputs
KIMI_TRAIN_QUANTITIES = {"o": "o", "q": "dq", "k": "dk", "v": "dv", "x": "dx (raw gate)", "beta": "dbeta (logits)",
                         "A_log": "dA_log", "dt_bias": "ddt_bias"}


def write_kimi_train_table(path, folder=None):
    """Forward + backward as Kimi Linear trains, FLA's and the course's, from the committed runs of
    `python -m benchmarks.kimi_train` (benchmarks/results/kimi_train/ unless `folder`)."""
    from kdacourse import results

    run = results.kimi_train_run(results.KIMI_TRAIN if folder is None else folder)
    if run is None:
        path.write_text(not_yet_run("python -m benchmarks.kimi_train --out DIR",
                                    f"DIR/{results.KIMI_TRAIN_CSV}, {results.KIMI_TRAIN_ACCURACY} and "
                                    f"{results.KIMI_TRAIN_META}",
                                    "a folder of benchmarks/results/kimi_train/"))
        return
    rows = [[KIMI_TRAIN_GATE_LABELS.get(gate, gate), f"T {case.tokens}, H {case.H}",
             spread_cell(case.times.get("fla")), spread_cell(case.times.get("course")),
             spread_cell(case.speedup, "{:.2f}")]
            for (_, gate), case in run.cases.items()]
    missing = sorted({f"{impl} at {name} ({gate}): {why}" for (name, gate), case in run.cases.items()
                      for impl, why in case.missing.items()})
    text = (banner(SOURCE) + f"{results.kimi_train_provenance(run)}. One forward and backward (bf16, d = 128, "
            "B = 1), medians over the rounds in ms (min to max), and FLA's time over the course's taken round "
            "by round (above 1: the course is faster):\n\n"
            + markdown_table(["gate", "shape", "FLA", "course", "FLA / course"], rows)
            + ("\nNot measured: " + "; ".join(missing) + ".\n" if missing else ""))
    ratios = {gate: by_impl["course/fla"] for gate, by_impl in run.accuracy.items() if "course/fla" in by_impl}
    if ratios:
        quantities = [name for name in KIMI_TRAIN_QUANTITIES if any(name in row for row in ratios.values())]
        T, H = results.KIMI_TRAIN_ACCURACY_SHAPE
        text += ("\nThe course's error over FLA's, each against float64 autograd through the same activation "
                 f"(relative L2, T {T}, H {H}; below 1: the course is closer):\n\n"
                 + markdown_table(["gate", *(KIMI_TRAIN_QUANTITIES[name] for name in quantities)],
                                  [[KIMI_TRAIN_GATE_LABELS.get(gate, gate),
                                    *(f"{row[name]:.2f}" if name in row else "–" for name in quantities)]
                                   for gate, row in ratios.items()]))
    path.write_text(text)


def generated_files():
    return {
        "docs/generated/s06_any_gate.md": write_any_gate_table,
        "docs/generated/s06_errors.md": write_error_table,
        "docs/generated/s06_gradient_accuracy.md": write_gradient_accuracy_table,
        "docs/generated/s06_intra_sections.md": write_intra_sections_table,
        "docs/generated/s06_kimi_train.md": write_kimi_train_table,
        "docs/generated/s06_identities.md": write_identities_table,
        "docs/generated/s06_chunk_states.md": write_storage_table,
        "docs/generated/s06_training.md": write_training_table,
        "docs/generated/s06_training.svg": write_training_plot,
        "docs/generated/s06_training_cuda.md": write_cuda_training_table,
        "docs/generated/s06_training_cuda.svg": write_cuda_training_plot,
        "docs/generated/s06_training_unbounded.md": lambda path: write_cuda_training_table(path, UNBOUNDED_TRAINING_RUN),
        "docs/generated/s06_training_unbounded.svg": lambda path: _write_loss_plot(path, UNBOUNDED_TRAINING_RUN,
                                                                                   CUDA_LABELS),
    }
