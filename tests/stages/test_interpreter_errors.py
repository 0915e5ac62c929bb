"""The tile interpreter's errors that teach: each mistake a kernel writer makes, in a small broken
program, stops the run with a message that names the writer's file and line, says what went wrong in
the GPU's terms, and names the section of the interpreter page (docs/interpreter.md, "Errors it
names") to read. The programs are written in this file, so the messages name this file's lines."""

import numpy as np
import pytest

from stages.common.interpreter import (CrossLaneRead, InterpreterError, LaneRace, OutOfRange, ReadBeforeWrite,
                                       TileShapeMismatch, interpret)

HERE = "tests/stages/test_interpreter_errors.py"


def _tilelang():
    import tilelang.language as T

    return T


def _where(statement):
    """'tests/stages/test_interpreter_errors.py, line N: `statement`': how a message names the one line of this
    file that holds `statement`."""
    numbers = [n for n, line in enumerate(open(__file__).read().splitlines(), 1) if line.strip() == statement]
    assert len(numbers) == 1, f"{statement!r} is on lines {numbers}"
    return f"{HERE}, line {numbers[0]}: `{statement}`"


def _interpreter_page_sections():
    """The headings of docs/interpreter.md's "Errors it names" section."""
    from kdacourse import REPO_ROOT

    text = (REPO_ROOT / "docs" / "interpreter.md").read_text(encoding="utf-8")
    errors = text.split("## Errors it names", 1)[1].split("\n## ", 1)[0]
    return [line[4:].strip() for line in errors.splitlines() if line.startswith("### ")]


def _assert_teaches(error, statement, section):
    message = str(error.value)
    assert message.startswith(_where(statement) + ": "), message
    assert f'read the interpreter page, "{section}"' in message, message
    assert section in _interpreter_page_sections(), f"docs/interpreter.md has no section {section!r}"


def test_a_copy_between_tiles_of_different_shapes():
    T = _tilelang()

    @T.prim_func
    def wrong_tile(A: T.Tensor((16, 16), "float16"), O: T.Tensor((16, 16), "float16")):
        with T.Kernel(1, threads=128) as _bx:
            tile = T.alloc_shared((16, 8), "float16")
            T.copy(A[0:16, 0:16], tile)
            T.copy(tile, O[0:16, 0:8])

    with pytest.raises(TileShapeMismatch) as error:
        interpret(wrong_tile, out_idx=[1])
    _assert_teaches(error, "T.copy(A[0:16, 0:16], tile)", "A tile of the wrong shape")
    assert "[16, 16] (A) into [16, 8] (tile)" in str(error.value)


def test_a_gemm_whose_operand_is_not_the_shape_it_needs():
    """TileLang checks a T.gemm's shapes when it builds the program: the course's tests (kernel_checks.build)
    turn its assertion into the same kind of message, through build_error_message."""
    from stages.common.tilelang_tools import build_error_message

    def build_program():
        T = _tilelang()

        @T.prim_func
        def wrong_operand(A: T.Tensor((16, 32), "float16"), B: T.Tensor((32, 16), "float16"),
                          O: T.Tensor((16, 16), "float32")):
            with T.Kernel(1, threads=128) as _bx:
                A_s = T.alloc_shared((16, 32), "float16")
                B_s = T.alloc_shared((32, 16), "float16")
                C_f = T.alloc_fragment((16, 16), "float32")
                T.copy(A, A_s)
                T.copy(B, B_s)
                T.gemm(A_s, B_s[0:16, :], C_f, clear_accum=True)
                T.copy(C_f, O)

        return wrong_operand

    with pytest.raises(AssertionError) as error:
        build_program()
    message = build_error_message(error.value, build_program)
    assert message.startswith("the program does not build: " + _where("T.gemm(A_s, B_s[0:16, :], C_f, clear_accum=True)"))
    assert "A gives K = 32, B gives K = 16" in message
    assert f'read the interpreter page, "{TileShapeMismatch.section}"' in message


