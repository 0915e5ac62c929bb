"""The input checks of the fast path's calls (stages.kda.calls), on the host.

Each call's checks run in one order: the checks mode; what the tensors' types, shapes and dtypes tell
and the tile sizes; then, with checks="host", what only their values tell (a NaN, a gate above 0,
beta outside [0, 1], slots and cu_seqlens out of range: one pass and one device sync each); the
device last, so that every other mistake shows, and is tested, on a machine without a GPU. Any gate
<= 0 runs: there is no range to check (the prepare's anchored scores take any gate).
"""

from typing import TYPE_CHECKING

from stages.common.device_checks import check_mode
from stages.common.torch_checks import (check_cu_seqlens, check_cu_seqlens_values, check_gate, check_gate_values,
                                        check_kernel_tensor, check_on_cuda, check_same, check_slot_values,
                                        check_slots, check_tile_sizes, dtype_name)
from stages.kda.config import (BACKWARD_MOST_HEAD_DIM, CHANNEL_PASSES, DEFAULT_CHUNK_SIZE, SHARED_MEMORY_PER_BLOCK,
                               SUB_BLOCK, WIDE_HEAD_CHUNK_SIZE, WIDE_HEAD_DIM, KernelConfig, backward_chunk_size,
                               decode_block_dv, most_chunks)
from stages.kda.inputs import InputForm

PLAIN = InputForm()
# q, k, v of the decode kernel: fp32 too, for fused_recurrent_kda's float32 calls (FLA's fused_recurrent
# takes float32 and computes token by token in it; the decode kernel has no GEMM, its math is fp32 already)
DECODE_DTYPES = ("float16", "bfloat16", "float32")

if TYPE_CHECKING:
    import torch


# --8<-- [start:checks]
def check_forward_inputs(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor",
                         beta: "torch.Tensor", initial_state: "torch.Tensor | None" = None,
                         config: KernelConfig | None = None, checks: str = "device", form: InputForm = PLAIN,
                         A_log: "torch.Tensor | None" = None,
                         dt_bias: "torch.Tensor | None" = None) -> tuple[int, int, int, int, int]:
    """Every check of `forward`'s arguments (see its docstring); returns (B, N, H, d_k, d_v), H the value
    heads.

    In this order: the checks mode; what the tensors' types, shapes and dtypes tell (check_token_inputs,
    the initial state) and the tile sizes (check_kernel_sizes); then, with checks="host", what only
    their values tell (check_gate_values: a NaN, a gate above 0, beta outside [0, 1]; one pass and one
    device sync); the device last, so that every other mistake shows, and is tested, on a machine
    without a GPU. Any gate <= 0 runs: there is no range to check (anchored_scores_macro).
    """
    check_mode(checks)
    B, N, H, d_k, d_v = check_token_inputs(q, k, v, g, beta, form=form)
    check_gate_parameters(form, A_log, dt_bias, H, d_k)
    check_state("initial_state", initial_state, (B, H, d_k, d_v), "(B, H, d_k, d_v)")
    check_config(d_k, d_v, config)
    if checks == "host":
        check_values(form, g, beta, A_log, dt_bias)
    check_on_cuda({"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state, "A_log": A_log,
                   "dt_bias": dt_bias})
    return B, N, H, d_k, d_v


