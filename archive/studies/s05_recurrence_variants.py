"""Variants of stage 5's recurrence kernel, to time against the committed one in one GPU run.

    python -m benchmarks.studies.s05_recurrence_variants --out DIR [--quick] [--variants a,b]

Each variant is a function with build_recurrence_program's parameters and outputs
(stages/s05_fast_kda/kernel.py is not touched). On a GPU the script runs the committed prepare
kernel once per shape, compiles each variant, checks its o and final state against the committed
recurrence's on the same inputs (rel L2), then times each recurrence alone (one launch captured as a
CUDA graph, median under triton.testing.do_bench; interleaved rounds) at the shapes of
benchmarks.studies.s05_variants. Writes DIR/recurrence_variants.csv and prints a table.

Where the time goes in the committed kernel: one program per (32 columns of d_v, batch x head), 128
programs at B=1 H=32 (one wave on the H200's 132 SMs), a producer warp group loading by TMA and one
consumer warp group walking the chunks. Per chunk the consumer issues four GEMMs and waits for each
before the next: V_new = U - W S^T, then Q e^gamma S^T, then A_qk V_new, then the state update; about
2,100 cycles a chunk (0.30 ms for 256 chunks at N=16384), mostly these four waits in a row. Only two
of the waits are needed: W S^T and Q e^gamma S^T read the same S^T and nothing else of each other,
and so do A_qk V_new and the state update with V_new.
"""

import argparse
import csv
import functools
import statistics
import sys
import time
import traceback
from pathlib import Path

from benchmarks.studies.s05_variants import QUICK_ROUNDS, QUICK_SHAPES, ROUNDS, SHAPES, compile_timed, graph_timer, rel_l2
from stages.s05_fast_kda.kernel import DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE

DTYPE = "bfloat16"
FIELDS = ["round", "B", "N", "H", "D", "variant", "recurrence_ms", "compile_s", "rel_l2_o", "rel_l2_final_state",
          "error"]


