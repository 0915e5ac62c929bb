"""Digests of the TIR that every library kernel program of stages 1-7 builds, to show that a refactor
of the kernels' source (a shared `@T.macro`, code moved between modules) leaves the programs as they
were.

Each case builds one program at a shape the tests use (the exercises' TIR-equality shape, the
interpreter's small shapes, the compile reports' shapes; every dtype the kernels take, and float64
for the interpreter), prints it as TVMScript (`program.script()`, the TIR as TileLang parses it,
before lowering: what the interpreter runs and what the lowering starts from) under one function
name, and hashes the text.

    python scripts/kernel_tir_digests.py --write     # record tests/kernel_tir_digests.json
    python scripts/kernel_tir_digests.py             # compare with it: exit 1 and the cases that differ

A case whose text differs only in the names TileLang gives to variables would show under
`--normalized` (names replaced by their order of first appearance); the cases are compared as they
are by default.
"""

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DIGESTS = ROOT / "tests" / "kernel_tir_digests.json"
DTYPES = ("float16", "bfloat16", "float64")


def _cases():
    """{case name: a function that builds its program}."""
    from stages.s01_linear_attention import kernel as s01
    from stages.s02_scalar_decay import kernel as s02
    from stages.s03_gated_deltanet import kernel as s03
    from stages.s04_kda import kernel as s04
    from stages.kda import backward as s06
    from stages.kda.decode import build_decode_program
    from stages.kda.prepare import PackedBatch, build_prepare_program
    from stages.kda.recurrence import build_recurrence_program

    cases = {}

    def add(name, build, *arguments, **options):
        cases[name] = lambda: build(*arguments, **options)

    exercise_shape = (1, 128, 2, 64, 64)  # tests/course/test_kernel_exercises.py
    for dtype in DTYPES:
        for stage, module in (("s01", s01), ("s02", s02), ("s03", s03), ("s04", s04)):
            add(f"{stage}.program/{dtype}/exercise", module.build_program, *exercise_shape, chunk_size=64, dtype=dtype)
            add(f"{stage}.program/{dtype}/interpreter", module.build_program, 1, 64, 2, 32, 32, 16, 16, dtype=dtype)
            add(f"{stage}.program/{dtype}/report", module.build_program, 1, 4096, 8, 128, 128, dtype=dtype)
        add(f"s05.prepare/{dtype}/exercise", build_prepare_program, *exercise_shape, 64, dtype)
        add(f"s05.prepare/{dtype}/c32", build_prepare_program, 1, 96, 2, 32, 32, 32, dtype)
        add(f"s05.prepare/{dtype}/report", build_prepare_program, 1, 4096, 8, 128, 128, 64, dtype)
        add(f"s05.prepare/{dtype}/report/value_flags", build_prepare_program, 1, 4096, 8, 128, 128, 64, dtype,
            value_flags=True)
        add(f"s05.recurrence/{dtype}/exercise", build_recurrence_program, *exercise_shape, 64, 32, dtype)
        add(f"s05.recurrence/{dtype}/c32", build_recurrence_program, 1, 96, 2, 32, 32, 32, 16, dtype)
        add(f"s05.recurrence/{dtype}/report", build_recurrence_program, 1, 4096, 8, 128, 128, 64, 64, dtype)
        for kernel, (build, _) in s06.BUILDERS.items():
            for shape_name, shape, block_dv in (("exercise", (*exercise_shape, 64), 32), ("c32", (1, 96, 2, 32, 32, 32), 16),
                                                ("report", (1, 4096, 8, 128, 128, 64), 32)):
                arguments = (*shape, *((block_dv,) if kernel in s06.WITH_BLOCK_DV else ()), dtype)
                add(f"s06.{kernel}/{dtype}/{shape_name}", build, *arguments)
        add(f"s06.intra/{dtype}/256threads", s06.build_intra_program, 1, 4096, 8, 128, 128, 64, dtype, threads=256)
        # stage 7: the packed kernels at fixed sizes (the interpreter's) and at run-time sizes (the GPU's)
        fixed = PackedBatch(tokens=262, chunks=11, sequences=6)
        add(f"s07.varlen_prepare/{dtype}/fixed", build_prepare_program, 1, 352, 2, 32, 32, 32, dtype, packed=fixed)
        add(f"s07.varlen_recurrence/{dtype}/fixed", build_recurrence_program, 1, 352, 2, 32, 32, 32, 16, dtype,
            packed=fixed)
        for flags in (False, True):
            add(f"s07.varlen_prepare/{dtype}/dynamic" + ("/value_flags" if flags else ""), packed_program,
                build_prepare_program, 32, 128, 128, 64, dtype, value_flags=flags)
        add(f"s07.varlen_recurrence/{dtype}/dynamic", packed_program, build_recurrence_program, 32, 128, 128, 64, 64,
            dtype)
        add(f"s07.decode/{dtype}", build_decode_program, 4, 8, 2, 32, 32, 16, dtype=dtype,
            state_dtype="float64" if dtype == "float64" else "float32")
        add(f"s07.decode/{dtype}/report", build_decode_program, 64, 256, 32, 128, 128, dtype=dtype)
        add(f"s07.decode/{dtype}/report/no_value_flags", build_decode_program, 64, 256, 32, 128, 128, dtype=dtype,
            value_flags=False)
    for layout in _s04_layouts(s04):
        name = ",".join(place for _, place in layout)
        add(f"s04.program/float16/layout={name}", s04.build_program, 1, 4096, 8, 128, 128, layout=layout)
    return cases