def check_token_inputs(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor",
                       beta: "torch.Tensor", length: str = "N", form: InputForm = PLAIN) -> tuple[int, int, int, int, int]:
    """q, k: (B, N, H_qk, d_k) and v: (B, N, H, d_v), of one dtype, fp16 or bf16, H a multiple of H_qk
    (grouped value heads: value head h reads q's and k's head h // (H / H_qk)); g: (B, N, H, d_k) and
    beta: (B, N, H), fp32, or q's dtype too where the form activates them (a raw gate, beta logits);
    all contiguous tensors. Types, shapes and dtypes only: no value is read. `length` names the token
    axis in the messages (T in stage 7's prefill). Returns (B, N, H, d_k, d_v), H the value heads."""
    check_kernel_tensor("q", q, rank=4)
    check_kernel_tensor("k", k, rank=4)
    check_kernel_tensor("v", v, rank=4)
    check_same("k", k, "q", q, "shape")
    B, N, H_qk, d_k = q.shape
    H, d_v = v.shape[2], v.shape[3]
    if tuple(v.shape[:2]) != (B, N) or H % H_qk:
        raise ValueError(f"v must be (B, {length}, H, d_v) = ({B}, {N}, H, d_v) with H a multiple of q's and k's "
                         f"{H_qk} heads (grouped value heads), got {tuple(v.shape)}")
    check_same("k", k, "q", q, "dtype")
    check_same("v", v, "q", q, "dtype")
    gate_dtypes = ("float32", dtype_name(q)) if form.raw_gate else ("float32",)
    beta_dtypes = ("float32", dtype_name(q)) if form.beta != "value" else ("float32",)
    check_shaped("g", g, (B, N, H, d_k), f"(B, {length}, H, d_k)", gate_dtypes)
    check_shaped("beta", beta, (B, N, H), f"(B, {length}, H)", beta_dtypes)
    return B, N, H, d_k, d_v


def check_shaped(name: str, x: "torch.Tensor", shape: tuple[int, ...], axes: str, dtypes: tuple[str, ...]) -> None:
    """x: a contiguous tensor of one of `dtypes` and of the given shape, `axes` naming its axes."""
    check_kernel_tensor(name, x, rank=len(shape), dtypes=dtypes)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {axes} = {tuple(shape)}, got {tuple(x.shape)}")


def check_gate_parameters(form: InputForm, A_log: "torch.Tensor | None", dt_bias: "torch.Tensor | None",
                          H: int, d_k: int) -> None:
    """A_log (H,) and dt_bias (H * d_k,) or (H, d_k), fp32, the raw gate's parameters (FLA's shapes):
    A_log needed by the "softplus" gate, optional with "sigmoid", dt_bias optional; neither with a
    log gate, which has no parameters."""
    if not isinstance(form, InputForm):
        raise TypeError(f"form must be a stages.kda.inputs.InputForm, got {type(form).__name__}")
    if not form.raw_gate:
        if A_log is not None or dt_bias is not None:
            raise ValueError("A_log and dt_bias are a raw gate's parameters: give them with form.gate 'softplus' or "
                             "'sigmoid', not with a log gate g")
        return
    if form.gate == "softplus" and A_log is None:
        raise ValueError("the 'softplus' gate needs A_log (H,): g = -exp(A_log) * softplus(x + dt_bias)")
    if A_log is not None:
        check_shaped("A_log", A_log, (H,), "(H,)", ("float32",))
    if dt_bias is not None:
        shape = (H * d_k,) if dt_bias.dim() == 1 else (H, d_k)
        check_shaped("dt_bias", dt_bias, shape, "(H * d_k,) or (H, d_k)", ("float32",))


def check_values(form: InputForm, g: "torch.Tensor", beta: "torch.Tensor", A_log: "torch.Tensor | None",
                 dt_bias: "torch.Tensor | None") -> None:
    """checks="host": g and beta as the kernels will see them, read to the host. A log gate and beta
    themselves: check_gate_values (finite g <= 0, beta in [0, 1]); a raw gate, beta logits and the
    gate's parameters: finite, which is all the activations need (their results then lie in range)."""
    import torch

    raw = {"g": g} if form.raw_gate else {}
    raw.update({"A_log": A_log, "dt_bias": dt_bias} if form.raw_gate else {})
    raw.update({"beta": beta} if form.beta != "value" else {})
    finite = [bool(torch.isfinite(x).all()) for x in raw.values() if x is not None]
    if not all(finite):
        names = [name for name, x in raw.items() if x is not None]
        raise ValueError(f"{names[finite.index(False)]} must be finite: the kernels activate it as they load it")
    check_gate_values(None if form.raw_gate else g, None if form.beta != "value" else beta)


