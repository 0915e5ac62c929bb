"""Stage 6: KDA as a differentiable torch function, with FLA `chunk_kda`'s calling convention.

    S_t = S_{t-1} Diag(a_t) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T        o_t = scale * S_t q_t
                                                             (paper layout: S is d_v x d_k)

`chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
use_qk_l2norm_in_kernel=False)` returns (o, final_state) as FLA's does: q, k (B, T, H, K),
v (B, T, H, V), g = log a (B, T, H, K), beta (B, T, H); the states S^T (B, H, K, V) in the kernel
layout. `loss.backward()` reaches q, k, v, g, beta and initial_state, through o and through the final
state. One `torch.autograd.Function`, `ChunkKDAFunction`, joins a forward and a backward per device:

    CUDA tensors   forward: stage 5's two TileLang kernels (stages.kda.calls.forward)
                   backward: stage 6's TileLang kernels (stages.kda.calls.backward)
    CPU tensors    forward: stage 5's reference in NumPy float64 (prepare, then recurrence)
                   backward: stage 6's reference B (stages.s06_backward.reference.chunkwise_backward)

so that the same layer trains on a GPU, and on a CPU through the references, slowly but exactly.
The forward keeps only its inputs; the backward recomputes what it needs inside each chunk (both
backward paths do), the trade FLA makes by default: memory for one more forward pass. FLA's
`disable_recompute=True` makes the other trade, on CUDA: the forward keeps its prepare kernel's six
outputs (W, U, Q e^gamma, K e^{gamma_C - gamma}, A_qk: four (B, T, H, d) and one (B, T, H, C) in
q's dtype, about 0.6 GB at T = 16384, H = 32, d = 128 in bf16) and the backward skips that kernel.

Two of FLA's conveniences are plain torch operations in front of the function, so autograd takes
their gradients: `scale` multiplies q (FLA's default 1 / sqrt(K); the course's references have no
scale, so pass scale=1.0 to compare with them), and `use_qk_l2norm_in_kernel` divides q and k by
sqrt(||x||^2 + 1e-6), FLA's L2 norm. Both run in float32 and the function rounds their result to the
kernels' dtype once; the gradients of q and k come back from the kernels in fp32 and are rounded once,
after the norm's backward, as FLA's are (each extra bf16 rounding costs about a tenth of the error).
The gate and beta enter the kernels in float32, so on CUDA they are cast to it here; the CPU path
computes in float64 whatever the dtype.

What the course does not support is refused with an error that says why: variable-length batches
(`cu_seqlens`, stage 7), the gate or beta computed inside the kernel (`use_gate_in_kernel`,
`use_beta_sigmoid_in_kernel`, `allow_neg_eigval`, `safe_gate`, `lower_bound`: compute g and beta in
front, as stages.kda.layer does), and FLA's inference and parallelism options.
"""

import math
from typing import NamedTuple

import numpy as np
import torch

from stages.common.torch_checks import check_kernel_tensor, dtype_name
from stages.s05_fast_kda import reference as forward_reference
from stages.kda.calls import backward, forward_and_prepared
from stages.kda.config import DEFAULT_CHUNK_SIZE as CUDA_CHUNK_SIZE  # the kernels': 32 or 64
from stages.kda.config import resolve_for
from stages.s06_backward import reference as backward_reference

# The CPU path runs plain-loop references whose cost per chunk grows as C^2 (reference B's scores
# and their gradients): short chunks are faster there, and in float64 the answer does not depend on C.
CPU_CHUNK_SIZE = 16
L2_NORM_EPS = 1e-6  # FLA's l2norm: x / sqrt(sum x^2 + eps)
INPUT_DTYPES = ("float16", "bfloat16", "float32", "float64")
STATE_DTYPES = ("float32", "float64")  # FLA's states are float32; float64 too, for the CPU's exact checks


class Refused(NamedTuple):
    """An argument of FLA's chunk_kda the course refuses when it differs from FLA's default."""

    default: object
    why: str


