"""Where stage 6's intra kernel spends its time: the kernel timed with one of its sections run twice,
and with every GEMM waited for.

    python -m benchmarks.studies.s06_intra_sections [--shape 1,16384,32,128] [--rounds 3] [--compile-only]

The intra kernel is most of the backward (2.8 of 5.0 ms at B = 1, N = 16384, H = 32, d = 128 on the
H200: docs/generated/backward_timings_ours_padded.md). This builds, from the kernel's own source, one
variant per section of SECTIONS in which that section runs twice (wrapped in a loop of two), and times the
kernel and each variant as CUDA graphs in interleaved rounds: a section's time is its variant's time
less the kernel's. Doubling a section, rather than cutting the others, keeps every buffer the kernel
allocates and so its shared memory (one block per SM): a kernel cut short would fit two. Each section
but `gates` computes the same values on its second run; `gates` reads dk back from dK, which its
first run has written over, so the variant's values are wrong, and only its time is used.

One more variant waits for each GEMM as it is issued (T.gemm where the kernel issues several with
T.wgmma_gemm and waits once): its time less the kernel's is what the shared waits save. It must
give the kernel's outputs bit for bit (the same instructions in the same order), which the study checks.

--compile-only lowers and compiles the kernel and each variant for sm_90a here (no GPU) and prints
their registers, spills and shared memory: a variant is a fair stand-in only where they match.
"""

import argparse
import re
import statistics
import sys

from benchmarks import fair
from benchmarks.studies.s06_intra_operand_precision import intra_source, load_intra_variant
from stages.s06_backward import kernel

# section: (the line its code starts at, the line it ends before), each the first line of the intra
# kernel's source that starts with that text (leading spaces ignored), the end looked for after the start
SECTIONS = {
    "loads (A_kk and T too) and cumulative gates": ("T.copy(Q[b, t0:t0 + C, h, :], Q_s[:, 0:d_k])",
                                                    "# --8<-- [end:intra_setup]"),
    "WY backwards (dA_hat, dv, d(K e^gamma))": ("# --8<-- [start:intra_wy]", "# beta by rows, after the solve"),
    "the solve backwards, dbeta": ("# beta by rows, after the solve", "# dA_qk^T = V_new dO^T"),
    "dA_qk": ("# dA_qk^T = V_new dO^T", "# --8<-- [end:intra_wy]"),
    "score gradients (both channel passes)": ("# diagonal sub-blocks, anchored at their middle row",
                                              "# --8<-- [end:intra_scores]"),
    "... of the diagonal sub-blocks (both channel passes)": ("# diagonal sub-blocks, anchored at their middle row",
                                                             "# a slab of sub key columns at a time"),
    "... of the slabs (both channel passes)": ("# a slab of sub key columns at a time", "# --8<-- [end:intra_scores]"),
    "dq, dk, dg written (both channel passes)": ("# --8<-- [start:intra_gates]", "return kda_intra"),
}


def _line_index(lines, text, start=0):
    for index in range(start, len(lines)):
        if lines[index].strip().startswith(text):
            return index
    raise RuntimeError(f"stage 6's intra kernel has no line starting {text!r} any more: update SECTIONS")


def doubled_source(section):
    """The intra kernel's source with SECTIONS[section] inside `for repeat in T.serial(2):`."""
    lines = intra_source().splitlines()
    first_text, end_text = SECTIONS[section]
    first = _line_index(lines, first_text)
    end = _line_index(lines, end_text, first + 1)
    body = lines[first:end]
    while not body[-1].strip():
        body.pop()
    indent = min(len(line) - len(line.lstrip()) for line in body if line.strip())
    if section.endswith("(both channel passes)") and indent != 16:
        raise RuntimeError(f"{section}: expected inside the channel-pass loop, found at indentation {indent}")
    wrapped = [" " * indent + "for repeat in T.serial(2):"] + ["    " + line if line.strip() else line for line in body]
    return "\n".join(lines[:first] + wrapped + lines[first + len(body):]) + "\n"


