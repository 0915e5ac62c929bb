"""The tile interpreter (stages.common.interpreter): every stage kernel against its references, each
construct on a tiny program, and three programs written the way TileLang's own examples write them.

Everything here runs on the CPU: TileLang only parses the programs, the interpreter runs them.

Bounds. A float64 program still accumulates in its fp32 fragments, so against reference C it meets
fp32's unit roundoff u = 2^-24 a few times over (8u); stage 5's block-inverse merges are TF32 GEMMs
(10 explicit mantissa bits, u = 2^-11) that touch only part of the result, so there 2^-13.
An fp16 or bf16 program rounds each output through a handful of casts to the dtype (the inputs, the
decayed or masked GEMM operands, the state as an operand, the output), each at most u relative
(fp16: 2^-11, bf16: 2^-8); with errors of independent sign these add in quadrature, so its rel L2
error against reference A stays within ROUNDING_WINDOW = [u / 4, 4u]. The lower end checks that
the casts round at all: without them the error is fp32's, hundreds of times smaller than bf16's u.
"""

import importlib
import math

import numpy as np
import pytest

from kdacourse import REPO_ROOT
from kdacourse.catalog import stages
from stages.common.compare import assert_close
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.common.interpreter import (
    InterpreterError,
    ReadBeforeWrite,
    UnsupportedConstruct,
    interpret,
    round_to_dtype,
)

UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}
FP32_FLOOR = 8 * UNIT_ROUNDOFF["float32"]  # a float64 program against reference C
TF32_FLOOR = 2.0**-13  # stage 5's float64 programs: their merges run as TF32 GEMMs
ROUNDING_WINDOW = (0.25, 4.0)  # the rel L2 error of an fp16 / bf16 program, in units of u


def _tilelang():
    import tilelang.language as T

    return T


def _rng(seed=0):
    return np.random.default_rng(seed)


# ------------------------------------------------------------------------------------------ stage kernels

# B * H = 2 programs per value block, two blocks of d_v columns, several chunks. Stage 5's chunks are
# 32 or 64 tokens (two or four 16-row sub-blocks), so it runs three chunks of 32.
B, H, D, BLOCK_DV = 1, 2, 32, 16
STAGE_SHAPES = {1: (64, 16), 2: (64, 16), 3: (64, 16), 4: (64, 16), 5: (96, 32)}  # N, chunk size
GATES = {1: "none", 2: "head", 3: "token", 4: "channel", 5: "channel"}
FOLDERS = {int(stage[1:3]): stage for stage in stages()}  # 1 -> "s01_linear_attention"
FORWARD_BUILDERS = ("build_program", "build_prepare_program")  # a stage's chunked forward kernel


def _stage_inputs(stage, dtype, seed=1):
    """Inputs with strong gates (a down to 0.5, or as low as the stage's fp16 wrapper accepts) and,
    where the stage has beta, beta drawn from [0, 1] with some entries exactly 0 and exactly 1."""
    N, C = STAGE_SHAPES[stage]
    lower = 0.5
    if stage == 4 and dtype == "float16":
        from stages.s04_kda.numerics import MAX_LOG_DECAY

        lower = 0.01 + math.exp(-MAX_LOG_DECAY["float16"] / C)  # the wrapper's "always passes" bound
    x = make_inputs(B, N, H, D, D, gate=GATES[stage], gate_range=(lower, 1.0),
                    beta_range=(0.0, 1.0) if stage >= 3 else None, seed=seed)
    if x.beta is not None:
        x.beta[:, 3::7] = 0.0
        x.beta[:, 5::7] = 1.0
    return x


def _run_stage(stage, dtype, x):
    """The stage's kernel(s) through the interpreter, as its wrapper calls them (N a multiple of C)."""
    N, C = STAGE_SHAPES[stage]
    kernel = importlib.import_module(f"stages.{FOLDERS[stage]}.kernel")
    arguments = _arguments(x)
    if hasattr(kernel, "build_program"):  # one kernel: its output follows the inputs
        program = kernel.build_program(B, N, H, D, D, C, BLOCK_DV, dtype=dtype)
        return interpret(program, out_idx=[len(arguments)])(*arguments)
    prepare = interpret(kernel.build_prepare_program(B, N, H, D, D, C, dtype=dtype), out_idx=[5, 6, 7, 8, 9, 10])
    recurrence = interpret(kernel.build_recurrence_program(B, N, H, D, D, C, BLOCK_DV, dtype=dtype), out_idx=[7, 8])
    o, _ = recurrence(*prepare(*arguments), np.zeros((B, H, D, D)))
    return o


def _references(stage):
    return importlib.import_module(f"stages.{FOLDERS[stage]}.reference")


def _arguments(x):
    return [a for a in (x.q, x.k, x.v, x.g, x.beta) if a is not None]


def test_every_stage_with_a_chunked_forward_kernel_is_interpreted():
    """The stages run here are those of the catalog whose kernel.py builds a chunked forward kernel of its
    own: defines one, or names one of the kernel package (stages/kda) that no earlier stage names (stage
    6 names stage 5's again; stage 0's puzzles have no library kernel: their own tests run them)."""
    forward, named = set(), set()
    for number, stage in sorted(FOLDERS.items()):
        if not (REPO_ROOT / "stages" / stage / "kernel.py").is_file():
            continue
        kernel = importlib.import_module(f"stages.{stage}.kernel")
        builders = {(getattr(kernel, name).__module__, name) for name in FORWARD_BUILDERS if hasattr(kernel, name)}
        if builders - named:
            forward.add(number)
        named |= builders
    assert forward == set(STAGE_SHAPES) == set(GATES), "give each such stage a shape and a gate above"


@pytest.mark.parametrize("stage", sorted(STAGE_SHAPES))
def test_float64_program_matches_reference_c(stage):
    N, C = STAGE_SHAPES[stage]
    x = _stage_inputs(stage, "float64")
    expected = _references(stage).kernel_mirror(*_arguments(x), C, BLOCK_DV)
    assert_close(_run_stage(stage, "float64", x), expected, rel_l2=TF32_FLOOR if stage == 5 else FP32_FLOOR,
                 chunk_size=C)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("stage", sorted(STAGE_SHAPES))