_IN_FRONT = "compute it in front of chunk_kda, as stages.kda.layer does"
REFUSED = {
    "cu_seqlens": Refused(None, "variable-length batches are stage 7's; here every sequence has the length T"),
    "cu_seqlens_cpu": Refused(None, "variable-length batches are stage 7's; here every sequence has the length T"),
    "use_gate_in_kernel": Refused(False, f"the course's kernels take the log gate g itself; {_IN_FRONT}"),
    "use_beta_sigmoid_in_kernel": Refused(False, f"the course's kernels take beta in [0, 1]; {_IN_FRONT}"),
    "allow_neg_eigval": Refused(False, "beta in [0, 2) is not supported: the course's beta lies in [0, 1]"),
    "safe_gate": Refused(False, f"a bounded gate is the caller's choice of g; {_IN_FRONT}"),
    "lower_bound": Refused(None, f"a bounded gate is the caller's choice of g; {_IN_FRONT}"),
    "A_log": Refused(None, f"the gate's parameters belong to the layer; {_IN_FRONT}"),
    "dt_bias": Refused(None, f"the gate's parameters belong to the layer; {_IN_FRONT}"),
    "return_intermediate_states": Refused(False, "inference-time intermediate states are not kept"),
    "state_v_first": Refused(False, "the state is S^T (B, H, K, V), the kernel layout, only"),
    "cp_context": Refused(None, "context parallelism across devices is not supported"),
    "use_graph": Refused(False, "CUDA graph capture of varlen batches is not supported"),
    "max_num_seqs": Refused(None, "CUDA graph capture of varlen batches is not supported"),
}


