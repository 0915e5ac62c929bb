"""Stage 7 kernels: the KDA decode step in TileLang over a pool of states, and prefill of variable-length batches.

One program per (block of d_v columns, batch x head), as in stages 1-5. Program (i_v, b, h) reads
its slice of sequence b's state, S^T[:, block] (d_k x block_dv, fp32), from the pool at slots[b],
advances it by one token and writes it back in place:

    S^T <- Diag(e^g) S^T                 decay, row by row (row d is key channel d)
    u    = beta (v - (S^T)^T k)          one column sum over d_k
    S^T <- S^T + k u^T                   the rank-one delta-rule write
    o    = (S^T)^T q                     a second column sum, with the updated state

(see stages.s07_serving.reference for why this is stage 4's recurrence). No chunk, no GEMM: the state
is read once and written once, 2 * d_k * block_dv * 4 bytes per program against a few KiB of q, k,
v, g; everything else happens in registers. The kernel is bound by memory, and its measure is the
fraction of the copy bandwidth it reaches (benchmarks/decode.py).

`prefill` runs a packed batch of sequences of any lengths (FLA's `cu_seqlens`), each from its own
initial state, through stage 5's two kernels: today by repacking the sequences into batches of
equal padded length (one stage 5 call per power-of-two bucket of lengths, zero padding, which is
exact), later by the variable-length kernels that stages.s07_serving.reference.kernel_mirror
designs, with no padding at all.

Run `python -m stages.s07_serving.kernel` to compile it for sm_90a and print its ptxas report (no
GPU needed), or to check it against the reference on a GPU.
"""

import functools
from typing import TYPE_CHECKING

from stages.common.tilelang_tools import LOG2_E
from stages.common.tilelang_tools import compile_report as _compile_report
from stages.common.torch_checks import (KERNEL_DTYPES, check_cu_seqlens, check_gate, check_gate_values, check_kernel_tensor,
                                        check_on_cuda, check_qkv, check_same, check_slot_values, check_slots, dtype_name)
from stages.s05_fast_kda.kernel import DEFAULT_CHUNK_SIZE

if TYPE_CHECKING:
    import torch

DEFAULT_BLOCK_DV = 32
DEFAULT_THREADS = 128