EVERY_GEMM_WAITED = "every GEMM waited for"


def every_gemm_waited_source():
    """The intra kernel's source with each GEMM it issues together with others (issue_gemm, T.wgmma_gemm
    at 64-token chunks) a T.gemm, which waits, and no shared waits."""
    lines = intra_source().replace("issue_gemm(", "T.gemm(").splitlines()
    kept = [line for line in lines if not line.strip().startswith("wait_for_tensor_cores(")]
    if len(kept) == len(lines):
        raise RuntimeError("stage 6's intra kernel no longer calls wait_for_tensor_cores: update this study")
    return "\n".join(kept) + "\n"


def variants():
    """{label: build_intra_program}: the kernel, each section doubled, every GEMM waited for."""
    builds = {"the kernel": kernel.build_intra_program}
    for index, section in enumerate(SECTIONS):
        builds[section] = load_intra_variant(doubled_source(section), f"intra_doubled_{index}")
    builds[EVERY_GEMM_WAITED] = load_intra_variant(every_gemm_waited_source(), "intra_every_gemm_waited")
    return builds


def built_programs(arguments):
    """{label: program} of variants(), built one after another: TileLang parses a program's source with
    Python's ast, which is not safe in threads on Python 3.11 (a SystemError, "AST constructor
    recursion depth mismatch", seen in CI); only the compiles run side by side."""
    return {label: build(*arguments) for label, build in variants().items()}


def compile_reports(shape):
    from stages.common.tilelang_tools import compile_in_threads, compile_report

    arguments = kernel.kernel_arguments(*shape, kernel.DEFAULT_CHUNK_SIZE, kernel.DEFAULT_BLOCK_DV, "bfloat16")["intra"]
    programs = built_programs(arguments)
    reports = compile_in_threads({label: (lambda program=program: compile_report(program))
                                  for label, program in programs.items()}, log=print)
    for report in reports.values():
        if isinstance(report, Exception):
            raise report
    return reports


def time_sections(shape, rounds):
    """{label: [ms per round]}: the kernel and each variant, as CUDA graphs on the same inputs (those the
    backward hands the intra kernel), the order reversed every round."""
    import tilelang
    import torch

    from benchmarks import bench
    from stages.common.tilelang_tools import compile_in_threads

    B, N, H, D = shape
    C = kernel.DEFAULT_CHUNK_SIZE
    arguments = kernel.kernel_arguments(B, N, H, D, D, C, kernel.DEFAULT_BLOCK_DV, "bfloat16")["intra"]
    outputs = kernel.BUILDERS["intra"][1]
    programs = built_programs(arguments)
    compiled = compile_in_threads({label: (lambda program=program: tilelang.compile(program, out_idx=outputs,
                                                                                    target="cuda"))
                                   for label, program in programs.items()}, log=print)
    q, k, v, g, beta = bench.make_inputs(bench.STAGES["s05"], B, N, H, D, torch.bfloat16)
    do = torch.randn(q.shape, device=q.device, generator=torch.Generator(q.device).manual_seed(1)).to(q.dtype)
    state = torch.zeros(B, H, D, D, dtype=torch.float32, device=q.device)
    kernels = kernel.compiled_kernels(B, N, H, D, D, C, kernel.DEFAULT_BLOCK_DV, "bfloat16")
    w, u, q_decayed, k_to_chunk_end, a_qk, chunk_decay, a_kk, inverse = kernels["prepare"](q, k, v, g, beta)
    states, v_new = kernels["states"](w, u, k_to_chunk_end, chunk_decay, state)
    d_states, dv_new, _ = kernels["state_gradient"](q_decayed, k_to_chunk_end, w, a_qk, chunk_decay, do, state)
    products = kernels["state_products"](states, d_states, v_new, dv_new, do, chunk_decay)
    graphs, failures = {}, {}
    for label, intra in compiled.items():
        try:
            if isinstance(intra, Exception):
                raise intra
            graphs[label] = fair.capture(lambda intra=intra: intra(q, k, v, g, beta, a_kk, inverse, do, v_new, dv_new,
                                                                       *products))
        except Exception as failure:  # a variant past the SM's shared memory: reported, the rest measured
            failures[label] = fair.failure_text(failure)
            print(f"{label}: not measured: {failures[label]}", flush=True)
            torch.cuda.synchronize()
    kernel_outputs, waited_outputs = (compiled[label](q, k, v, g, beta, a_kk, inverse, do, v_new, dv_new, *products)
                                      for label in ("the kernel", EVERY_GEMM_WAITED))
    equal = [bool(torch.equal(a, b)) for a, b in zip(kernel_outputs, waited_outputs)]
    print(f"{EVERY_GEMM_WAITED}: outputs (dq, dk, dv, dg, dbeta) bit-equal to the kernel's: {equal}", flush=True)
    timer = fair.make_timer(quick=False)
    times = {label: [] for label in graphs}
    order = list(graphs)
    for round_number in range(rounds):
        for label in order:
            times[label].append(timer(graphs[label].replay))
        print(f"round {round_number + 1}: " + ", ".join(f"{label} {times[label][-1]:.4f} ms" for label in graphs),
              flush=True)
        order.reverse()
    return times, failures


