"""Stage 5 numerics: the types of the prepare kernel's anchored score operands, and the span of
gates they hold before a sub-block is taken term by term.

The prepare kernel (stages.kda.prepare) multiplies q and k by e^{+-(gamma_r - gamma_m)},
anchored at a row m of each sub-block, before its score GEMMs. The off-diagonal slabs' factors are
all <= 1; the diagonal sub-blocks' reach a_min^-(SUB_BLOCK / 2) for the smallest gate a_min, which
decides the operands' types and the gates their GEMMs take (FAST_SPAN_LOG; past it, the kernels take
the sub-block by its definition, so every gate <= 0 runs). Stage 6's intra kernel anchors its
diagonal sub-blocks the same way, with operands in the input dtype.
"""

import math


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
FP32_LARGEST_LOG = math.log(3.4028234663852886e38)  # ln of fp32's (TF32's: the same exponent)
BF16_LARGEST_LOG = math.log(3.3895313892515355e38)  # fp32's exponent, 8 mantissa bits: a hair below fp32's
FP64_LARGEST_LOG = math.log(1.7976931348623157e308)  # the interpreter's float64 programs

# --8<-- [start:fast_span]
# The largest span (in e-folds) of a diagonal sub-block's anchored factors that the anchored GEMMs
# take, by the diagonal operands' dtype: half the log of the type's largest value. A factor e^span
# times an entry of q or k (<= 1) cannot overflow, and its partner e^-span keeps span e-folds above
# the type's smallest normal numbers (fp16: e^-9.7, fp32: e^-87.3), so the product loses nothing to
# subnormals. Past it, the sub-block is taken term by term (exact_diagonal_block_macro). The span
# sums up to 8 log gates (rows first + 1 .. middle): fp16 operands keep gates a >= 0.51 on the GEMMs,
# fp32 and bf16 ones (stage 6's bf16 backward) a >= 0.004; the benchmarks' (a >= 0.9, 0.84 e-folds)
# are far from either.
FAST_SPAN_LOG = {"float16": FP16_LARGEST_LOG / 2, "bfloat16": BF16_LARGEST_LOG / 2, "float32": FP32_LARGEST_LOG / 2,
                 "float64": FP64_LARGEST_LOG / 2}
# --8<-- [end:fast_span]