def check_state(name: str, state: "torch.Tensor | None", shape: tuple[int, ...], axes: str) -> None:
    """state (an initial state, or the gradient of a final state) is None or a contiguous fp32 tensor of
    the given shape: S^T in the kernel layout, `axes` naming its axes, "(B, H, d_k, d_v)" say."""
    if state is not None:
        check_gate(name, state, shape, axes)


def check_config(d_k: int, d_v: int, config: KernelConfig | None) -> None:
    """The sizes of a call's config (None: the defaults, which fit every d_k and d_v check_kernel_sizes
    takes with DEFAULT_CHUNK_SIZE and DEFAULT_BLOCK_DV)."""
    if config is not None and not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a stages.kda.config.KernelConfig or None, got {type(config).__name__}")
    config = config or KernelConfig()
    check_kernel_sizes(d_k, d_v, config.chunk_size, config.block_dv, config.channel_passes)


def check_kernel_sizes(d_k: int, d_v: int, chunk_size: int, block_dv: int, channel_passes: int = CHANNEL_PASSES
                       ) -> None:
    """The sizes the kernels are built for: the tensor cores' tile sizes (stages.common), chunks of 2 or
    4 sub-blocks for the block inverse, and d_k in channel_passes passes of whole 16-wide GEMM steps."""
    if chunk_size not in (2 * SUB_BLOCK, 4 * SUB_BLOCK):
        raise ValueError(f"chunk_size must be {2 * SUB_BLOCK} or {4 * SUB_BLOCK}, got {chunk_size}")
    if channel_passes < 1 or d_k % (16 * channel_passes):
        raise ValueError(f"d_k must be a multiple of {16 * channel_passes} ({channel_passes} channel passes "
                         f"of the score GEMMs), got {d_k}")
    check_tile_sizes(d_k, d_v, chunk_size, block_dv)
# --8<-- [end:checks]


def check_backward_inputs(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor",
                          beta: "torch.Tensor", do: "torch.Tensor", initial_state: "torch.Tensor | None" = None,
                          d_final_state: "torch.Tensor | None" = None, config: KernelConfig | None = None,
                          checks: str = "device", form: InputForm = PLAIN, A_log: "torch.Tensor | None" = None,
                          dt_bias: "torch.Tensor | None" = None) -> tuple[int, int, int, int, int]:
    """Every check of `backward`'s arguments, in the order of stage 5's check_forward_inputs, with do
    and d_final_state beside the forward's inputs; returns (B, N, H, d_k, d_v). With checks="host", the
    values (check_gate_values): any gate <= 0 runs, as in stage 5's forward, so no range is checked."""
    check_mode(checks)
    B, N, H, d_k, d_v = check_token_inputs(q, k, v, g, beta, form=form)
    check_gate_parameters(form, A_log, dt_bias, H, d_k)
    check_output_gradient(do, q, v)
    check_state("initial_state", initial_state, (B, H, d_k, d_v), "(B, H, d_k, d_v)")
    check_state("d_final_state", d_final_state, (B, H, d_k, d_v), "(B, H, d_k, d_v)")
    check_config(d_k, d_v, config)
    check_backward_head_dims(d_k, d_v, config.chunk_size if config else backward_chunk_size(d_k, d_v))
    if checks == "host":
        check_values(form, g, beta, A_log, dt_bias)
    check_on_cuda({"q": q, "k": k, "v": v, "g": g, "beta": beta, "do": do, "initial_state": initial_state,
                   "d_final_state": d_final_state, "A_log": A_log, "dt_bias": dt_bias})
    return B, N, H, d_k, d_v