# the labels of the first run's log (2026-12-02), whose table multiplied the two sections inside the
# channel-pass loop by the two passes, though the doubled section already runs twice in each
FIRST_RUN_LABELS = {"score gradients (a channel pass)": "score gradients (both channel passes)",
                    "dq, dk, dg written (a channel pass)": "dq, dk, dg written (both channel passes)"}


def times_from_log(text):
    """{label: [ms per round]} from the `round N: label ms, ...` lines this study prints."""
    times = {}
    for line in re.findall(r"^round \d+: (.*)$", text, re.M):
        for label, ms in re.findall(r"(.+?) (\d+\.\d+) ms(?:, |$)", line):
            times.setdefault(FIRST_RUN_LABELS.get(label, label), []).append(float(ms))
    return times


def sections_table(times, failures=None):
    """The markdown table of the medians of `times` ({label: [ms per round]}): the kernel, the kernel
    with every GEMM waited for, then each section's time (its variant's less the kernel's)."""
    failures = failures or {}
    whole = statistics.median(times["the kernel"])
    waited = statistics.median(times[EVERY_GEMM_WAITED])
    lines = ["| section | kernel with it twice (ms) | the section (ms) | share of the kernel |", "|---|---|---|---|",
             f"| (the kernel) | {whole:.4f} | | |",
             f"| (the kernel, {EVERY_GEMM_WAITED}) | {waited:.4f} | {waited - whole:+.4f} (the shared waits' saving) | |"]
    for label in SECTIONS:
        if label not in times:
            lines.append(f"| {label} | not measured: {failures.get(label, 'no time')[:120]} | | |")
            continue
        doubled = statistics.median(times[label])
        section = doubled - whole  # a section inside the channel-pass loop runs twice in every pass
        lines.append(f"| {label} | {doubled:.4f} | {section:.4f} | {section / whole:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", type=fair.parse_shapes, default=[(1, 16384, 32, 128)], help="B,N,H,D")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile-only", action="store_true", help="registers and shared memory, no GPU")
    args = parser.parse_args(argv)
    (B, N, H, D), = args.shape
    if args.compile_only:
        for label, report in compile_reports((B, N, H, D, D)).items():
            print(f"{label}: {report.summary()}")
        return 0
    import torch

    if not torch.cuda.is_available():
        parser.error("timing needs a CUDA device (torch sees none); --compile-only runs here")
    times, failures = time_sections((B, N, H, D), args.rounds)
    print(f"\n{torch.cuda.get_device_name()}, B, N, H, D = {B}, {N}, {H}, {D}, bf16, {args.rounds} rounds, medians "
          "(CUDA graphs): the time of the kernel with the section run twice, less the kernel's")
    print(sections_table(times, failures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
