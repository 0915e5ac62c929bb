"""Compile on this machine, for the GPU, the course's programs that the drop-in's GPU tests build
(tests/kernels/test_drop_in_gpu.py), into TileLang's cache, as scripts/precompile_kimi_call.py does for
the Kimi call (CONTRIBUTING.md, "Sparing the GPU's time"), by the GPU check's drop-in parts:

    TILELANG_CACHE_DIR=.tlcache_drop_in python -m tests.kernels.precompile_drop_in [--parts grid,packed,layer]

grid: FLA's test_chunk grid with autograd (tests-drop-in-grid); packed: packed training with autograd
and packed and dense inference (tests-drop-in-packed); layer: fused_recurrent_kda in bf16 and fp32, the
pooled decode, and the calls FLA's KimiDeltaAttention makes of the backend (tests-drop-in-layer). Parts
named together run one after another; parts run in processes of their own (one a core) share the cache.

The course's calls of each test are made on CPU zeros shaped as the test's, CUDA faked, each program
compiled and not run (stages.kda.on_cpu.compiled_only); FLA's own calls are left to the GPU. It lives
beside the tests because it reads their cases (nothing outside tests/ imports them).
"""

import argparse

import torch

from stages.kda.autograd import chunk_kda
from stages.kda.fused_recurrent import fused_recurrent_kda, fused_recurrent_kda_fwd
from stages.kda.on_cpu import calls_on_cpu, compiled_only
from tests.kernels import test_drop_in_gpu as drop_in
from tests.kernels.test_fla_chunk_kda import Case

TENSORS = ("q", "k", "v", "g", "beta")


def leaves(case, dtype, N=None):
    """The test's leaves of `case` on the CPU, detached (the calls below that train make their own)."""
    return {n: None if t is None else t.detach()
            for n, t in drop_in.fla_leaves(case, 0, dtype, N, device="cpu").items()}


def grid_calls():
    for name, (case, dtype) in drop_in.GRID.items():  # test_chunk_kda_within_fla_s_tolerances
        drop_in.outputs_and_gradients(chunk_kda, case, drop_in.fla_leaves(case, 0, dtype, device="cpu"), 0)
        print(f"grid {name}: done", flush=True)


def packed_calls():
    for name, (cu_seqlens, case) in drop_in.VARLEN.items():  # test_packed_training_within_fla_s_tolerances
        trained = drop_in.fla_leaves(case, 0, torch.float16, len(cu_seqlens) - 1, device="cpu")
        drop_in.outputs_and_gradients(chunk_kda, case, trained, 0, cu_seqlens=torch.tensor(cu_seqlens))
        print(f"varlen {name}: done", flush=True)
    for cu_seqlens in drop_in.INFERENCE:  # test_packed_and_dense_inference
        case = drop_in.inference_case(cu_seqlens)
        x = leaves(case, torch.bfloat16, case.B if cu_seqlens is None else len(cu_seqlens) - 1)
        packed = {} if cu_seqlens is None else {"cu_seqlens": torch.tensor(cu_seqlens)}
        with torch.inference_mode():
            chunk_kda(*(x[n] for n in TENSORS), initial_state=x["initial_state"], output_final_state=True,
                      A_log=x["A_log"], dt_bias=x["dt_bias"], safe_gate=True, state_v_first=True,
                      return_intermediate_states=True, **drop_in.KIMI.fla_kwargs(), **packed)
        print(f"inference {'packed' if packed else 'dense'}: done", flush=True)


def layer_calls():
    recurrent = [(case, torch.bfloat16) for case in drop_in.RECURRENT]  # test_fused_recurrent_kda_within_...
    recurrent += [(case, torch.float32) for case, _ in drop_in.FP32_RECURRENT.values()]  # ... in float32
    for case, dtype in recurrent:
        x = leaves(case, dtype)
        fused_recurrent_kda(*(x[n] for n in TENSORS), initial_state=x["initial_state"], output_final_state=True,
                            A_log=x["A_log"], dt_bias=x["dt_bias"], state_v_first=case.state_v_first,
                            **case.options.fla_kwargs())
    print("fused_recurrent_kda: done", flush=True)
    for options in drop_in.POOL_OPTIONS:  # test_decode_over_a_pool_as_vllm_calls_it
        B, H, D = drop_in.POOL_SEQUENCES, drop_in.POOL_HEADS, drop_in.POOL_HEAD_DIM
        x = leaves(Case(1, B, H, H, D, D, options), torch.bfloat16, 3 * B)
        fused_recurrent_kda_fwd(*(x[n] for n in TENSORS), x["A_log"], x["dt_bias"], initial_state=x["initial_state"],
                                inplace_final_state=True, cu_seqlens=torch.arange(B + 1, dtype=torch.int32),
                                ssm_state_indices=torch.arange(B, dtype=torch.int32), **options.fla_kwargs())
    print("pooled decode: done", flush=True)
    H, D = drop_in.LAYER_HEADS, drop_in.LAYER_HEAD_DIM
    for num_v_heads in drop_in.LAYER_V_HEADS:  # test_kimi_delta_attention_through_the_backend: the layer's calls
        for is_packed, lengths in drop_in.LAYER_LENGTHS.items():  # rows of one length, or one packed batch
            B, T = (1, sum(lengths)) if is_packed else (len(lengths), lengths[0])
            packed = {"cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])} if is_packed else {}
            q, k = (torch.zeros(B, T, H, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            v, g = (torch.zeros(B, T, num_v_heads, D, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
            beta = torch.zeros(B, T, num_v_heads, dtype=torch.bfloat16, requires_grad=True)
            A_log = torch.zeros(num_v_heads, dtype=torch.bfloat16, requires_grad=True)  # the layer's .to(bf16)
            dt_bias = torch.zeros(num_v_heads * D, dtype=torch.bfloat16, requires_grad=True)
            o, _ = chunk_kda(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, safe_gate=True, state_v_first=True,
                             **drop_in.KIMI.fla_kwargs(), **packed)
            o.float().sum().backward()
            print(f"layer HV={num_v_heads} {'packed' if packed else 'dense'}: done", flush=True)


PARTS = {"grid": grid_calls, "packed": packed_calls, "layer": layer_calls}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parts = parser.parse_args(argv).parts.split(",")
    unknown = [part for part in parts if part not in PARTS]
    if unknown:
        parser.error(f"unknown parts {unknown}: choose from {', '.join(PARTS)}")
    with calls_on_cpu(compiled_only):
        for part in parts:
            PARTS[part]()
    print("done", flush=True)


if __name__ == "__main__":
    main()