# --8<-- [start:program]
def build_decode_program(B, P, H, d_k, d_v, block_dv=DEFAULT_BLOCK_DV, dtype="float16", state_dtype="float32",
                         threads=DEFAULT_THREADS):
    """The decode program: q, k (B, H, d_k), v (B, H, d_v) in `dtype`; g (B, H, d_k), beta (B, H) and
    the pool (P, H, d_k, d_v) in `state_dtype` (fp32 on the GPU; the interpreter also runs float64);
    slots (B,) int32 -> o (B, H, d_v) in `dtype`, the pool updated in place at slots.

    block_dv must divide d_v. Parameters in order: Q, K, V, G, Beta, Slots, State_pool, O (out_idx=[7]).
    """
    import tilelang.language as T

    accum_dtype = state_dtype

    @T.prim_func
    def kda_decode(
        Q: T.Tensor((B, H, d_k), dtype),
        K: T.Tensor((B, H, d_k), dtype),
        V: T.Tensor((B, H, d_v), dtype),
        G: T.Tensor((B, H, d_k), accum_dtype),
        Beta: T.Tensor((B, H), accum_dtype),
        Slots: T.Tensor((B,), "int32"),
        State_pool: T.Tensor((P, H, d_k, d_v), accum_dtype),
        O: T.Tensor((B, H, d_v), dtype),
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv
            slot = Slots[b]  # where sequence b's state lives in the pool

            q_s = T.alloc_shared((d_k,), accum_dtype)
            k_s = T.alloc_shared((d_k,), accum_dtype)
            decay_s = T.alloc_shared((d_k,), accum_dtype)  # e^g, one rate per key channel
            v_s = T.alloc_shared((block_dv,), accum_dtype)

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state's slice, read once
            product_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # k ⊙ S^T, then q ⊙ S^T
            recalled_f = T.alloc_fragment((block_dv,), accum_dtype)  # (S^T)^T k: what the state holds for k
            u_f = T.alloc_fragment((block_dv,), accum_dtype)  # beta (v - recalled)
            o_f = T.alloc_fragment((block_dv,), accum_dtype)

            T.copy(State_pool[slot, h, :, v0:v0 + block_dv], S_f)
            T.copy(Q[b, h, :], q_s)
            T.copy(K[b, h, :], k_s)
            T.copy(V[b, h, v0:v0 + block_dv], v_s)
            for d in T.Parallel(d_k):
                decay_s[d] = T.exp2(G[b, h, d] * LOG2_E)

            # the decay first, then what the decayed state recalls for k
            for d, j in T.Parallel(d_k, block_dv):
                S_f[d, j] *= decay_s[d]
                product_f[d, j] = k_s[d] * S_f[d, j]
            T.reduce_sum(product_f, recalled_f, dim=0)
            for j in T.Parallel(block_dv):
                u_f[j] = Beta[b, h] * (v_s[j] - recalled_f[j])

            # the write, then the output read from the updated state
            for d, j in T.Parallel(d_k, block_dv):
                S_f[d, j] += k_s[d] * u_f[j]
                product_f[d, j] = q_s[d] * S_f[d, j]
            T.reduce_sum(product_f, o_f, dim=0)
            T.copy(o_f, O[b, h, v0:v0 + block_dv])
            T.copy(S_f, State_pool[slot, h, :, v0:v0 + block_dv])  # back where it came from

    return kda_decode
# --8<-- [end:program]


@functools.cache
def _compiled(B, P, H, d_k, d_v, block_dv, dtype, threads):
    import tilelang

    program = build_decode_program(B, P, H, d_k, d_v, block_dv, dtype, "float32", threads)
    return tilelang.compile(program, out_idx=[7], target="cuda")


# --8<-- [start:decode]
def decode(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
           state_pool: "torch.Tensor", slots: "torch.Tensor", block_dv: int = DEFAULT_BLOCK_DV,
           threads: int = DEFAULT_THREADS, check_values: bool = True) -> "torch.Tensor":
    """One decode step on CUDA tensors: q, k (B, H, d_k), v (B, H, d_v) in fp16 or bf16; g (B, H, d_k)
    fp32 log gates (<= 0); beta (B, H) fp32 in [0, 1]; state_pool (P, H, d_k, d_v) fp32, S^T in the
    kernel layout; slots (B,) int32, distinct, in [0, P).

    Returns o (B, H, d_v) in the input dtype; state_pool[slots] is advanced by one token in place
    and every other slot is left as it was. check_values=False skips the checks of g's, beta's and
    the slots' values (two passes and two device syncs): the caller vouches for them, and the call
    has no host sync left, as a server's decode loop (or a CUDA graph of it) needs.
    """
    check_kernel_tensor("q", q, rank=3)
    check_kernel_tensor("k", k, rank=3)
    check_kernel_tensor("v", v, rank=3)
    check_same("k", k, "q", q, "shape")
    B, H, d_k = q.shape
    if tuple(v.shape[:2]) != (B, H):
        raise ValueError(f"v must be (B, H, d_v) = ({B}, {H}, d_v), got {tuple(v.shape)}")
    d_v = v.shape[2]
    check_same("k", k, "q", q, "dtype")
    check_same("v", v, "q", q, "dtype")
    check_gate("g", g, (B, H, d_k), "(B, H, d_k)")
    check_gate("beta", beta, (B, H), "(B, H)")
    check_kernel_tensor("state_pool", state_pool, rank=4, dtypes=("float32",))
    if tuple(state_pool.shape[1:]) != (H, d_k, d_v):
        raise ValueError(f"state_pool must be (P, H, d_k, d_v) = (P, {H}, {d_k}, {d_v}), S^T in the kernel layout, "
                         f"got {tuple(state_pool.shape)}")
    check_slots(slots, B)
    _check_block(d_v, block_dv)
    if check_values:
        check_gate_values(g, beta)
        check_slot_values(slots, state_pool.shape[0])
    check_on_cuda({"q": q, "k": k, "v": v, "g": g, "beta": beta, "state_pool": state_pool, "slots": slots})
    kernel = _compiled(B, state_pool.shape[0], H, d_k, d_v, block_dv, dtype_name(q), threads)
    return kernel(q, k, v, g, beta, slots, state_pool)
# --8<-- [end:decode]


# --8<-- [start:prefill]
def prefill(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor", beta: "torch.Tensor",
            cu_seqlens: "torch.Tensor | None" = None, initial_state: "torch.Tensor | None" = None,
            output_final_state: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE,
            check_values: bool = True) -> "torch.Tensor | tuple[torch.Tensor, torch.Tensor]":
    """The forward pass of a batch of sequences, each from its own state, in FLA's conventions.

    q, k: (B, T, H, d_k), v: (B, T, H, d_v) in fp16 or bf16; g: (B, T, H, d_k) fp32 log gates (<= 0);
    beta: (B, T, H) fp32 in [0, 1]. With cu_seqlens (int32 or int64, (N_seq + 1,)) the batch is
    packed, B = 1, and sequence i is tokens cu_seqlens[i] to cu_seqlens[i + 1] - 1; without it each
    of the B rows is a sequence. initial_state: S_0^T (N_seq, H, d_k, d_v) fp32 or None (zeros).
    Returns o (B, T, H, d_v) in the input dtype, and with output_final_state also the final states
    S^T (N_seq, H, d_k, d_v) fp32. check_values=False skips the check of g's and beta's values.
    """
    from stages.s05_fast_kda.kernel import forward

    B, T, H, d_k, d_v = check_qkv(q, k, v)
    check_gate("g", g, (B, T, H, d_k), "(B, T, H, d_k)")
    check_gate("beta", beta, (B, T, H), "(B, T, H)")
    if cu_seqlens is None:
        return forward(q, k, v, g, beta, chunk_size=chunk_size, initial_state=initial_state,
                       output_final_state=output_final_state, check_values=check_values)
    offsets = check_cu_seqlens(cu_seqlens, B, T)
    N_seq = len(offsets) - 1
    if initial_state is not None:
        check_gate("initial_state", initial_state, (N_seq, H, d_k, d_v), "(N_seq, H, d_k, d_v)")
    if check_values:
        check_gate_values(g, beta)
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "cu_seqlens": cu_seqlens}
    check_on_cuda(tensors if initial_state is None else dict(tensors, initial_state=initial_state))

    def chunked_forward(*padded, initial_state):
        return forward(*padded, chunk_size=chunk_size, initial_state=initial_state, output_final_state=True,
                       check_values=False)

    o, final_state = prefill_by_buckets(q, k, v, g, beta, offsets, initial_state, chunk_size, chunked_forward)
    return (o, final_state) if output_final_state else o