def check_backward_head_dims(d_k: int, d_v: int, chunk_size: int) -> None:
    """The backward's kernels take head dims up to BACKWARD_MOST_HEAD_DIM (256), above WIDE_HEAD_DIM (128)
    at chunk WIDE_HEAD_CHUNK_SIZE only (backward_chunk_size: the intra program holds a chunk's q, k, v
    and their gradients' operands whole in shared memory): refused here, with the reason, rather than
    by the launch."""
    if max(d_k, d_v) > BACKWARD_MOST_HEAD_DIM:
        raise ValueError(f"the backward's kernels take head dims up to {BACKWARD_MOST_HEAD_DIM} (d_k = {d_k}, d_v = "
                         f"{d_v} as the kernels read them): their programs hold C x d_k and C x d_v tiles in "
                         f"shared memory, past the {SHARED_MEMORY_PER_BLOCK:,} B a program may have; the forward "
                         f"takes them")
    if backward_chunk_size(d_k, d_v, chunk_size) != chunk_size:
        raise ValueError(f"at head dims above {WIDE_HEAD_DIM} (d_k = {d_k}, d_v = {d_v}) the backward runs at "
                         f"chunk_size {WIDE_HEAD_CHUNK_SIZE}, got {chunk_size}: at larger chunks its intra program "
                         f"needs more than the {SHARED_MEMORY_PER_BLOCK:,} B of shared memory a program may have "
                         f"(stages.kda.config.backward_chunk_size)")


def check_prepared(prepared: "tuple[torch.Tensor, ...] | None", w_shape: tuple[int, ...]) -> None:
    """prepared: None, or the eight outputs of stage 5's prepare with solve_outputs, W first, of shape
    w_shape (B, N padded to a multiple of chunk_size, H, d_k)."""
    if prepared is not None and (len(prepared) != 8 or tuple(prepared[0].shape) != w_shape):
        raise ValueError(f"prepared must be the eight tensors stage 5's forward(..., return_prepared=True) returns for "
                         f"these inputs, W of shape {w_shape} first")


def check_output_gradient(do: "torch.Tensor", q: "torch.Tensor", v: "torch.Tensor") -> None:
    """do = dLoss/do: contiguous, o's shape (v's, (B, N, H, d_v)) and q's dtype."""
    check_kernel_tensor("do", do, rank=4)
    check_same("do", do, "v", v, "shape")
    check_same("do", do, "q", q, "dtype")


def check_prefill_inputs(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor",
                         beta: "torch.Tensor", cu_seqlens: "torch.Tensor", initial_state: "torch.Tensor | None" = None,
                         config: KernelConfig | None = None, checks: str = "device", form: InputForm = PLAIN,
                         A_log: "torch.Tensor | None" = None, dt_bias: "torch.Tensor | None" = None) -> None:
    """Every check of `prefill`'s arguments with cu_seqlens (without, `forward` checks them), in the
    order of stage 5's check_forward_inputs: the checks mode, the tensors' types, shapes and dtypes,
    cu_seqlens's type and shape, the initial states, the tile sizes and the 32-bit indexing of the
    largest chunk-aligned layout; then, with checks="host", cu_seqlens's, g's and beta's values (read
    to the host); the device last."""
    check_mode(checks)
    B, T, H, d_k, d_v = check_token_inputs(q, k, v, g, beta, length="T", form=form)
    check_gate_parameters(form, A_log, dt_bias, H, d_k)
    check_cu_seqlens(cu_seqlens, B)
    N_seq = cu_seqlens.numel() - 1
    check_state("initial_state", initial_state, (N_seq, H, d_k, d_v), "(N_seq, H, d_k, d_v)")
    check_config(d_k, d_v, config)
    C = config.chunk_size if config else DEFAULT_CHUNK_SIZE
    check_int32_indexing(max(T, most_chunks(T, N_seq, C) * C), H, max(d_k, d_v, C))
    if checks == "host":
        check_cu_seqlens_values(cu_seqlens, T)
        check_values(form, g, beta, A_log, dt_bias)
    check_on_cuda({"q": q, "k": k, "v": v, "g": g, "beta": beta, "cu_seqlens": cu_seqlens,
                   "initial_state": initial_state, "A_log": A_log, "dt_bias": dt_bias})