def test_a_store_out_of_range():
    T = _tilelang()

    @T.prim_func
    def past_the_end(A: T.Tensor((8, 8), "float32"), O: T.Tensor((8, 8), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            for i, j in T.Parallel(8, 8):
                O[i, j + 1] = A[i, j]

    with pytest.raises(OutOfRange) as error:
        interpret(past_the_end, out_idx=[1])(np.ones((8, 8), np.float32))
    _assert_teaches(error, "O[i, j + 1] = A[i, j]", "A store or load out of range")
    assert "O: index 8 is outside axis 1 of size 8" in str(error.value)


def test_a_shared_buffer_used_before_its_copy():
    T = _tilelang()

    @T.prim_func
    def before_copy(A: T.Tensor((16, 16), "float16"), O: T.Tensor((16, 16), "float16")):
        with T.Kernel(1, threads=128) as _bx:
            A_s = T.alloc_shared((16, 16), "float16")
            doubled = T.alloc_fragment((16, 16), "float16")
            for i, j in T.Parallel(16, 16):
                doubled[i, j] = A_s[i, j] * 2
            T.copy(A, A_s)
            T.copy(doubled, O)

    with pytest.raises(ReadBeforeWrite) as error:
        interpret(before_copy, out_idx=[1])(np.ones((16, 16), np.float16))
    _assert_teaches(error, "doubled[i, j] = A_s[i, j] * 2", "A buffer read before it is written")


def test_a_variable_read_before_it_is_written():
    """A running sum per column in a T.alloc_var: without its first value, the first `+=` reads a
    register nothing wrote (TileLang lowers the variable without a value); given one (a first store,
    or init=0) it runs. A variable that only some lanes wrote is unwritten in the others."""
    T = _tilelang()
    R, D = 4, 8

    def program(first_value):
        @T.prim_func
        def column_sums(A: T.Tensor((R, D), "float32"), O: T.Tensor((R, D), "float32")):
            with T.Kernel(1, threads=128) as _bx:
                for d in T.Parallel(D):
                    if first_value == "init":
                        running = T.alloc_var("float32", init=0)
                    else:
                        running = T.alloc_var("float32")
                    if first_value == "store":
                        running = 0
                    for r in T.serial(R):
                        running += A[r, d]
                        O[r, d] = running

        return column_sums

    @T.prim_func
    def some_lanes(A: T.Tensor((D,), "float32"), O: T.Tensor((D,), "float32")):
        with T.Kernel(1, threads=128) as _bx:
            for d in T.Parallel(D):
                kept = T.alloc_var("float32")
                if d < 2:
                    kept = A[d]
                O[d] = kept * 2

    a = np.arange(R * D, dtype=np.float32).reshape(R, D)
    for first_value in ("store", "init"):
        assert np.array_equal(interpret(program(first_value), out_idx=[1])(a), np.cumsum(a, axis=0))
    with pytest.raises(ReadBeforeWrite) as error:
        interpret(program(None), out_idx=[1])(a)
    _assert_teaches(error, "running += A[r, d]", "A buffer read before it is written")
    assert "reads `running` before writing it: the variable running (a T.alloc_var, declared at line" in str(error.value)
    with pytest.raises(ReadBeforeWrite) as error:
        interpret(some_lanes, out_idx=[1])(a[0])
    _assert_teaches(error, "O[d] = kept * 2", "A buffer read before it is written")


def test_a_fragment_read_across_lanes():
    """Lane i reads the element lane i + 1 wrote in the same T.Parallel loop: in the interpreter the
    whole statement runs before the next, on the GPU that element is in another thread's registers."""
    T = _tilelang()

    @T.prim_func
    def neighbour(A: T.Tensor((16,), "float32"), O: T.Tensor((16,), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            squared = T.alloc_fragment((16,), "float32")
            for i in T.Parallel(16):
                squared[i] = A[i] * A[i]
                O[i] = squared[(i + 1) % 16] - squared[i]

    with pytest.raises(CrossLaneRead) as error:
        interpret(neighbour, out_idx=[1])(np.arange(16, dtype=np.float32))
    _assert_teaches(error, "O[i] = squared[(i + 1) % 16] - squared[i]", "A value read across lanes")
    assert "the lane i = 0 reads squared[1], which the lane i = 1 wrote" in str(error.value)


def test_a_race_between_lanes():
    """Two lanes write one shared element in one T.Parallel loop, by two statements: no barrier between."""
    T = _tilelang()

    @T.prim_func
    def two_writers(A: T.Tensor((16,), "float32"), O: T.Tensor((16,), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            row_s = T.alloc_shared((16,), "float32")
            for i in T.Parallel(16):
                row_s[i] = A[i]
                row_s[15 - i] = A[i] * 2
            T.copy(row_s, O)

    with pytest.raises(LaneRace) as error:
        interpret(two_writers, out_idx=[1])(np.arange(16, dtype=np.float32))
    _assert_teaches(error, "row_s[15 - i] = A[i] * 2", "A race between lanes")


def test_one_statement_storing_different_values_into_one_element_is_a_race():
    T = _tilelang()

    @T.prim_func
    def many_to_one(A: T.Tensor((8, 4), "float32"), O: T.Tensor((8,), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            row = T.alloc_fragment((8,), "float32")
            for i, j in T.Parallel(8, 4):
                row[i] = A[i, j]
            T.copy(row, O)

    with pytest.raises(LaneRace) as error:
        interpret(many_to_one, out_idx=[1])(np.ones((8, 4), np.float32) * np.arange(4))
    _assert_teaches(error, "row[i] = A[i, j]", "A race between lanes")


def test_what_a_lane_writes_and_reads_itself_is_no_error():
    """The patterns of the course's kernels: a lane reads back its own element in the same loop, lanes
    along an axis the store leaves out store one value (a replicated fragment), and a later loop reads
    any lane's element (TileLang puts a barrier or a layout between loops)."""
    T = _tilelang()

    @T.prim_func
    def fine(A: T.Tensor((8, 4), "float32"), O: T.Tensor((8, 4), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            row = T.alloc_fragment((8,), "float32")
            tile = T.alloc_fragment((8, 4), "float32")
            for i, j in T.Parallel(8, 4):
                row[i] = A[i, 0] * 2
                tile[i, j] = A[i, j] + row[i]
                tile[i, j] = tile[i, j] * 2
            for i, j in T.Parallel(8, 4):
                O[i, j] = tile[7 - i, j] + row[i]

    a = np.arange(32, dtype=np.float32).reshape(8, 4)
    expected = 2 * (a + 2 * a[:, :1])
    assert np.array_equal(interpret(fine, out_idx=[1])(a), expected[::-1] + 2 * a[:, :1])


def test_every_kind_is_an_interpreter_error():
    for kind in (TileShapeMismatch, OutOfRange, CrossLaneRead, LaneRace):
        assert InterpreterError in kind.__bases__  # a direct subclass: the grader's sandbox relays these by name


def test_an_output_element_never_stored_is_named_as_such():
    """A T.copy out of range drops the store (as on the GPU): the output keeps the NaN the interpreter
    allocates it with, and the comparison says "never written", not an overflow, where a NaN the
    program computed is not taken for one."""
    T = _tilelang()
    from stages.common.compare import assert_close
    from stages.common.interpreter import never_written

    @T.prim_func
    def half_stored(A: T.Tensor((8, 8), "float32"), O: T.Tensor((8, 8), "float32")):
        with T.Kernel(1, threads=32) as _bx:
            tile = T.alloc_fragment((4, 8), "float32")
            for i, j in T.Parallel(4, 8):
                tile[i, j] = A[i, j] * A[i, j]
            T.copy(tile, O[0:4, :])

    a = np.ones((8, 8), np.float32)
    a[0, 0] = np.nan  # a NaN the program computes from its input: not "never written"
    o = interpret(half_stored, out_idx=[1])(a)
    assert never_written(o)[4:].all() and not never_written(o)[:4].any()
    with pytest.raises(AssertionError, match="32 of them were never written by the program, the first at"):
        assert_close(o, np.ones((8, 8)), rel_l2=1e-6, axes=("row", "column"))
    o[4:] = 1.0
    with pytest.raises(AssertionError) as computed:
        assert_close(o, np.ones((8, 8)), rel_l2=1e-6, axes=("row", "column"))
    assert "never written" not in str(computed.value)


def test_entries_never_written_give_no_hint_about_chunks():
    """"chunk 0 is right, later chunks wrong" is a hint about arithmetic; entries the program never
    stored hold the interpreter's unwritten NaN whatever the chunk (the trial's store at the wrong
    columns read "one chunk only: the error is inside the chunk")."""
    from stages.common.compare import assert_close
    from stages.common.interpreter import UNWRITTEN_BITS

    actual = np.ones((1, 8, 1, 2))
    actual[0, :4, 0, 1] = np.array(UNWRITTEN_BITS[np.dtype(np.float64)]).view(np.float64)
    with pytest.raises(AssertionError) as error:
        assert_close(actual, np.ones((1, 8, 1, 2)), rel_l2=1e-6, chunk_size=4)
    message = str(error.value)
    assert "4 of them were never written by the program" in message and "chunk 0 is wrong" not in message
    actual[0, :4, 0, 1] = 2.0  # wrong values in chunk 0 alone: the hint is back
    with pytest.raises(AssertionError, match="chunk 0 is wrong"):
        assert_close(actual, np.ones((1, 8, 1, 2)), rel_l2=1e-6, chunk_size=4)