# --8<-- [end:prefill]


# --8<-- [start:prefill_by_buckets]
def prefill_by_buckets(q, k, v, g, beta, offsets, initial_state, chunk_size, chunked_forward):
    """The packed batch (1, T, ...) with sequences at `offsets` through `chunked_forward`, an
    equal-length forward pass (B, N, ...) -> (o, final states) that takes initial states (stage 5's).

    The sequences are grouped by length, each group padded with zero tokens to one length, a power
    of two times chunk_size (so that no group pads more than it holds, and the kernels are compiled
    for few shapes). A zero token changes no state, so the padding is exact. Returns (o (1, T, H,
    d_v), the final states (N_seq, H, d_k, d_v) fp32); an empty sequence keeps its initial state.
    """
    import torch

    N_seq, (H, d_k), d_v = len(offsets) - 1, q.shape[2:], v.shape[3]
    lengths = [end - start for start, end in zip(offsets[:-1], offsets[1:])]
    o = torch.empty_like(v)  # every token's row is written by its group
    final_state = (torch.zeros((N_seq, H, d_k, d_v), dtype=torch.float32, device=q.device) if initial_state is None
                   else initial_state.clone())
    for padded_length, members in length_groups(lengths, chunk_size).items():
        source, destination = _group_rows(offsets, members, padded_length, q.device)
        sequences = torch.tensor(members, device=q.device)
        group = (_padded_rows(x, source, destination, len(members), padded_length) for x in (q, k, v, g, beta))
        group_o, group_state = chunked_forward(*group, initial_state=final_state[sequences].contiguous())
        o[0, source] = group_o.reshape(-1, H, d_v)[destination]
        final_state[sequences] = group_state
    return o, final_state