def check_decode_inputs(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor",
                        beta: "torch.Tensor", state_pool: "torch.Tensor", slots: "torch.Tensor",
                        config: KernelConfig | None = None, checks: str = "device", form: InputForm = PLAIN,
                        A_log: "torch.Tensor | None" = None,
                        dt_bias: "torch.Tensor | None" = None) -> tuple[int, int, int, int]:
    """Every check of `decode`'s arguments (see its docstring); returns (B, H, d_k, d_v), H the value
    heads (q and k may have fewer: grouped value heads); q, k, v in DECODE_DTYPES.

    In stage 5's order (check_forward_inputs): the checks mode, what the tensors' types, shapes and
    dtypes tell, and block_dv; then, with checks="host", what only their values tell (check_values,
    then check_slot_values); the device last, so that every other mistake shows, and is tested, on a
    machine without a GPU.
    """
    check_mode(checks)
    check_kernel_tensor("q", q, rank=3, dtypes=DECODE_DTYPES)
    check_kernel_tensor("k", k, rank=3, dtypes=DECODE_DTYPES)
    check_kernel_tensor("v", v, rank=3, dtypes=DECODE_DTYPES)
    check_same("k", k, "q", q, "shape")
    B, H_qk, d_k = q.shape
    H = v.shape[1]
    if v.shape[0] != B or H % H_qk:
        raise ValueError(f"v must be (B, H, d_v) = ({B}, H, d_v) with H a multiple of q's and k's {H_qk} heads "
                         f"(grouped value heads), got {tuple(v.shape)}")
    d_v = v.shape[2]
    check_same("k", k, "q", q, "dtype")
    check_same("v", v, "q", q, "dtype")
    gate_dtypes = ("float32", dtype_name(q)) if form.raw_gate else ("float32",)
    beta_dtypes = ("float32", dtype_name(q)) if form.beta != "value" else ("float32",)
    check_shaped("g", g, (B, H, d_k), "(B, H, d_k)", gate_dtypes)
    check_shaped("beta", beta, (B, H), "(B, H)", beta_dtypes)
    check_gate_parameters(form, A_log, dt_bias, H, d_k)
    check_kernel_tensor("state_pool", state_pool, rank=4, dtypes=("float32",))
    if tuple(state_pool.shape[1:]) != (H, d_k, d_v):
        raise ValueError(f"state_pool must be (P, H, d_k, d_v) = (P, {H}, {d_k}, {d_v}), S^T in the kernel layout, "
                         f"got {tuple(state_pool.shape)}")
    check_slots(slots, B)
    check_block(d_v, decode_block_dv(d_v) if config is None else config.block_dv)
    if checks == "host":
        check_values(form, g, beta, A_log, dt_bias)
        check_slot_values(slots, state_pool.shape[0])
    check_on_cuda({"q": q, "k": k, "v": v, "g": g, "beta": beta, "state_pool": state_pool, "slots": slots,
                   "A_log": A_log, "dt_bias": dt_bias})
    return B, H, d_k, d_v


def check_int32_indexing(rows: int, H: int, width: int) -> None:
    """The kernels compiled for run-time sizes index in 32 bits: a buffer of rows x H x width entries
    (rows: the packed tokens or the chunk-aligned rows, the more) must stay below 2^31 (about
    524,000 rows at H = 32 and d = 128)."""
    if rows * H * width >= 2**31:
        raise ValueError(f"the batch has {rows} rows of {H} x {width} entries, 2^31 or more: "
                         f"prefill it in smaller batches")


def check_block(d_v: int, block_dv: int) -> None:
    """block_dv: a positive divisor of d_v (the programs split the value columns evenly)."""
    if not isinstance(block_dv, int) or block_dv < 1 or d_v % block_dv:
        raise ValueError(f"block_dv must be a positive divisor of d_v = {d_v}, got {block_dv!r}")