def _build(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=DEFAULT_BLOCK_DV, dtype="float16",
           num_stages=2, threads=128, *, paired_gemms=False, staged_o=False):
    """build_recurrence_program with switches; all off is the committed kernel, statement for statement.

    paired_gemms: the two GEMMs that read S^T issued together (T.wgmma_gemm, no wait between them)
        and waited for once, and the two that read V_new likewise: two waits a chunk instead of four.
        Each pair and its wait sit in a one-trip loop, so that the pipeline planner sees one statement
        and releases the pair's operand buffers to the producer only after the wait.
    staged_o: o written to shared memory first, then stored by TMA in whole rows (the committed
        kernel stores it from the MMA fragment: 4-byte stores spread over 8 rows).
    """
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    num_chunks = N // C

    @T.prim_func
    def kda_recurrence(
        W: T.Tensor((B, N, H, d_k), dtype),
        U: T.Tensor((B, N, H, d_v), dtype),
        Q_decayed: T.Tensor((B, N, H, d_k), dtype),
        K_to_chunk_end: T.Tensor((B, N, H, d_k), dtype),
        A_qk: T.Tensor((B, N, H, C), dtype),
        Chunk_decay: T.Tensor((B, num_chunks, H, d_k), accum_dtype),
        Initial_state: T.Tensor((B, H, d_k, d_v), accum_dtype),
        O: T.Tensor((B, N, H, d_v), dtype),
        Final_state: T.Tensor((B, H, d_k, d_v), accum_dtype),
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv

            W_s = T.alloc_shared((C, d_k), dtype)
            U_s = T.alloc_shared((C, block_dv), dtype)
            Q_decayed_s = T.alloc_shared((C, d_k), dtype)
            K_to_chunk_end_s = T.alloc_shared((C, d_k), dtype)
            A_qk_s = T.alloc_shared((C, C), dtype)
            chunk_decay_s = T.alloc_shared((d_k,), accum_dtype)
            S_s = T.alloc_shared((d_k, block_dv), dtype)
            V_new_s = T.alloc_shared((C, block_dv), dtype)
            O_s = T.alloc_shared((C, block_dv), dtype)

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)
            V_new_f = T.alloc_fragment((C, block_dv), accum_dtype)
            acc_o = T.alloc_fragment((C, block_dv), accum_dtype)

            T.copy(Initial_state[b, h, :, v0:v0 + block_dv], S_f)
            for i_c in T.Pipelined(num_chunks, num_stages=num_stages):
                t0 = i_c * C
                T.copy(W[b, t0:t0 + C, h, :], W_s)
                T.copy(U[b, t0:t0 + C, h, v0:v0 + block_dv], U_s)
                T.copy(Q_decayed[b, t0:t0 + C, h, :], Q_decayed_s)
                T.copy(K_to_chunk_end[b, t0:t0 + C, h, :], K_to_chunk_end_s)
                T.copy(A_qk[b, t0:t0 + C, h, :], A_qk_s)
                T.copy(Chunk_decay[b, i_c, h, :], chunk_decay_s)

                T.copy(S_f, S_s)
                if paired_gemms:
                    for _ in T.serial(1):
                        T.wgmma_gemm(W_s, S_s, V_new_f, clear_accum=True)
                        T.wgmma_gemm(Q_decayed_s, S_s, acc_o, clear_accum=True)
                        T.wait_wgmma(0)
                    for r, j in T.Parallel(C, block_dv):
                        V_new_f[r, j] = U_s[r, j] - V_new_f[r, j]
                    T.copy(V_new_f, V_new_s)
                    for d, j in T.Parallel(d_k, block_dv):
                        S_f[d, j] *= chunk_decay_s[d]
                    for _ in T.serial(1):
                        T.wgmma_gemm(K_to_chunk_end_s, V_new_s, S_f, transpose_A=True)
                        T.wgmma_gemm(A_qk_s, V_new_s, acc_o)
                        T.wait_wgmma(0)
                else:
                    T.gemm(W_s, S_s, V_new_f, clear_accum=True)
                    for r, j in T.Parallel(C, block_dv):
                        V_new_f[r, j] = U_s[r, j] - V_new_f[r, j]
                    T.copy(V_new_f, V_new_s)
                    T.gemm(Q_decayed_s, S_s, acc_o, clear_accum=True)
                    T.gemm(A_qk_s, V_new_s, acc_o)
                if staged_o:
                    T.copy(acc_o, O_s)
                    T.copy(O_s, O[b, t0:t0 + C, h, v0:v0 + block_dv])
                else:
                    T.copy(acc_o, O[b, t0:t0 + C, h, v0:v0 + block_dv])
                if not paired_gemms:
                    for d, j in T.Parallel(d_k, block_dv):
                        S_f[d, j] *= chunk_decay_s[d]
                    T.gemm(K_to_chunk_end_s, V_new_s, S_f, transpose_A=True)
            T.copy(S_f, Final_state[b, h, :, v0:v0 + block_dv])

    return kda_recurrence


def committed(*args, **kwargs):
    """The committed kernel rebuilt here with every switch off: the control."""
    return _build(*args, **kwargs)


def paired(*args, **kwargs):
    """Two waits a chunk: (W S^T, Q e^gamma S^T) together, then (K^T V_new, A_qk V_new) together."""
    return _build(*args, paired_gemms=True, **kwargs)


def paired_staged_o(*args, **kwargs):
    """paired, and o staged in shared memory for a TMA store of whole rows."""
    return _build(*args, paired_gemms=True, staged_o=True, **kwargs)


def staged_o(*args, **kwargs):
    """o staged in shared memory for a TMA store of whole rows; the GEMMs as committed."""
    return _build(*args, staged_o=True, **kwargs)


VARIANTS = {"committed": committed, "paired": paired, "paired_staged_o": paired_staged_o, "staged_o": staged_o}
BLOCK_DVS = (32, 64)  # each variant is also built with 64 columns a program: half the programs, half the re-reads


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for recurrence_variants.csv")
    parser.add_argument("--quick", action="store_true", help="one shape, fewer rounds")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names: " + ", ".join(VARIANTS))
    args = parser.parse_args(argv)
    args.variants = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in args.variants if name not in VARIANTS]
    if unknown or not args.variants:
        parser.error(f"unknown variant(s) {unknown}; known: {', '.join(VARIANTS)}")
    args.shapes = QUICK_SHAPES if args.quick else SHAPES
    args.rounds = QUICK_ROUNDS if args.quick else ROUNDS
    return args


def _label(name, block_dv):
    return name if block_dv == DEFAULT_BLOCK_DV else f"{name}_dv{block_dv}"