# --8<-- [end:prefill_by_buckets]


def length_groups(lengths: list[int], chunk_size: int) -> dict[int, list[int]]:
    """{padded length: the sequences padded to it}: n tokens go to chunk_size times the smallest power
    of two >= ceil(n / chunk_size). Empty sequences go nowhere."""
    groups = {}
    for i, n in enumerate(lengths):
        if n:
            chunks = -(-n // chunk_size)
            groups.setdefault(chunk_size * (1 << (chunks - 1).bit_length()), []).append(i)
    return groups


def _padded_rows(x, source, destination, count, padded_length):
    """x (1, T, ...) -> (count, padded_length, ...): token source[j] at row destination[j], zeros elsewhere."""
    rows = x.new_zeros((count * padded_length, *x.shape[2:]))
    rows[destination] = x[0, source]
    return rows.view(count, padded_length, *x.shape[2:])


def _group_rows(offsets, members, padded_length, device):
    """(source, destination) (n_tokens,): token source[j] of the packed batch goes to row
    destination[j] of the group's (len(members) * padded_length) padded rows."""
    import torch

    starts = torch.tensor([offsets[i] for i in members], device=device)
    lengths = torch.tensor([offsets[i + 1] - offsets[i] for i in members], device=device)
    first_row = torch.cumsum(lengths, 0) - lengths  # where each member's tokens begin in the group's list
    position = torch.arange(int(lengths.sum()), device=device) - torch.repeat_interleave(first_row, lengths)
    member = torch.repeat_interleave(torch.arange(len(members), device=device), lengths)
    return starts[member] + position, member * padded_length + position


def _check_block(d_v, block_dv):
    """block_dv: a positive divisor of d_v (the programs split the value columns evenly)."""
    if not isinstance(block_dv, int) or block_dv < 1 or d_v % block_dv:
        raise ValueError(f"block_dv must be a positive divisor of d_v = {d_v}, got {block_dv!r}")


@functools.cache  # the page's report and the compile test share one nvcc run
def compile_report(B=64, P=256, H=32, d_k=128, d_v=128, block_dv=DEFAULT_BLOCK_DV, dtype="bfloat16",
                   threads=DEFAULT_THREADS):
    """Lower and compile the decode kernel for sm_90a without a GPU; see stages.common.tilelang_tools."""
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"dtype must be one of {KERNEL_DTYPES}, got {dtype!r}")
    _check_block(d_v, block_dv)
    return _compile_report(build_decode_program(B, P, H, d_k, d_v, block_dv, dtype, "float32", threads))


def main():
    import numpy as np
    import torch

    from stages.common.errors import error_report
    from stages.common.inputs import l2_normalize
    from stages.s07_serving.reference import decode_step

    print("sm_90a:", compile_report().summary())
    if not torch.cuda.is_available():
        print("no CUDA device: compile-only")
        return
    rng = np.random.default_rng(0)
    B, P, H, D = 8, 32, 4, 128
    q, k = (l2_normalize(rng.standard_normal((B, H, D))) for _ in range(2))
    v = rng.standard_normal((B, H, D))
    g, beta = np.log(rng.uniform(0.9, 0.999, (B, H, D))), rng.uniform(0.1, 0.9, (B, H))
    pool = rng.standard_normal((P, H, D, D)).astype(np.float32).astype(np.float64) * 0.1
    slots = rng.permutation(P)[:B].astype(np.int32)
    expected_pool = pool.copy()
    expected = decode_step(q, k, v, g, beta, expected_pool, slots)
    for dtype in (torch.float16, torch.bfloat16):
        pool_gpu = torch.tensor(pool, dtype=torch.float32, device="cuda")
        o = decode(*(torch.tensor(a, dtype=dtype, device="cuda") for a in (q, k, v)),
                   *(torch.tensor(a, dtype=torch.float32, device="cuda") for a in (g, beta)), pool_gpu,
                   torch.tensor(slots, device="cuda"))
        print(f"{dtype} o vs reference:", error_report(o, expected))
        print(f"{dtype} pool vs reference:", error_report(pool_gpu, expected_pool))


if __name__ == "__main__":
    main()
