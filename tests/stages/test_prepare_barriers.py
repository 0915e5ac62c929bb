"""The prepare kernel's gates are stored by every warp before any thread reads another's: a full barrier
(`__syncthreads()`) between the last store into gamma_s and the first reads of it across threads, the
value checks (`Flags[...] = 1`) and the cumulative sum. TileLang 0.1.15 synced beta's in-place sigmoid
on the rows of a short chunk with a barrier of the 64 threads that run it and took it for the whole
block's, so the sum read gates other warps had not yet stored (stages/kda/tiles.py, "Barriers TileLang
leaves out"; compute-sanitizer's racecheck found it on an H100, in the prepare that trains a packed batch
of Kimi Linear's layer). Read from the CUDA source TileLang generates, so these tests run on any
machine."""

import pytest

pytest.importorskip("tilelang")

C, D = 64, 64  # a chunk of 64 on 256 threads, as Kimi Linear's calls run it; d = 64 keeps the lowering short
SUM = "running = (running + "


def forms():
    """The plain form; the packed training's (the gate made in front, the norms and beta's sigmoid in the
    kernel: its gate is a log gate); Kimi Linear's (the bounded gate made in the kernel too)."""
    from stages.kda.inputs import InputForm

    return {"plain": InputForm(),
            "norms_and_sigmoid": InputForm(l2_normalize=True, beta="sigmoid", scale=D ** -0.5),
            "kimi": InputForm(gate="sigmoid", lower_bound=-5.0, l2_normalize=True, beta="sigmoid", scale=D ** -0.5)}


def gate_reads_without_a_barrier(source):
    """The first line of a prepare program's CUDA source that reads the gates across threads (a value
    check or the cumulative sum) when no `__syncthreads();` stands between it and the last store into
    gamma_s before it; None when one does."""
    lines = source.splitlines()

    def stores_gates(line):
        return " = " in line and "gamma_s" in line.split(" = ")[0]

    def reads_across_threads(line):
        return SUM in line or (line.lstrip().startswith("if (") and "gamma_s" in line)

    first = next(i for i, line in enumerate(lines) if reads_across_threads(line))
    last_store = max(i for i in range(first) if stores_gates(lines[i]))
    if any(line.strip() == "__syncthreads();" for line in lines[last_store + 1:first]):
        return None
    return lines[first].strip()


def prepare_source(form, value_flags, layout):
    """A dense batch of 3 chunks, the last 5 tokens short ("short": its rows read masked), or a packed
    batch of two sequences ("packed")."""
    from stages.common.tilelang_tools import lower_kernel
    from stages.kda.prepare import PackedBatch, build_prepare_program

    rows = {"short": dict(tokens=3 * C - 5), "packed": dict(packed=PackedBatch(tokens=3 * C - 5, chunks=3,
                                                                                sequences=2))}[layout]
    program = build_prepare_program(1, 3 * C, 2, D, D, chunk_size=C, dtype="bfloat16", value_flags=value_flags,
                                    form=forms()[form], **rows)
    return lower_kernel(program).cuda_source


@pytest.mark.parametrize("form, value_flags, layout", [
    ("plain", False, "short"), ("norms_and_sigmoid", False, "short"), ("norms_and_sigmoid", True, "short"),
    ("norms_and_sigmoid", False, "packed"), ("kimi", False, "short")])
def test_every_warp_stores_its_gates_before_they_are_read_across_threads(form, value_flags, layout):
    source = prepare_source(form, value_flags, layout)
    assert SUM in source  # the rule below reads the program it is meant for
    assert gate_reads_without_a_barrier(source) is None


def test_the_rule_finds_a_read_with_no_barrier_since_the_store():
    """The source as TileLang 0.1.15 generated it before the prepare's own barrier, in miniature: the
    gates stored, beta's barrier of 64 threads, then the sum; and with a full barrier before the sum."""
    racy = """
  *(float4*)(((float*)gamma_s) + ((i_1 * 1024) + (((int)threadIdx.x) * 4))) = condval_2;
  if (((int)threadIdx.x) < 64) {
    tl::__sync_thread_partial(3, 64);
  }
  if (((int)threadIdx.x) < 128) {
      running = (running + ((float*)gamma_s)[((r * 128) + ((int)threadIdx.x))]);
      ((float*)gamma_s)[((r * 128) + ((int)threadIdx.x))] = running;
  }"""
    assert gate_reads_without_a_barrier(racy).startswith(SUM)
    synced = racy.replace("  if (((int)threadIdx.x) < 128) {", "  __syncthreads();\n  if (((int)threadIdx.x) < 128) {")
    assert gate_reads_without_a_barrier(synced) is None