def test_low_precision_program_rounds_like_its_dtype(stage, dtype):
    """Against reference A: within [u/4, 4u]; the inputs are unchanged; a second call agrees."""
    N, C = STAGE_SHAPES[stage]
    x = _stage_inputs(stage, dtype)
    if stage == 4 and dtype == "float16":  # the wrapper would accept these gates
        import torch

        from stages.s04_kda.numerics import MAX_LOG_DECAY, max_chunk_log_decay

        assert max_chunk_log_decay(torch.tensor(x.g), C) <= MAX_LOG_DECAY["float16"]
    before = [a.copy() for a in _arguments(x)]
    reference = _references(stage if stage != 5 else 4)  # stage 5 has no reference A of its own
    expected = reference.recurrent(*_arguments(x))
    u = UNIT_ROUNDOFF[dtype]
    actual = _run_stage(stage, dtype, x)
    assert_close(actual, expected, rel_l2=ROUNDING_WINDOW[1] * u, chunk_size=C)
    rel_l2 = error_report(actual, expected).rel_l2
    assert rel_l2 >= ROUNDING_WINDOW[0] * u, f"rel L2 {rel_l2:.2e} is below u/4 = {u / 4:.2e}: {dtype} does not round"
    for given, kept in zip(_arguments(x), before):
        assert np.array_equal(given, kept), "the interpreter changed an input array"
    assert np.array_equal(_run_stage(stage, dtype, x), actual), "a second call gave another answer"


def test_stage5_kernels_each_match_their_reference():
    """prepare's six outputs against reference.prepare, and recurrence from a nonzero initial state
    against reference.recurrence fed the same tensors (its final state too)."""
    from stages.s05_fast_kda import reference
    from stages.kda.prepare import build_prepare_program
    from stages.kda.recurrence import build_recurrence_program

    N, C = STAGE_SHAPES[5]
    x = _stage_inputs(5, "float64")
    outputs = interpret(build_prepare_program(B, N, H, D, D, C, dtype="float64"), out_idx=[5, 6, 7, 8, 9, 10])(
        x.q, x.k, x.v, x.g, x.beta)
    expected = reference.prepare(x.q, x.k, x.v, x.g, x.beta, C)
    names = ("w", "u", "q_decayed", "k_to_chunk_end", "a_qk", "chunk_decay")
    for name, actual in zip(names, outputs):
        assert_close(actual, getattr(expected, name), rel_l2=TF32_FLOOR, name=name)
    initial_state = _rng(5).standard_normal((B, H, D, D)) * 0.1
    o, final_state = interpret(build_recurrence_program(B, N, H, D, D, C, BLOCK_DV, dtype="float64"),
                               out_idx=[7, 8])(*expected.__dict__.values(), initial_state)
    expected_o, expected_state = reference.recurrence(expected, BLOCK_DV, initial_state)
    assert_close(o, expected_o, rel_l2=FP32_FLOOR, chunk_size=C)
    assert_close(final_state, expected_state, rel_l2=FP32_FLOOR, name="the final state", axes=("batch", "head", "d_k", "d_v"))


# ------------------------------------------------------------------------------------------ constructs


def test_copy_with_bounds_reads_zero_outside_and_drops_writes_outside():
    """A 10 x 7 tensor in 4 x 4 tiles: the last row and column of tiles hang over its end."""
    T = _tilelang()
    M, N, tile = 10, 7, 4

    @T.prim_func
    def tiles(A: T.Tensor((M, N), "float32"), O: T.Tensor((M, N), "float32"),
              Padded: T.Tensor((12, 8), "float32")):
        with T.Kernel(T.ceildiv(N, tile), T.ceildiv(M, tile), threads=32) as (bx, by):
            A_s = T.alloc_shared((tile, tile), "float32")
            T.copy(A[by * tile:(by + 1) * tile, bx * tile:(bx + 1) * tile], A_s)  # slices past the end
            T.copy(A_s, O[by * tile, bx * tile])  # the start-index form
            T.copy(A_s, Padded[by * tile:(by + 1) * tile, bx * tile:(bx + 1) * tile])

    a = _rng().standard_normal((M, N)).astype(np.float32)
    o, padded = interpret(tiles, out_idx=[1, 2])(a)
    assert np.array_equal(o, a)  # the overhanging writes went nowhere, the rest arrived
    assert np.array_equal(padded[:M, :N], a)
    assert np.all(padded[M:, :] == 0) and np.all(padded[:, N:] == 0), "reads outside A must give 0"


def test_copy_start_index_form_takes_the_destination_shape():
    T = _tilelang()

    @T.prim_func
    def window(A: T.Tensor((8, 8), "float16"), O: T.Tensor((3, 5), "float16")):
        with T.Kernel(1, threads=32) as _bx:
            A_s = T.alloc_shared((3, 5), "float16")
            T.copy(A[2, 1], A_s)
            T.copy(A_s, O)

    a = _rng().standard_normal((8, 8)).astype(np.float16)
    assert np.array_equal(interpret(window, out_idx=[1])(a), a[2:5, 1:6])


def _gemm_program(transpose_A, transpose_B, clear_accum, dtype="float16", M=16, N=24, K=32):
    T = _tilelang()
    a_shape, b_shape = ((K, M) if transpose_A else (M, K)), ((N, K) if transpose_B else (K, N))

    @T.prim_func
    def gemm(A: T.Tensor(a_shape, dtype), Bm: T.Tensor(b_shape, dtype), C0: T.Tensor((M, N), "float32"),
             C: T.Tensor((M, N), "float32")):
        with T.Kernel(1, threads=128) as _bx:
            A_s = T.alloc_shared(a_shape, dtype)
            B_s = T.alloc_shared(b_shape, dtype)
            C_f = T.alloc_fragment((M, N), "float32")
            T.copy(A, A_s)
            T.copy(Bm, B_s)
            T.copy(C0, C_f)
            T.gemm(A_s, B_s, C_f, transpose_A=transpose_A, transpose_B=transpose_B, clear_accum=clear_accum)
            T.copy(C_f, C)

    return gemm, a_shape, b_shape


@pytest.mark.parametrize("clear_accum", [False, True])
@pytest.mark.parametrize("transpose_A, transpose_B", [(False, False), (False, True), (True, False), (True, True)])
def test_gemm_transposes_and_accumulates(transpose_A, transpose_B, clear_accum):
    program, a_shape, b_shape = _gemm_program(transpose_A, transpose_B, clear_accum)
    rng = _rng(3)
    a, b = rng.standard_normal(a_shape).astype(np.float16), rng.standard_normal(b_shape).astype(np.float16)
    c0 = rng.standard_normal((16, 24)).astype(np.float32)
    lhs, rhs = a.astype(np.float64), b.astype(np.float64)
    expected = (lhs.T if transpose_A else lhs) @ (rhs.T if transpose_B else rhs) + (0 if clear_accum else c0)
    assert_close(interpret(program, out_idx=[3])(a, b, c0), expected, rel_l2=FP32_FLOOR, axes=("row", "column"))


def _round_significand(x, bits):
    """x rounded to `bits` significant bits, half to even (np.round), by frexp: m in [0.5, 1)."""
    m, e = np.frexp(np.asarray(x, dtype=np.float64))
    return np.ldexp(np.round(m * 2.0**bits) / 2.0**bits, e)