def _compile_all(names, shapes, log):
    """Every (variant, block_dv, shape) compiled in threads: {key: (kernel, seconds) or the failure's text}."""
    return compile_timed({(name, block_dv, shape): functools.partial(VARIANTS[name], *shape, shape[3], DEFAULT_CHUNK_SIZE,
                                                                     block_dv, DTYPE)
                          for shape in shapes for name in names for block_dv in BLOCK_DVS}, [7, 8], log)


def run(args, log):
    import torch

    from benchmarks import bench
    from stages.s05_fast_kda import kernel

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timer = graph_timer(args.quick)
    compiled = _compile_all(args.variants, args.shapes, log)
    labels = [(name, block_dv) for name in args.variants for block_dv in BLOCK_DVS]
    rows = []
    for shape in args.shapes:
        B, N, H, D = shape
        inputs = bench.make_inputs(bench.STAGES["s05"], B, N, H, D, torch.bfloat16)
        prepare = kernel.compiled_prepare(B, N, H, D, D, DEFAULT_CHUNK_SIZE, DTYPE, None)
        prepared = prepare(*inputs)
        state = torch.randn(B, H, D, D, dtype=torch.float32, device="cuda") * 0.1
        control = kernel.compiled_recurrence(B, N, H, D, D, DEFAULT_CHUNK_SIZE, DEFAULT_BLOCK_DV, DTYPE, 2, 128)
        expected_o, expected_state = (t.clone() for t in control(*prepared, state))
        checked = {}
        for name, block_dv in labels:
            result = compiled[(name, block_dv, shape)]
            row = dict(B=B, N=N, H=H, D=D, variant=_label(name, block_dv))
            if isinstance(result, str):
                checked[(name, block_dv)] = dict(row, error=f"compile: {result}")
                continue
            row["compile_s"] = f"{result[1]:.1f}"
            try:
                o, final_state = result[0](*prepared, state)
                row["rel_l2_o"] = f"{rel_l2(o, expected_o):.3e}"
                row["rel_l2_final_state"] = f"{rel_l2(final_state, expected_state):.3e}"
            except Exception as failure:  # noqa: BLE001 - recorded, the run goes on
                traceback.print_exc()
                row["error"] = f"run: {type(failure).__name__}: {str(failure)[:300]}"
            checked[(name, block_dv)] = row
            log(f"{shape} {row['variant']}: rel L2 o {row.get('rel_l2_o')}, state {row.get('rel_l2_final_state')}")
        for round_number in range(1, args.rounds + 1):
            order = labels if round_number % 2 else labels[::-1]
            for key in order:
                row = dict(checked[key], round=round_number)
                if "error" not in row:
                    recurrence = compiled[(key[0], key[1], shape)][0]
                    row["recurrence_ms"] = f"{timer(functools.partial(recurrence, *prepared, state)):.4f}"
                rows.append(row)
                log(f"round {round_number} {shape} {row['variant']}: {row.get('recurrence_ms', row.get('error'))}")
            with open(out / "recurrence_variants.csv", "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(rows)
        inputs = prepared = expected_o = expected_state = None
        torch.cuda.empty_cache()
    print_table(rows, log)
    return rows


def print_table(rows, log=print):
    """Per shape and variant: the median time, its gain over the committed kernel, the error."""
    table = {}
    for row in rows:
        shape = tuple(int(row[k]) for k in ("B", "N", "H", "D"))
        table.setdefault(shape, {}).setdefault(row["variant"], []).append(row)
    for shape, variants in table.items():
        times = {name: statistics.median(float(r["recurrence_ms"]) for r in named)
                 for name, named in variants.items() if all(r.get("recurrence_ms") for r in named)}
        log(f"B={shape[0]} N={shape[1]} H={shape[2]} D={shape[3]}: variant, recurrence ms, gain, rel L2 o")
        for name, named in variants.items():
            ms = times.get(name)
            gain = f"{times['committed'] / ms:.3f}x" if ms and "committed" in times else "-"
            log(f"  {name:24s} {ms if ms is not None else '-':>8} {gain:>8} {named[0].get('rel_l2_o', '-')} "
                f"{named[0].get('error', '')}")


def main(argv=None):
    args = parse_args(argv)
    started = time.time()

    def log(message):
        print(f"[{time.time() - started:6.1f} s] {message}", flush=True)

    run(args, log)


if __name__ == "__main__":
    sys.exit(main())