# --8<-- [start:chunk_kda]
def chunk_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              scale: float | None = None, initial_state: torch.Tensor | None = None,
              output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
              chunk_size: int | None = None, checks: str = "device", disable_recompute: bool = False,
              **fla_options) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA forward with autograd, FLA's chunk_kda convention. Returns (o (B, T, H, V), final state
    S_T^T (B, H, K, V) or None).

    q, k: (B, T, H, K); v: (B, T, H, V) on one device: fp16 or bf16 on CUDA, any float dtype on the
    CPU. g: (B, T, H, K) log gates (<= 0), beta: (B, T, H) in [0, 1], cast to float32 on CUDA.
    scale: o = scale * S q, None for 1 / sqrt(K). initial_state: S_0^T (B, H, K, V) float32 (float64
    too on the CPU) or None for zeros. chunk_size: None for the device's default (64 on CUDA,
    CPU_CHUNK_SIZE on the CPU). checks (the course's, not FLA's): how the CUDA forward checks g's and
    beta's values (finite gates <= 0, beta in [0, 1]; any such gate runs, forward and backward), as
    stages.kda.calls.forward takes it: "device" (the default: flagged by the kernel, reported
    by stages.common.device_checks.raise_if_flagged where the caller syncs, the loss's logging say),
    "host" (refused before the kernels, a sync per call) or "off" (the caller vouches for them).
    disable_recompute (FLA's): on CUDA the forward keeps its prepare outputs for the backward, which
    then skips that kernel (the same gradients; see the module's docstring for the memory); the CPU
    path recomputes whatever it is. FLA's other options (fla_options) are refused unless they hold
    FLA's default value (see REFUSED).
    """
    check_chunk_kda_inputs(q, k, v, g, beta, initial_state, scale, fla_options)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if use_qk_l2norm_in_kernel:
        k = l2_normalize(k)  # in float32, rounded to v's dtype by the function: autograd takes dk through it
    q = scaled_queries(q, scale, use_qk_l2norm_in_kernel)  # o = S (scale q), likewise
    if chunk_size is None:
        chunk_size = CUDA_CHUNK_SIZE if q.is_cuda else CPU_CHUNK_SIZE
    if q.is_cuda:  # stage 5's kernels read the gates in float32
        g, beta = g.float(), beta.float()
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    initial_state = None if initial_state is None else initial_state.contiguous()
    o, final_state = ChunkKDAFunction.apply(q, k, v, g, beta, initial_state, chunk_size, checks, disable_recompute)
    return o, (final_state if output_final_state else None)
# --8<-- [end:chunk_kda]


# --8<-- [start:function]
class ChunkKDAFunction(torch.autograd.Function):
    """(q, k, v, g, beta, initial_state, chunk_size, checks, keep_prepared) -> (o, final_state), and the
    way back.

    The final state is always an output, so that a loss on it sends its gradient dS_T^T into the
    backward; when nobody uses it, that gradient is None and the backward starts from zero.
    keep_prepared (CUDA): the forward's prepare outputs are saved beside the inputs, for the backward.
    q and k may come wider than v (chunk_kda's scale and norm, in float32): they are rounded to v's
    dtype here, once, and their gradients go back in their own dtype, unrounded (the backward kernels
    give dq and dk in fp32), so that the norm's backward in front runs on them in float32 and the
    caller's q and k receive one rounding, as in FLA's chunk_kda.
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, chunk_size, checks, keep_prepared):
        ctx.set_materialize_grads(False)  # an unused output's gradient arrives as None, not as zeros
        ctx.chunk_size = chunk_size
        ctx.input_dtypes = [None if x is None else x.dtype for x in (q, k, v, g, beta, initial_state)]
        q, k = q.to(v.dtype), k.to(v.dtype)
        prepared = None
        if q.is_cuda:
            o, final_state, prepared = _cuda_forward(q, k, v, g, beta, initial_state, chunk_size, checks,
                                                     keep_prepared)
        else:
            o, final_state = _cpu_forward(q, k, v, g, beta, initial_state, chunk_size)
        ctx.save_for_backward(q, k, v, g, beta, initial_state, *(prepared or ()))
        return o, final_state

    @staticmethod
    def backward(ctx, do, d_final_state):
        q, k, v, g, beta, initial_state, *prepared = ctx.saved_tensors
        if do is None:  # only the final state reached the loss
            do = torch.zeros(*q.shape[:3], v.shape[3], dtype=v.dtype, device=v.device)
        if q.is_cuda:
            gradients = _cuda_backward(q, k, v, g, beta, do, initial_state, d_final_state, ctx.chunk_size,
                                       prepared or None)
        else:
            gradients = _cpu_backward(q, k, v, g, beta, do, initial_state, d_final_state, ctx.chunk_size)
        gradients = [None if dtype is None else grad.to(dtype) for grad, dtype in zip(gradients, ctx.input_dtypes)]
        return *gradients, None, None, None
# --8<-- [end:function]


# --8<-- [start:cpu_path]
def _cpu_forward(q, k, v, g, beta, initial_state, chunk_size):
    """Stage 5's forward in NumPy float64 (prepare, then recurrence: the kernels' control flow).

    sub_block=1: each key is a slab of its own, anchored at the row below it, so every factor of
    the scores is at most 1 and any gate <= 0 runs. A sub-block of the whole chunk, anchored at its
    middle row, overflowed float64 (NaN) where half a chunk's gates summed below -709: Kimi Linear's
    unbounded gate does that (-100 a token at C = 16)."""
    arrays = [_float64(x) for x in (q, k, v, g, beta)]
    tensors = forward_reference.prepare(*arrays, chunk_size, sub_block=1)
    o, final_state = forward_reference.recurrence(tensors, block_dv=v.shape[3],
                                                  initial_state=_float64_or_none(initial_state))
    o = o[:, :q.shape[1]]  # prepare pads T up to a multiple of chunk_size
    return _like(o, v), _like(final_state, _state_reference(q, initial_state))


def _cpu_backward(q, k, v, g, beta, do, initial_state, d_final_state, chunk_size):
    """Stage 6's reference B in NumPy float64: the chunks in reverse, each recomputed from its start state.
    The six gradients in float64 on q's device (dS_0^T's None without an initial state)."""
    result = backward_reference.chunkwise_backward(
        *[_float64(x) for x in (q, k, v, g, beta, do)], chunk_size,
        initial_state=_float64_or_none(initial_state), d_final_state=_float64_or_none(d_final_state))
    gradients = (result.dq, result.dk, result.dv, result.dg, result.dbeta,
                 None if initial_state is None else result.d_initial_state)
    return tuple(None if grad is None else torch.from_numpy(np.ascontiguousarray(grad)).to(q.device)
                 for grad in gradients)
# --8<-- [end:cpu_path]


# --8<-- [start:cuda_path]
def _cuda_forward(q, k, v, g, beta, initial_state, chunk_size, checks, keep_prepared=False):
    """The forward's two kernels: (o, final state fp32, the prepare's outputs with keep_prepared, else None)."""
    config = resolve_for(q.device, q.shape[0], q.shape[2], q.shape[3], v.shape[3], chunk_size=chunk_size)
    return forward_and_prepared(q, k, v, g, beta, initial_state, checks, config, keep_prepared)


def _cuda_backward(q, k, v, g, beta, do, initial_state, d_final_state, chunk_size, prepared=None):
    """Stage 6's backward kernels: dq, dk (fp32), dv (q's dtype), dg, dbeta, dS_0^T (fp32; None without
    an initial state); prepared: the forward's prepare outputs, kept (disable_recompute), or None. g's
    and beta's values were checked by the forward (checks), so the backward skips that pass and its
    device sync."""
    config = resolve_for(q.device, q.shape[0], q.shape[2], q.shape[3], v.shape[3], chunk_size=chunk_size)
    if d_final_state is not None:
        d_final_state = d_final_state.float().contiguous()
    *gradients, d_initial_state = backward(q, k, v, g, beta, do.contiguous(), initial_state=initial_state,
                                           d_final_state=d_final_state, checks="off", config=config,
                                           prepared=prepared)
    return *gradients, None if initial_state is None else d_initial_state
# --8<-- [end:cuda_path]


def _refuse_unsupported(fla_options):
    for name, value in fla_options.items():
        if name not in REFUSED:
            raise TypeError(f"chunk_kda() got an unexpected keyword argument {name!r}")
        refused = REFUSED[name]
        if value is not refused.default:  # every default is None or False
            raise NotImplementedError(f"chunk_kda does not support {name}={value!r}: {refused.why}")


def check_chunk_kda_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None, scale: float | None = None,
                           fla_options: dict | None = None) -> None:
    """chunk_kda's own checks: FLA's options the course refuses (REFUSED), then types, ranks, dtypes
    and one device for all. Shapes and values are checked by the path that runs (stage 5's
    check_forward_inputs on CUDA, the references' checks on the CPU).

    Contiguity is not asked (check_kernel_tensor asks it of a contiguous copy): chunk_kda makes its
    inputs contiguous itself, as FLA's does.
    """
    _refuse_unsupported(fla_options or {})
    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": initial_state}
    for name, x in tensors.items():
        if name == "initial_state" and x is None:
            continue
        check_kernel_tensor(name, x.contiguous() if isinstance(x, torch.Tensor) else x, rank=3 if name == "beta" else 4,
                            dtypes=STATE_DTYPES if name == "initial_state" else INPUT_DTYPES)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {dtype_name(q)}, {dtype_name(k)} and {dtype_name(v)}")
    devices = {name: x.device for name, x in tensors.items() if x is not None}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")
    if q.device.type not in ("cpu", "cuda"):
        raise ValueError(f"chunk_kda runs on CUDA (the kernels) or on the CPU (the references), got device {q.device}")
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__} (initial_state is a "
                        f"keyword argument, as in FLA: chunk_kda(q, k, v, g, beta, initial_state=...))")


def l2_normalize(x, scale=1.0):
    """scale * x / sqrt(||x||^2 + eps) along the last axis, in float32 at least, not rounded back to x's
    dtype (ChunkKDAFunction rounds it, once)."""
    wide = x.to(torch.promote_types(x.dtype, torch.float32))
    return wide * (scale * torch.rsqrt((wide * wide).sum(-1, keepdim=True) + L2_NORM_EPS))


def scaled_queries(q, scale, l2norm):
    """scale * q, L2-normalized first with l2norm: (B, T, H, K) in float32 at least (q itself where
    there is nothing to do), for ChunkKDAFunction to round to v's dtype once.

    FLA applies the scale inside its kernels, in fp32. The kernels here take q as it is, so the product
    is formed in float32 and rounded once; formed in bf16 after the norm's own rounding, it added a
    rounding to q (o and the final state carried it) and two more to dq on the way back (1.19 times
    FLA's error in dq, measured on the H200: docs, stage 6)."""
    if l2norm:
        return l2_normalize(q, scale)
    if scale == 1.0:
        return q
    return q.to(torch.promote_types(q.dtype, torch.float32)) * scale


def _state_reference(q, initial_state):
    """The tensor whose dtype the final state takes on the CPU: initial_state's, else float32 (float64 for float64 q)."""
    if initial_state is not None:
        return initial_state
    return q.new_empty((), dtype=torch.promote_types(q.dtype, torch.float32))


def _float64(x):
    return x.detach().to("cpu", torch.float64).contiguous().numpy()


def _float64_or_none(x):
    return None if x is None else _float64(x)


def _like(array, x):
    """A NumPy float64 result as a torch tensor of x's dtype and device."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device=x.device, dtype=x.dtype)