def test_gemm_reads_fp32_operands_as_tf32():
    """Hopper's tensor cores read fp32 operands as TF32 (11 significant bits) and sum in fp32."""
    program, a_shape, b_shape = _gemm_program(False, True, True, dtype="float32")
    rng = _rng(4)
    a, b = rng.standard_normal(a_shape).astype(np.float32), rng.standard_normal(b_shape).astype(np.float32)
    actual = interpret(program, out_idx=[3])(a, b, np.zeros((16, 24), np.float32))
    assert_close(actual, _round_significand(a, 11) @ _round_significand(b, 11).T, rel_l2=FP32_FLOOR,
                 axes=("row", "column"))
    assert error_report(actual, a.astype(np.float64) @ b.astype(np.float64).T).rel_l2 > 1e-5  # not fp32's


def test_lanes_storing_different_values_into_one_element_are_a_race():
    """Every lane of a T.Parallel writing its own value into one element is a race on the GPU: the
    interpreter refuses it, naming the element. The same value from every lane (a flag) is no race."""
    T = _tilelang()

    @T.prim_func
    def race(A: T.Tensor((8, 4), "float32"), O: T.Tensor((8,), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            row = T.alloc_fragment((8,), "float32")
            for i, j in T.Parallel(8, 4):
                row[i] = A[i, j]  # four lanes j per element i
            T.copy(row, O)

    @T.prim_func
    def flag(A: T.Tensor((8, 4), "float32"), O: T.Tensor((8,), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            row = T.alloc_fragment((8,), "float32")
            for i, _j in T.Parallel(8, 4):
                row[i] = A[i, 0] * 2  # the same value from every lane _j
            T.copy(row, O)

    a = _rng().standard_normal((8, 4)).astype(np.float32)
    with pytest.raises(InterpreterError, match=r"row\[0\]: lanes of one T.Parallel store different values"):
        interpret(race, out_idx=[1])(a)
    assert np.array_equal(interpret(flag, out_idx=[1])(a), a[:, 0] * 2)


def test_parallel_loops_with_if_and_if_then_else():
    """A 2-D nest (M != N, so a swapped axis shows) with an `if`/`else` and T.if_then_else, and a
    1-D nest with an `if` that leaves some lanes idle."""
    T = _tilelang()
    M, N = 6, 5

    @T.prim_func
    def lanes(A: T.Tensor((M, N), "float32"), O: T.Tensor((M, N), "float32"), P: T.Tensor((M,), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            for i, j in T.Parallel(M, N):
                if (i + 2 * j) % 3 == 0:
                    O[i, j] = A[i, j] * 2
                else:
                    O[i, j] = T.if_then_else(i > j, A[i, j], -A[i, j] - i * 10 - j)
            for i in T.Parallel(M):
                if i < 4:
                    P[i] = A[i, N - 1] + i

    a = _rng().standard_normal((M, N)).astype(np.float32)
    o, p = interpret(lanes, out_idx=[1, 2])(a)
    i, j = np.meshgrid(np.arange(M), np.arange(N), indexing="ij")
    expected = np.where((i + 2 * j) % 3 == 0, a * 2.0, np.where(i > j, a, -a.astype(np.float64) - i * 10 - j))
    assert_close(o, expected, rtol=2 * UNIT_ROUNDOFF["float32"], axes=("row", "column"))  # fp32 arithmetic
    assert np.array_equal(p[:4], a[:4, N - 1] + np.arange(4))
    assert np.all(np.isnan(p[4:])), "lanes the `if` skipped must not write"


def test_serial_loop_of_lane_dependent_extent_with_a_var_per_lane():
    """Row i sums A[i, :i + 1] in its own register: each lane's loop runs i + 1 times."""
    T = _tilelang()
    M = 7

    @T.prim_func
    def prefix(A: T.Tensor((M, M), "float32"), O: T.Tensor((M,), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            for i in T.Parallel(M):
                running = T.alloc_var("float32")
                running = 0
                for j in T.serial(i + 1):
                    running += A[i, j]
                O[i] = running

    a = _rng().standard_normal((M, M)).astype(np.float32)
    expected = np.array([a[i, :i + 1].sum(dtype=np.float64) for i in range(M)])
    assert_close(interpret(prefix, out_idx=[1])(a), expected, rel_l2=FP32_FLOOR, axes=("row",))


@pytest.mark.parametrize("clear", [True, False])
def test_reductions_with_and_without_clear(clear):
    T = _tilelang()
    M, N = 6, 9

    @T.prim_func
    def reduce(A: T.Tensor((M, N), "float32"), Init: T.Tensor((M,), "float32"), Row_max: T.Tensor((M,), "float32"),
               Row_sum: T.Tensor((M,), "float32"), Col_sum: T.Tensor((N,), "float32")):
        with T.Kernel(1, threads=128) as _bx:
            A_f = T.alloc_fragment((M, N), "float32")
            row_max = T.alloc_fragment((M,), "float32")
            row_sum = T.alloc_fragment((M,), "float32")
            col_sum = T.alloc_fragment((N,), "float32")
            T.copy(A, A_f)
            T.copy(Init, row_max)
            T.copy(Init, row_sum)
            T.fill(col_sum, 1)
            T.reduce_max(A_f, row_max, dim=1, clear=clear)
            T.reduce_sum(A_f, row_sum, dim=1, clear=clear)
            T.reduce_sum(A_f, col_sum, dim=0, clear=clear)
            T.copy(row_max, Row_max)
            T.copy(row_sum, Row_sum)
            T.copy(col_sum, Col_sum)

    rng = _rng(6)
    a, init = rng.standard_normal((M, N)).astype(np.float32), rng.standard_normal(M).astype(np.float32) + 1
    row_max, row_sum, col_sum = interpret(reduce, out_idx=[2, 3, 4])(a, init)
    a64 = a.astype(np.float64)
    assert np.array_equal(row_max, a.max(axis=1) if clear else np.maximum(a.max(axis=1), init))
    assert_close(row_sum, a64.sum(axis=1) + (0 if clear else init), rel_l2=FP32_FLOOR, axes=("row",))
    assert_close(col_sum, a64.sum(axis=0) + (0 if clear else 1), rel_l2=FP32_FLOOR, axes=("column",))


def test_fill_and_clear():
    T = _tilelang()

    @T.prim_func
    def fills(O: T.Tensor((4, 4), "float16"), Z: T.Tensor((4, 4), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            f = T.alloc_fragment((4, 4), "float16")
            z = T.alloc_shared((4, 4), "float32")
            T.fill(f, 1.0 / 3)
            T.clear(z)
            T.fill(f[1:3, 1:3], -2)  # a region: only its four elements
            T.copy(f, O)
            T.copy(z, Z)

    o, z = interpret(fills, out_idx=[0, 1])()
    expected = np.full((4, 4), np.float16(1.0 / 3))
    expected[1:3, 1:3] = -2
    assert np.array_equal(o, expected) and np.array_equal(z, np.zeros((4, 4)))


@pytest.mark.parametrize("dim, reverse", [(0, False), (1, False), (0, True), (1, True)])
def test_cumsum(dim, reverse):
    T = _tilelang()
    M, N = 5, 6

    @T.prim_func
    def scan(A: T.Tensor((M, N), "float32"), O: T.Tensor((M, N), "float32")):
        with T.Kernel(1, threads=128) as _bx:
            A_s = T.alloc_shared((M, N), "float32")
            T.copy(A, A_s)
            T.cumsum(A_s, dim=dim, reverse=reverse)
            T.copy(A_s, O)

    a = _rng().standard_normal((M, N)).astype(np.float32)
    flipped = np.flip(a, dim) if reverse else a
    expected = np.cumsum(flipped.astype(np.float64), axis=dim)
    expected = np.flip(expected, dim) if reverse else expected
    assert_close(interpret(scan, out_idx=[1])(a), expected, rel_l2=FP32_FLOOR, axes=("row", "column"))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_math_intrinsics(dtype):
    T = _tilelang()
    n = 64

    @T.prim_func
    def math_ops(A: T.Tensor((n,), dtype), Bv: T.Tensor((n,), dtype), O: T.Tensor((8, n), dtype)):
        with T.Kernel(1, threads=64) as _bx:
            for i in T.Parallel(n):
                O[0, i] = T.exp2(A[i])
                O[1, i] = T.exp(A[i])
                O[2, i] = T.log(T.abs(A[i]) + 1)
                O[3, i] = T.sqrt(T.abs(A[i]))
                O[4, i] = T.rsqrt(T.abs(A[i]) + 1)
                O[5, i] = T.max(A[i], Bv[i])
                O[6, i] = T.min(A[i], Bv[i])
                O[7, i] = T.abs(A[i] - Bv[i])

    rng = _rng(7)
    a, b = (rng.uniform(-3, 3, n).astype(np.float16).astype(np.float32) for _ in range(2))
    x, y = a.astype(np.float64), b.astype(np.float64)

    def rounded(z):  # an argument computed in the program's dtype is rounded to it before the call
        return z.astype(np.float16).astype(np.float64) if dtype == "float16" else z

    expected = [np.exp2(x), np.exp(x), np.log(rounded(np.abs(x) + 1)), np.sqrt(np.abs(x)),
                1 / np.sqrt(rounded(np.abs(x) + 1)), np.maximum(x, y), np.minimum(x, y), np.abs(x - y)]
    actual = interpret(math_ops, out_idx=[2])(a, b)
    u = UNIT_ROUNDOFF[dtype]
    for name, row, value in zip(("exp2", "exp", "log", "sqrt", "rsqrt", "max", "min", "abs"), actual, expected):
        assert_close(row, value, rtol=4 * u, atol=0, name=f"T.{name}", axes=("lane",))
        if dtype == "float16":  # the result is on fp16's grid: it was rounded to the call's dtype
            assert np.array_equal(row, row.astype(np.float16)), f"T.{name} did not round to fp16"


def _cast_program(dtype, n):
    T = _tilelang()

    @T.prim_func
    def cast(A: T.Tensor((n,), "float32"), Copied: T.Tensor((n,), dtype), Cast: T.Tensor((n,), dtype)):
        with T.Kernel(1, threads=128) as _bx:
            A_s = T.alloc_shared((n,), "float32")
            T.copy(A, A_s)
            T.copy(A_s, Copied)  # T.copy casts to the destination's dtype
            for i in T.Parallel(n):
                Cast[i] = T.Cast(dtype, A_s[i] * 1)  # an explicit cast of an expression

    return cast


def _float32_cases(grid_bits, rng, count=4000):
    """float32 values that stress a rounding to `grid_bits` explicit mantissa bits: exact ties (with
    even and odd neighbours, both signs), one float32 ulp either side of them, random bit patterns,
    and the edges (subnormals, the largest finite values, +-inf, zeros)."""
    grid = rng.standard_normal(count).astype(np.float32) * np.float32(2.0) ** rng.integers(-20, 20, count)
    bits = grid.view(np.uint32) & ~np.uint32((1 << (23 - grid_bits)) - 1)
    ties = (bits | np.uint32(1 << (22 - grid_bits))).view(np.float32)
    ulp = np.float32(1) + np.finfo(np.float32).eps
    random_bits = rng.integers(0, 2**32, count, dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.array([0.0, -0.0, 1e-40, -3e-39, 6e-8, 65504, 65519, 65520, 3.0e38, np.finfo(np.float32).max,
                      np.inf, -np.inf], dtype=np.float32)
    values = np.concatenate([ties, ties * ulp, ties / ulp, random_bits, edges])
    return values[np.isfinite(values) | np.isinf(values)]  # NaN patterns compare unequal: tested apart


def test_bf16_casts_round_like_torch():
    import torch

    values = _float32_cases(7, _rng(8))
    expected = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
    copied, cast = interpret(_cast_program("bfloat16", len(values)), out_idx=[1, 2])(values)
    for name, actual in (("T.copy", copied), ("T.Cast", cast)):
        differ = actual.view(np.uint32) != expected.view(np.uint32)
        assert not differ.any(), f"{name} to bf16: {differ.sum()} values differ from torch, first {values[differ][:3]}"
    assert np.isnan(round_to_dtype(np.float32(np.nan), "bfloat16"))


def test_fp16_casts_round_like_numpy():
    values = _float32_cases(10, _rng(9))
    with np.errstate(over="ignore"):  # values beyond fp16's range become inf, as they should
        expected = values.astype(np.float16)
    copied, cast = interpret(_cast_program("float16", len(values)), out_idx=[1, 2])(values)
    for name, actual in (("T.copy", copied), ("T.Cast", cast)):
        differ = actual.view(np.uint16) != expected.view(np.uint16)
        assert not differ.any(), f"{name} to fp16: {differ.sum()} values differ from NumPy, first {values[differ][:3]}"


def _line_in_this_file(statement):
    """The number of the one line of this file that holds `statement`."""
    numbers = [n for n, line in enumerate(open(__file__).read().splitlines(), 1) if line.strip() == statement]
    assert len(numbers) == 1, f"{statement!r} is on lines {numbers}"
    return numbers[0]


def test_reading_an_unwritten_element_names_the_buffer_and_the_line():
    """A shared buffer never written, and a fragment written in part, each copied out; lanes that an
    `if` leaves idle may read unwritten elements (they execute nothing)."""
    T = _tilelang()

    @T.prim_func
    def unwritten_shared(O: T.Tensor((4, 4), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            never_written = T.alloc_shared((4, 4), "float32")
            T.copy(never_written, O)

    @T.prim_func
    def half_written(A: T.Tensor((4, 4), "float32"), O: T.Tensor((4, 4), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            left_half = T.alloc_fragment((4, 4), "float16")
            for i, j in T.Parallel(4, 4):
                if j < 2:
                    left_half[i, j] = A[i, j]
            for i, j in T.Parallel(4, 4):
                if j < 3:
                    O[i, j] = left_half[i, j] * 2

    @T.prim_func
    def idle_lanes_read(A: T.Tensor((4, 4), "float32"), O: T.Tensor((4, 4), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            left_half = T.alloc_fragment((4, 4), "float64")
            for i, j in T.Parallel(4, 4):
                if j < 2:
                    left_half[i, j] = A[i, j]
            for i, j in T.Parallel(4, 4):
                O[i, j] = T.if_then_else(j < 2, left_half[i, j], 0)

    with pytest.raises(ReadBeforeWrite) as error:
        interpret(unwritten_shared, out_idx=[0])()
    line = _line_in_this_file("T.copy(never_written, O)")
    assert str(error.value).startswith(f"tests/stages/test_interpreter.py, line {line}: `T.copy(never_written, O)`: "
                                       "reads `never_written` before writing it: never_written[0, 0] holds no value")
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    with pytest.raises(ReadBeforeWrite) as error:
        interpret(half_written, out_idx=[1])(a)
    line = _line_in_this_file("O[i, j] = left_half[i, j] * 2")
    assert str(error.value).startswith(f"tests/stages/test_interpreter.py, line {line}: `O[i, j] = left_half[i, j] * 2`: "
                                       "reads `left_half` before writing it: left_half[0, 2] holds no value")
    o = interpret(idle_lanes_read, out_idx=[1])(a)
    assert np.array_equal(o[:, :2], a[:, :2]) and np.all(o[:, 2:] == 0)


def test_gemm_rows_of_unwritten_operand_rows_stop_the_run_only_where_used():
    """A GEMM whose A has rows nothing wrote computes garbage rows of C (as a GPU does): no error
    while those rows are not used, an error naming A's read and C's use where they are."""
    T = _tilelang()
    M = N = K = 16

    def program(rows_used):
        @T.prim_func
        def lower_rows(A: T.Tensor((M, K), "float16"), Bm: T.Tensor((K, N), "float16"), O: T.Tensor((M, N), "float32")):
            with T.Kernel(1, threads=128) as _bx:
                A_s = T.alloc_shared((M, K), "float16")
                B_s = T.alloc_shared((K, N), "float16")
                C_f = T.alloc_fragment((M, N), "float32")
                for i, k in T.Parallel(M, K):
                    if i >= 8:
                        A_s[i, k] = A[i, k]
                T.copy(Bm, B_s)
                T.gemm(A_s, B_s, C_f, clear_accum=True)
                for i, j in T.Parallel(M, N):
                    O[i, j] = T.if_then_else(i >= rows_used, C_f[i, j], 0)

        return lower_rows

    rng = _rng(3)
    a, b = (rng.standard_normal((16, 16)).astype(np.float16) for _ in range(2))
    o = interpret(program(rows_used=8), out_idx=[2])(a, b)
    expected = np.where(np.arange(M)[:, None] >= 8, a.astype(np.float64) @ b.astype(np.float64), 0)
    assert_close(o, expected, rtol=2 * UNIT_ROUNDOFF["float32"] * K, axes=("row", "column"))
    with pytest.raises(ReadBeforeWrite) as error:
        interpret(program(rows_used=7), out_idx=[2])(a, b)
    message = str(error.value)
    assert message.startswith(f"tests/stages/test_interpreter.py, line {_line_in_this_file('T.gemm(A_s, B_s, C_f, clear_accum=True)')}")
    assert "reads `A_s` before writing it: A_s[0, 0] holds no value yet" in message
    use = "O[i, j] = T.if_then_else(i >= rows_used, C_f[i, j], 0)"
    assert f"reached `C_f`[7, 0], used at tests/stages/test_interpreter.py, line {_line_in_this_file(use)}" in message


def test_a_nan_the_program_computes_is_no_unwritten_element():
    """inf - inf in fp16 (an overflow a stage's page teaches) stored and read back is a NaN, not a read
    before a write."""
    T = _tilelang()

    @T.prim_func
    def overflow(A: T.Tensor((4,), "float16"), O: T.Tensor((4,), "float16")):
        with T.Kernel(1, threads=32) as _bx:
            s = T.alloc_shared((4,), "float16")
            for i in T.Parallel(4):
                s[i] = A[i] * A[i] - A[i] * A[i]  # 60000^2 overflows to inf
            T.copy(s, O)

    o = interpret(overflow, out_idx=[1])(np.array([60000.0, 1.0, 2.0, 60000.0]))
    assert np.all(np.isnan(o[[0, 3]])) and np.all(o[1:3] == 0)


def test_out_of_bounds_load_raises_naming_the_buffer():
    T = _tilelang()
    M = 8

    @T.prim_func
    def shifted(A: T.Tensor((M, M), "float32"), O: T.Tensor((M, M), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            for i, j in T.Parallel(M, M):
                if j > 2:  # a mask over both lanes: the faulting index varies over i only
                    O[i, j] = A[i + 1, j]

    @T.prim_func
    def guarded(A: T.Tensor((M, M), "float32"), O: T.Tensor((M, M), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            for i, j in T.Parallel(M, M):
                O[i, j] = T.if_then_else(i + 1 < M, A[T.min(i + 1, M), j], 0)

    a = np.ones((M, M), np.float32)
    with pytest.raises(InterpreterError, match=r"line \d+: `O\[i, j\] = A\[i \+ 1, j\]`: A: index 8 is outside axis 0 of size 8"):
        interpret(shifted, out_idx=[1])(a)
    o = interpret(guarded, out_idx=[1])(a)  # the lanes that would read A[8] do not take that branch
    assert np.array_equal(o[:-1], a[1:]) and np.all(o[-1] == 0)


def test_out_idx_none_writes_outputs_in_place_and_leaves_inputs():
    T = _tilelang()

    @T.prim_func
    def double(A: T.Tensor((4,), "float16"), O: T.Tensor((4,), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            for i in T.Parallel(4):
                O[i] = A[i] * 2

    a, o = np.array([0.1, 0.2, 0.3, 0.4]), np.zeros(4)
    interpret(double)(a, o)
    assert np.array_equal(o, 2 * a.astype(np.float16).astype(np.float64))
    assert np.array_equal(a, [0.1, 0.2, 0.3, 0.4]), "an input the program only reads must stay as given"


def test_barrier_is_accepted():
    T = _tilelang()

    @T.prim_func
    def synced(A: T.Tensor((4,), "float32"), O: T.Tensor((4,), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            s = T.alloc_shared((4,), "float32")
            T.copy(A, s)
            T.sync_threads()
            T.copy(s, O)

    a = np.arange(4, dtype=np.float32)
    assert np.array_equal(interpret(synced, out_idx=[1])(a), a)


def test_unsupported_constructs_name_the_construct_and_the_line():
    T = _tilelang()

    @T.prim_func
    def shuffled(A: T.Tensor((32,), "float32"), O: T.Tensor((32,), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            tx = T.get_thread_binding()
            O[tx] = T.shfl_xor(A[tx], 1)

    @T.prim_func
    def thread_in_parallel(A: T.Tensor((32,), "float32"), O: T.Tensor((32,), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            tx = T.get_thread_binding()
            for i in T.Parallel(32):
                O[i] = A[tx]

    with pytest.raises(UnsupportedConstruct) as shuffle_error:
        interpret(shuffled, out_idx=[1])
    message = str(shuffle_error.value)
    assert "the call tl.shfl_xor_sync" in message
    assert "test_interpreter.py:" in message and "O[tx] = T.shfl_xor(A[tx], 1)" in message  # the Python line
    assert "of shuffled.script(): O[tx] = T.shfl_xor_sync(" in message  # and the line of the parsed program
    with pytest.raises(UnsupportedConstruct) as thread_error:
        interpret(thread_in_parallel, out_idx=[1])
    message = str(thread_error.value)
    assert "the thread index tx (or a value bound from it) inside T.Parallel" in message and "O[i] = A[tx]" in message


# ------------------------------------------------------------------------------------------ threads and atomics
# A block that reads its thread index runs each statement in all its threads at once: the index is an
# array over the threads, a condition on it a mask, a T.alloc_var one value per thread.


def test_thread_index_runs_each_statement_in_every_thread():
    """Two blocks of 4 x 2 threads, each thread storing its own element under a guard: every (tx, ty)
    pair runs once in each block, and the elements past the guard are never stored."""
    T = _tilelang()
    N = 13

    @T.prim_func
    def numbered(O: T.Tensor((N, 3), "int32")):
        with T.Kernel(2, threads=(4, 2)) as bx:
            tx = T.get_thread_binding(0)
            ty = T.get_thread_binding(1)
            i = bx * 8 + ty * 4 + tx
            if i < N:
                O[i, 0] = tx
                O[i, 1] = ty
                O[i, 2] = bx

    o = np.full((N, 3), -1)
    interpret(numbered)(o)
    i = np.arange(N)
    assert np.array_equal(o, np.stack([i % 4, i % 8 // 4, i // 8], axis=1))


def test_thread_binding_loop_is_the_thread_index():
    """`for t in T.thread_binding(n, "threadIdx.x")` after a tile copy into shared memory: each thread
    reads another's element (TileLang puts the barrier between them); a range that is not the
    threads' is refused."""
    T = _tilelang()

    def program(extent):
        @T.prim_func
        def reversed_copy(A: T.Tensor((32,), "float32"), O: T.Tensor((32,), "float32")):
            with T.Kernel(1, threads=32) as _bx:
                A_s = T.alloc_shared((32,), "float32")
                T.copy(A, A_s)
                for t in T.thread_binding(extent, thread="threadIdx.x"):
                    O[t] = A_s[31 - t]

        return reversed_copy

    a = np.arange(32, dtype=np.float32)
    assert np.array_equal(interpret(program(32), out_idx=[1])(a), a[::-1])
    with pytest.raises(InterpreterError, match="bound to threadIdx.x from 0 to 16, but the kernel launches 32 threads"):
        interpret(program(16), out_idx=[1])(a)


def test_a_variable_holds_one_value_per_thread():
    """A row's dot product in each thread: a T.alloc_var accumulated over a serial loop whose length
    depends on the thread (thread t sums its row's first t + 1 products)."""
    T = _tilelang()
    R, D = 8, 8

    @T.prim_func
    def partial_dots(A: T.Tensor((R, D), "float32"), Bm: T.Tensor((R, D), "float32"), O: T.Tensor((R,), "float32")):
        with T.Kernel(1, threads=R) as _bx:
            tx = T.get_thread_binding()
            total = T.alloc_var("float32")
            total = 0
            for j in T.serial(tx + 1):
                total += A[tx, j] * Bm[tx, j]
            O[tx] = total

    rng = _rng(4)
    a, b = (rng.integers(-4, 5, (R, D)).astype(np.float32) for _ in range(2))
    expected = [np.dot(a[r, :r + 1], b[r, :r + 1]) for r in range(R)]
    assert np.array_equal(interpret(partial_dots, out_idx=[2])(a, b), expected)


def test_a_tile_operation_under_a_condition_on_the_thread_is_refused():
    T = _tilelang()

    @T.prim_func
    def divergent_copy(A: T.Tensor((32,), "float32"), O: T.Tensor((32,), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            tx = T.get_thread_binding()
            if tx < 16:
                T.copy(A, O)

    with pytest.raises(InterpreterError, match="T.copy under a condition on the thread index"):
        interpret(divergent_copy, out_idx=[1])(np.zeros(32))


def test_atomic_add_counts_every_thread_and_block():
    """A histogram of 100 values in 4 blocks of 32 threads: T.atomic_add counts every value, where the
    plain `H[v] = H[v] + 1` keeps one add per bin and block (the threads of a block read the bin at
    once); an atomic into an element nothing wrote is a read before a write."""
    T = _tilelang()
    N, BINS, THREADS = 100, 8, 32

    def program(atomic):
        @T.prim_func
        def histogram(A: T.Tensor((N,), "int32"), H: T.Tensor((BINS,), "int32")):
            with T.Kernel(T.ceildiv(N, THREADS), threads=THREADS) as bx:
                tx = T.get_thread_binding()
                i = bx * THREADS + tx
                if i < N:
                    if atomic:
                        T.atomic_add(H[A[i]], 1)
                    else:
                        H[A[i]] = H[A[i]] + 1

        return histogram

    values = _rng(6).integers(0, BINS, N)
    counted = np.zeros(BINS, np.int64)
    interpret(program(atomic=True))(values, counted)
    assert np.array_equal(counted, np.bincount(values, minlength=BINS))
    plain = np.zeros(BINS, np.int64)
    interpret(program(atomic=False))(values, plain)
    blocks_per_bin = [len({i // THREADS for i in np.flatnonzero(values == v)}) for v in range(BINS)]
    assert np.array_equal(plain, blocks_per_bin)


def test_atomic_max_min_and_the_tile_form():
    """T.atomic_max and T.atomic_min from the lanes of a T.Parallel, and T.atomic_add of a whole tile, each
    block combining its row into the output; an output allocated by out_idx holds nothing to add into."""
    T = _tilelang()
    R, D = 4, 8

    @T.prim_func
    def combine_rows(A: T.Tensor((R, D), "float32"), Total: T.Tensor((D,), "float32"), Top: T.Tensor((1,), "float32"),
                     Bottom: T.Tensor((1,), "float32")):
        with T.Kernel(R, threads=32) as bx:
            row = T.alloc_fragment((D,), "float32")
            T.copy(A[bx, :], row)
            T.atomic_add(Total[0:D], row)
            for j in T.Parallel(D):
                T.atomic_max(Top[0], row[j])
                T.atomic_min(Bottom[0], row[j])

    a = _rng(7).standard_normal((R, D)).astype(np.float32)
    total, top, bottom = np.zeros(D, np.float32), np.full(1, -np.inf, np.float32), np.full(1, np.inf, np.float32)
    interpret(combine_rows)(a, total, top, bottom)
    assert_close(total, a.astype(np.float64).sum(axis=0), rel_l2=4 * UNIT_ROUNDOFF["float32"], axes=("column",))
    assert top[0] == a.max() and bottom[0] == a.min()
    with pytest.raises(ReadBeforeWrite, match=r"T.atomic_add adds into Total\[0\], which holds no value yet"):
        interpret(combine_rows, out_idx=[1, 2, 3])(a)


# ------------------------------------------------------------------------------------------ TileLang's style
# Programs written the way TileLang's examples write them (examples/gemm, flash_attention,
# linear_attention), not from the course's kernels, each against a NumPy reference.


def _tiled_gemm(M, N, K, block_M, block_N, block_K, trans_B, dtype="float16", accum_dtype="float32"):
    T = _tilelang()
    B_shape = (N, K) if trans_B else (K, N)
    B_tile = (block_N, block_K) if trans_B else (block_K, block_N)

    @T.prim_func
    def matmul(A: T.Tensor((M, K), dtype), Bm: T.Tensor(B_shape, dtype), C: T.Tensor((M, N), dtype)):
        with T.Kernel(T.ceildiv(N, block_N), T.ceildiv(M, block_M), threads=128) as (bx, by):
            A_shared = T.alloc_shared((block_M, block_K), dtype)
            B_shared = T.alloc_shared(B_tile, dtype)
            C_local = T.alloc_fragment((block_M, block_N), accum_dtype)
            T.clear(C_local)
            for ko in T.Pipelined(T.ceildiv(K, block_K), num_stages=3):
                T.copy(A[by * block_M, ko * block_K], A_shared)
                if trans_B:
                    T.copy(Bm[bx * block_N, ko * block_K], B_shared)
                else:
                    T.copy(Bm[ko * block_K, bx * block_N], B_shared)
                T.gemm(A_shared, B_shared, C_local, transpose_B=trans_B)
            T.copy(C_local, C[by * block_M, bx * block_N])

    return matmul, B_shape


@pytest.mark.parametrize("trans_B", [False, True])
@pytest.mark.parametrize("M, N, K", [(64, 96, 64), (50, 40, 70)])  # tile multiples, and not
def test_tiled_gemm(M, N, K, trans_B):
    program, B_shape = _tiled_gemm(M, N, K, 32, 32, 32, trans_B)
    rng = _rng(10)
    a, b = rng.standard_normal((M, K)).astype(np.float16), rng.standard_normal(B_shape).astype(np.float16)
    b64 = b.astype(np.float64)
    expected = a.astype(np.float64) @ (b64.T if trans_B else b64)
    assert_close(interpret(program, out_idx=[2])(a, b), expected, rel_l2=UNIT_ROUNDOFF["float16"], axes=("row", "column"))


def _flash_attention(batch, heads, seq_len, dim, is_causal, block_M, block_N):
    T = _tilelang()
    scale = (1.0 / dim) ** 0.5 * 1.44269504  # softmax scale, times log2(e) for exp2
    shape = (batch, seq_len, heads, dim)
    dtype, accum_dtype = "float16", "float32"

    @T.prim_func
    def flash_fwd(Q: T.Tensor(shape, dtype), K: T.Tensor(shape, dtype), V: T.Tensor(shape, dtype),
                  Output: T.Tensor(shape, dtype)):
        with T.Kernel(T.ceildiv(seq_len, block_M), heads, batch, threads=128) as (bx, by, bz):
            Q_shared = T.alloc_shared((block_M, dim), dtype)
            K_shared = T.alloc_shared((block_N, dim), dtype)
            V_shared = T.alloc_shared((block_N, dim), dtype)
            acc_s = T.alloc_fragment((block_M, block_N), accum_dtype)
            acc_s_cast = T.alloc_fragment((block_M, block_N), dtype)
            acc_o = T.alloc_fragment((block_M, dim), accum_dtype)
            m_i = T.alloc_fragment((block_M,), accum_dtype)
            m_prev = T.alloc_fragment((block_M,), accum_dtype)
            rescale = T.alloc_fragment((block_M,), accum_dtype)
            row_sum = T.alloc_fragment((block_M,), accum_dtype)
            l_i = T.alloc_fragment((block_M,), accum_dtype)

            T.copy(Q[bz, bx * block_M:(bx + 1) * block_M, by, :], Q_shared)
            T.fill(acc_o, 0)
            T.fill(l_i, 0)
            T.fill(m_i, -T.infinity(accum_dtype))
            num_blocks = (T.min(T.ceildiv(seq_len, block_N), T.ceildiv((bx + 1) * block_M, block_N))
                          if is_causal else T.ceildiv(seq_len, block_N))
            for kb in T.Pipelined(num_blocks, num_stages=1):
                T.copy(K[bz, kb * block_N:(kb + 1) * block_N, by, :], K_shared)
                for i, j in T.Parallel(block_M, block_N):  # the mask as the accumulator's start
                    if is_causal:
                        acc_s[i, j] = T.if_then_else(bx * block_M + i >= kb * block_N + j, 0, -T.infinity(accum_dtype))
                    else:
                        acc_s[i, j] = T.if_then_else(kb * block_N + j >= seq_len, -T.infinity(accum_dtype), 0)
                T.gemm(Q_shared, K_shared, acc_s, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                T.copy(m_i, m_prev)
                T.reduce_max(acc_s, m_i, dim=1, clear=False)
                for i in T.Parallel(block_M):
                    rescale[i] = T.exp2(m_prev[i] * scale - m_i[i] * scale)
                for i, j in T.Parallel(block_M, block_N):
                    acc_s[i, j] = T.exp2(acc_s[i, j] * scale - m_i[i] * scale)
                T.reduce_sum(acc_s, row_sum, dim=1)
                for i in T.Parallel(block_M):
                    l_i[i] = l_i[i] * rescale[i] + row_sum[i]
                T.copy(acc_s, acc_s_cast)
                for i, j in T.Parallel(block_M, dim):
                    acc_o[i, j] *= rescale[i]
                T.copy(V[bz, kb * block_N:(kb + 1) * block_N, by, :], V_shared)
                T.gemm(acc_s_cast, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)
            for i, j in T.Parallel(block_M, dim):
                acc_o[i, j] /= l_i[i]
            T.copy(acc_o, Output[bz, bx * block_M:(bx + 1) * block_M, by, :])

    return flash_fwd


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("seq_len", [64, 40])  # a multiple of the blocks, and a ragged last block
def test_flash_attention_forward(is_causal, seq_len):
    batch, heads, dim = 2, 2, 32
    program = _flash_attention(batch, heads, seq_len, dim, is_causal, block_M=16, block_N=16)
    rng = _rng(11)
    q, k, v = (rng.standard_normal((batch, seq_len, heads, dim)).astype(np.float16) for _ in range(3))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    scores = np.einsum("bqhd,bkhd->bhqk", q64, k64) / math.sqrt(dim)
    if is_causal:
        scores = np.where(np.tril(np.ones((seq_len, seq_len), bool)), scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    expected = np.einsum("bhqk,bkhd->bqhd", weights / weights.sum(axis=-1, keepdims=True), v64)
    # the probabilities are cast to fp16 for the second GEMM, the output to fp16: two roundings
    assert_close(interpret(program, out_idx=[3])(q, k, v), expected, rel_l2=2 * UNIT_ROUNDOFF["float16"])


def _chunked_linear_attention(B_, S, H_, DK, DV, chunk_size, BV, decay):
    """A chunked (retention-style when `decay`: head h decays by 1 - 2^(-2 - h) per token) linear
    attention forward, one program per (block of values, batch x head), the state in a fragment."""
    T = _tilelang()
    scale = DK**-0.5
    dtype, accum_dtype = "float16", "float32"
    NT = T.ceildiv(S, chunk_size)

    @T.prim_func
    def chunk_fwd(Q: T.Tensor((B_, S, H_, DK), dtype), K: T.Tensor((B_, S, H_, DK), dtype),
                  V: T.Tensor((B_, S, H_, DV), dtype), O: T.Tensor((B_, S, H_, DV), dtype),
                  final_state: T.Tensor((B_, H_, DK, DV), accum_dtype)):
        with T.Kernel(DV // BV, B_ * H_) as (i_v, i_bh):
            i_b = i_bh // H_
            i_h = i_bh % H_
            log_decay = T.alloc_var(accum_dtype)
            log_decay = T.log2(1 - T.exp2(-2.0 - 1.0 * i_h)) if decay else 0.0
            q = T.alloc_shared((chunk_size, DK), dtype)
            k = T.alloc_shared((chunk_size, DK), dtype)
            v = T.alloc_shared((chunk_size, BV), dtype)
            h = T.alloc_fragment((DK, BV), accum_dtype)
            h_shared = T.alloc_shared((DK, BV), dtype)
            s = T.alloc_fragment((chunk_size, chunk_size), accum_dtype)
            s_shared = T.alloc_shared((chunk_size, chunk_size), dtype)
            o = T.alloc_fragment((chunk_size, BV), accum_dtype)
            T.clear(h)
            for i in T.Pipelined(0, NT):
                for row, col in T.Parallel(chunk_size, DK):
                    q[row, col] = Q[i_b, i * chunk_size + row, i_h, col] * scale
                T.copy(K[i_b, i * chunk_size:(i + 1) * chunk_size, i_h, :], k)
                T.copy(V[i_b, i * chunk_size:(i + 1) * chunk_size, i_h, i_v * BV:(i_v + 1) * BV], v)
                T.gemm(q, k, s, clear_accum=True, transpose_B=True)
                for row, col in T.Parallel(chunk_size, chunk_size):
                    s_shared[row, col] = T.if_then_else(row >= col, s[row, col] * T.exp2((row - col) * log_decay), 0)
                T.copy(h, h_shared)
                T.gemm(q, h_shared, o, clear_accum=True)
                for row, col in T.Parallel(chunk_size, BV):
                    o[row, col] = T.exp2((row + 1) * log_decay) * o[row, col]
                T.gemm(s_shared, v, o)
                T.copy(o, O[i_b, i * chunk_size:(i + 1) * chunk_size, i_h, i_v * BV:(i_v + 1) * BV])
                for row, col in T.Parallel(chunk_size, BV):
                    v[row, col] = v[row, col] * T.exp2((chunk_size - row - 1) * log_decay)
                for row, col in T.Parallel(DK, BV):
                    h[row, col] = T.exp2(chunk_size * log_decay) * h[row, col]
                T.gemm(k, v, h, transpose_A=True)
            T.copy(h, final_state[i_b, i_h, :, i_v * BV:(i_v + 1) * BV])

    return chunk_fwd


@pytest.mark.parametrize("decay", [False, True])
def test_chunked_linear_attention_forward(decay):
    B_, S, H_, DK, DV = 2, 64, 2, 32, 32
    program = _chunked_linear_attention(B_, S, H_, DK, DV, chunk_size=16, BV=16, decay=decay)
    rng = _rng(12)
    q, k = (rng.standard_normal((B_, S, H_, DK)) / math.sqrt(DK) for _ in range(2))
    v = rng.standard_normal((B_, S, H_, DV))
    q, k, v = (x.astype(np.float16) for x in (q, k, v))
    q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
    gammas = 1 - 2.0 ** (-2.0 - np.arange(H_)) if decay else np.ones(H_)
    expected_o, expected_state = np.zeros((B_, S, H_, DV)), np.zeros((B_, H_, DK, DV))
    for b in range(B_):
        for h in range(H_):
            state = np.zeros((DK, DV))  # S_t = gamma S_{t-1} + k_t v_t^T, o_t = scale q_t S_t
            for t in range(S):
                state = gammas[h] * state + np.outer(k64[b, t, h], v64[b, t, h])
                expected_o[b, t, h] = DK**-0.5 * q64[b, t, h] @ state
            expected_state[b, h] = state
    o, final_state = interpret(program, out_idx=[3, 4])(q, k, v)
    assert_close(o, expected_o, rel_l2=4 * UNIT_ROUNDOFF["float16"])
    assert_close(final_state, expected_state, rel_l2=4 * UNIT_ROUNDOFF["float16"], name="the final state",
                 axes=("batch", "head", "d_k", "d_v"))
