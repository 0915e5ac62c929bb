"""Stage 5 numerics: the types of the prepare kernel's anchored score operands, and the range of
gates they hold (the wrapper's value check).

The prepare kernel (stages.s05_fast_kda.kernel) multiplies q and k by e^{+-(gamma_r - gamma_m)},
anchored at a row m of each sub-block, before its score GEMMs. The off-diagonal slabs' factors are
all <= 1; the diagonal sub-blocks' reach a_min^-(SUB_BLOCK / 2) for the smallest gate a_min, which
decides the operands' types and the gates the kernels accept.
"""

import math

from stages.s05_fast_kda.reference import SUB_BLOCK


def score_operand_dtypes(dtype):
    """(diagonal blocks', slabs') dtypes of the prepare kernel's anchored score operands, for inputs
    in `dtype`: fp32 and fp16 for bf16 inputs, fp16 and fp16 for fp16 ones, else the inputs' own (the
    interpreter's float64).

    A slab's factors are all <= 1, so fp16 holds them at any gate, with 10 mantissa bits where bf16
    keeps 7. A diagonal block's factor e^{gamma_r - gamma_m} above its middle row m is at worst
    a_min^-8 for the smallest gate a_min (65504, fp16's largest value, at a_min = 0.25). bf16 inputs
    keep the GEMMs to gates far smaller (FAST_SPAN_LOG), so their diagonal operands are fp32, which
    the GEMM reads as TF32 (fp16's 10 bits). fp16 inputs keep fp16 there, where TF32 was less accurate
    (the stage 5 page's accuracy section measures both); past fp16's range their sub-blocks are taken
    term by term (exact_diagonal_block_macro in the kernel).
    """
    if dtype == "bfloat16":
        return "float32", "float16"
    if dtype == "float16":
        return "float16", "float16"
    return dtype, dtype


FP16_LARGEST_LOG = math.log(65504)  # ln of fp16's largest finite value
FP32_LARGEST_LOG = math.log(3.4028234663852886e38)  # ln of fp32's (bf16's and TF32's: the same exponent)
FP64_LARGEST_LOG = math.log(1.7976931348623157e308)  # the interpreter's float64 programs

# --8<-- [start:fast_span]
# The largest span (in e-folds) of a diagonal sub-block's anchored factors that the anchored GEMMs
# take, by the diagonal operands' dtype: half the log of the type's largest value. A factor e^span
# times an entry of q or k (<= 1) cannot overflow, and its partner e^-span keeps span e-folds above
# the type's smallest normal numbers (fp16: e^-9.7, fp32: e^-87.3), so the product loses nothing to
# subnormals. Past it, the sub-block is taken term by term (exact_diagonal_block_macro). The span
# sums up to 8 log gates (rows first + 1 .. middle): fp16 operands keep gates a >= 0.51 on the GEMMs,
# fp32 ones a >= 0.004; the benchmarks' (a >= 0.9, 0.84 e-folds) are far from either.
FAST_SPAN_LOG = {"float16": FP16_LARGEST_LOG / 2, "float32": FP32_LARGEST_LOG / 2, "float64": FP64_LARGEST_LOG / 2}
# --8<-- [end:fast_span]


def check_diagonal_range(g, dtype, smallest_gate=None):
    """No diagonal sub-block's anchored factor overflows its score operand: stage 6's backward only,
    whose intra kernel still anchors every diagonal sub-block at its middle row. Stage 5's forward and
    stage 7's prefill take any gate (anchored_scores_macro) and do not call it.

    A row r above its sub-block's middle row m gets e^{gamma_r - gamma_m} = e^{-(g_{r+1} + ... + g_m)},
    a sum of up to SUB_BLOCK / 2 consecutive log gates (a column below m, up to SUB_BLOCK / 2 - 1).
    Every window of SUB_BLOCK / 2 tokens must keep -sum(g) below the log of the operand's largest
    value (q and k L2-normalized, so their entries are <= 1): fp16 operands (fp16 inputs) 65504, so
    a >= 0.25 always passes; fp32 or bf16 operands (bf16 inputs) 3.4e38, so a >= e^-11 always passes.
    The middle-row anchor reads later tokens' gates for a row above m (g_{r+1} .. g_m), so a window
    of gates after a token can make that token's output NaN. FLA 0.6.0's tensor-core path (safe_gate)
    anchors at the sub-block's first cumulative gate instead, for that reason (chunk_kda_fwd_intra's
    docstring in fla/ops/kda/chunk_intra.py), with bounds of its own, and asks for gates >= -5.
    smallest_gate (check_gate_values returns it) skips the windows when no window can reach the
    bound; otherwise every window is read, wherever the sub-blocks fall, so packed sequences (stage 7)
    are covered too: one pass over g per token of the window. A factor's gates all lie in one
    sub-block (g_{r+1} .. g_m for a row r above m, g_{m+1} .. g_j for a column j below it); a window
    across two sub-blocks is refused too, so the check can refuse a call that would have run: the unbounded demo's gates at step 161
    summed to -90 across two sub-blocks, and that call, replayed past the check, was finite in every
    kernel (benchmarks/results/train_kda_cuda_unbounded).
    """
    if g.shape[1] == 0:
        return
    largest_log = FP16_LARGEST_LOG if dtype == "float16" else FP32_LARGEST_LOG
    window = min(SUB_BLOCK // 2, g.shape[1])
    if smallest_gate is not None and -smallest_gate * window <= largest_log:
        return
    tokens = g.shape[1] - window + 1
    window_sums = sum(g[:, start:start + tokens] for start in range(window))
    worst = -window_sums.min().item()
    if worst > largest_log:
        largest, remedy = (("65504", "Use bf16 inputs (these operands are fp32 there), bound the gates from below "
                            "(a >= 0.25 always passes)") if dtype == "float16" else
                           ("3.4e38", "Bound the gates from below (g >= -11 always passes; FLA's safe_gate path takes "
                            "lower_bound in [-5, 0))"))
        raise ValueError(
            f"g sums to -{worst:.3g} over {window} consecutive tokens: with {dtype} inputs the prepare kernel's "
            f"anchored score operands can reach e^{worst:.3g}, past their largest value {largest} = "
            f"e^{largest_log:.3g}, where they overflow and make the output NaN (when the window lies within one "
            f"{SUB_BLOCK}-token sub-block). {remedy}, or pass check_values=False to run anyway")