def packed_program(build, H, d_k, d_v, *sizes, **options):
    """A packed-batch program (prepare or recurrence) at run-time sizes, as prefill compiles it."""
    from stages.kda.compiled import packed_sizes

    rows, packed = packed_sizes()
    return build(1, rows, H, d_k, d_v, *sizes, packed=packed, **options)


def _s04_layouts(s04):
    """Every placement of stage 4's three buffers (the page's register table compiles them all)."""
    import itertools

    names = [name for name, _ in s04.DEFAULT_LAYOUT]
    return [tuple(zip(names, places)) for places in itertools.product(("registers", "shared"), repeat=len(names))]


def tir_text(program):
    return program.with_attr("global_symbol", "kernel").script()


def normalized(text):
    """`text` with every identifier that TileLang may name differently (v_1, i_2, ...) replaced by
    its order of first appearance."""
    names = {}
    return re.sub(r"\b[A-Za-z_][A-Za-z_0-9]*_\d+\b", lambda m: names.setdefault(m.group(0), f"name{len(names)}"), text)


def digests(normalize=False, only=None):
    found = {}
    for name, build in _cases().items():
        if only and not re.search(only, name):
            continue
        text = tir_text(build())
        found[name] = hashlib.sha256((normalized(text) if normalize else text).encode()).hexdigest()[:16]
        print(f"{name}: {found[name]}", file=sys.stderr, flush=True)
    return found


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="record the digests in tests/kernel_tir_digests.json")
    parser.add_argument("--normalized", action="store_true", help="compare the texts with variable names normalized")
    parser.add_argument("--only", help="a regular expression: the cases whose names match")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    key = "normalized" if args.normalized else "exact"
    found = digests(args.normalized, args.only)
    recorded = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
    if args.write:
        recorded[key] = dict(sorted({**recorded.get(key, {}), **found}.items()))
        DIGESTS.write_text(json.dumps(recorded, indent=1) + "\n")
        print(f"wrote {len(found)} digests ({key}) into {DIGESTS.relative_to(ROOT)}")
        return 0
    expected = recorded.get(key, {})
    differ = [name for name in found if expected.get(name) != found[name]]
    for name in differ:
        print(f"DIFFERS: {name}: recorded {expected.get(name)}, now {found[name]}")
    print(f"{len(found) - len(differ)} of {len(found)} programs build the recorded TIR ({key})")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
