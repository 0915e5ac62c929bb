"""FLA 0.6.0's options of `chunk_kda` and `fused_recurrent_kda`, as the course takes them.

A model's whole call to KDA is in these options: FLA's `KimiDeltaAttention` passes the raw gate
projection, q and k unnormalized, beta's logits, the states V first, and packed sequences. The course's
kernels compute the same things from one `InputForm` (stages.kda.inputs); this module maps FLA's flags
onto it and keeps FLA's rules on the flags, with FLA's messages, so that a call FLA refuses is refused
here with the same words:

    use_qk_l2norm_in_kernel                      form.l2_normalize
    scale (None: 1 / sqrt(K))                    form.scale
    use_gate_in_kernel, A_log, dt_bias           form.gate "softplus"; with lower_bound, "sigmoid"
    use_beta_sigmoid_in_kernel (allow_neg_eigval) form.beta "sigmoid" ("sigmoid2": 2 sigmoid(beta))
    safe_gate                                    FLA's promise that g lies in [lower_bound, 0), which
                                                 lets its kernels take faster tiles; the course's kernels
                                                 take any gate, so it changes nothing but FLA's rule on
                                                 lower_bound with use_gate_in_kernel
    state_v_first (transpose_state_layout)       states (.., V, K): the course transposes in and out
    chunk_size (32 or 64)                        the kernels' chunk

Without use_gate_in_kernel FLA drops A_log and dt_bias (g is the log gate itself) and lower_bound has
no effect on the values; the course does the same.
"""

import math
import warnings
from typing import TYPE_CHECKING

from stages.kda.inputs import InputForm

if TYPE_CHECKING:
    import torch

CHUNK_SIZES = (32, 64)  # FLA's chunk_kda takes these and no other
MAX_KEY_DIM = 256  # FLA's chunk_kda refuses larger K
SAFE_GATE_RANGE = (-5.0, 0.0)  # lower_bound's range with safe_gate and use_gate_in_kernel: [-5, 0)
CPU_DTYPES = ("float16", "bfloat16", "float32", "float64")  # the CPU computes in float64 whatever it gets
CUDA_DTYPES = ("float16", "bfloat16")  # q, k, v on the chunked kernels: their GEMMs take these
STATE_DTYPES = ("float32", "float64")  # FLA's states are float32; float64 too on the CPU, for exact checks


def input_form(K: int, scale: float | None, use_qk_l2norm_in_kernel: bool, use_gate_in_kernel: bool,
               use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool, lower_bound: float | None) -> InputForm:
    """The InputForm of FLA's flags (see the module's docstring); K: the caller's key head dim, for
    FLA's default scale 1 / sqrt(K)."""
    if scale is not None and (not isinstance(scale, (int, float)) or isinstance(scale, bool)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__} (initial_state is a "
                        f"keyword argument, as in FLA: chunk_kda(q, k, v, g, beta, initial_state=...))")
    gate = "log"
    if use_gate_in_kernel:
        gate = "softplus" if lower_bound is None else "sigmoid"
    beta = "value"
    if use_beta_sigmoid_in_kernel:
        beta = "sigmoid2" if allow_neg_eigval else "sigmoid"
    return InputForm(gate=gate, lower_bound=lower_bound if use_gate_in_kernel else None,
                     l2_normalize=use_qk_l2norm_in_kernel, beta=beta,
                     scale=float(1.0 / math.sqrt(K) if scale is None else scale))


def state_v_first_of(state_v_first: bool, transpose_state_layout: bool | None) -> bool:
    """FLA's deprecated name for state_v_first, taken as FLA takes it: with a warning, never both."""
    if transpose_state_layout is None:
        return state_v_first
    if state_v_first:
        raise ValueError("Cannot pass both `state_v_first` and the deprecated `transpose_state_layout`.")
    warnings.warn("`transpose_state_layout` is deprecated and renamed to `state_v_first`.", DeprecationWarning,
                  stacklevel=3)
    return bool(transpose_state_layout)


def check_tensors(tensors: "dict[str, torch.Tensor | None]", state_names: tuple[str, ...] = ("initial_state",),
                  cuda_dtypes: tuple[str, ...] = CUDA_DTYPES) -> None:
    """Types and dtypes of a call's tensors ({name: tensor or None}; None is an option left out), and one
    device for all: q, k, v of one dtype, one of cuda_dtypes on CUDA (the chunked kernels' by default;
    fused_recurrent_kda passes its decode kernel's, stages.kda.checks.DECODE_DTYPES) and any float on
    the CPU (computed in float64); states float32 (float64 too on the CPU); the rest any float dtype.
    CUDA is what the route takes (q.is_cuda), so that stages.kda.on_cpu's stand-in runs these checks as
    a GPU does."""
    import torch

    given = {name: x for name, x in tensors.items() if x is not None}
    for name, x in given.items():
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    devices = {name: x.device for name, x in given.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")
    device = tensors["q"].device
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"KDA runs on CUDA (the kernels) or on the CPU (the references), got device {device}")
    on_cuda = tensors["q"].is_cuda
    for name, x in given.items():
        if name in state_names:
            allowed, role = ("float32",) if on_cuda else STATE_DTYPES, "a state"
        elif name in ("q", "k", "v") and on_cuda:
            allowed, role = cuda_dtypes, "the kernels' inputs"
        else:
            allowed, role = CPU_DTYPES, "a float tensor"
        dtype = str(x.dtype).removeprefix("torch.")
        if dtype not in allowed:
            raise TypeError(f"{name} must have dtype {' or '.join(allowed)} ({role}{' on CUDA' if on_cuda else ''}), "
                            f"got {dtype}")
    q, k, v = tensors["q"], tensors["k"], tensors["v"]
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype} and {v.dtype}")


def check_shapes(q: "torch.Tensor", k: "torch.Tensor", v: "torch.Tensor", g: "torch.Tensor",
                 beta: "torch.Tensor") -> tuple[int, int, int, int, int, int]:
    """FLA's shapes: q, k (B, T, H, K); v (B, T, HV, V); g (B, T, HV, K); beta (B, T, HV); HV a multiple
    of H (grouped value heads: value head j reads q and k of head j // (HV // H)); K at most 256.
    Returns (B, T, H, K, HV, V)."""
    for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        if x.dim() != rank:
            raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)}, got {tuple(k.shape)}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must be (B, T, HV, V) = ({B}, {T}, HV, V), got {tuple(v.shape)}")
    HV, V = v.shape[2:]
    if K > MAX_KEY_DIM:
        raise ValueError(f"Currently we only support key headdim <={MAX_KEY_DIM} for KDA, got {K}.")
    if HV % H:
        raise ValueError(f"For GVA, num_v_heads (HV={HV}) must be evenly divisible by num_qk_heads (H={H}), "
                         f"but got HV % H = {HV % H}")
    if tuple(g.shape) != (B, T, HV, K):
        raise ValueError(f"g must have shape [B, T, HV, K]={[B, T, HV, K]}, got {list(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta must have shape [B, T, HV]={[B, T, HV]}, got {list(beta.shape)}")
    return B, T, H, K, HV, V


def check_packing(q: "torch.Tensor", initial_state: "torch.Tensor | None", cu_seqlens: "torch.Tensor | None") -> None:
    """FLA's two rules on a packed batch: one row, and one initial state per sequence."""
    if cu_seqlens is None:
        return
    if cu_seqlens.dim() != 1 or cu_seqlens.dtype not in _integer_dtypes():
        raise TypeError(f"cu_seqlens must be a 1-D int32 or int64 tensor, got {cu_seqlens.dtype} of shape "
                        f"{tuple(cu_seqlens.shape)}")
    if q.shape[0] != 1:
        raise ValueError(f"The batch size is expected to be 1 rather than {q.shape[0]} when using `cu_seqlens`."
                         f"Please flatten variable-length inputs before processing.")
    if initial_state is not None and initial_state.shape[0] != len(cu_seqlens) - 1:
        raise ValueError(f"The number of initial states is expected to be equal to the number of input sequences, "
                         f"i.e., {len(cu_seqlens) - 1} rather than {initial_state.shape[0]}.")


def check_state_shape(initial_state: "torch.Tensor | None", N: int, HV: int, K: int, V: int,
                      state_v_first: bool) -> None:
    """initial_state is (N, HV, K, V), or (N, HV, V, K) with state_v_first."""
    if initial_state is None:
        return
    expected = (N, HV, V, K) if state_v_first else (N, HV, K, V)
    if tuple(initial_state.shape) != expected:
        axes = "(N, HV, V, K), V first" if state_v_first else "(N, HV, K, V)"
        raise ValueError(f"initial_state must have shape {axes} = {expected}, got {tuple(initial_state.shape)}")


def check_gate_options(use_gate_in_kernel: bool, A_log: "torch.Tensor | None", lower_bound: float | None,
                       safe_gate: bool) -> None:
    """FLA's rules on the in-kernel gate: A_log unless the bounded form, and with safe_gate a lower_bound
    in [-5, 0)."""
    if use_gate_in_kernel and A_log is None and lower_bound is None:
        raise ValueError("`A_log` must be provided when `use_gate_in_kernel=True` and `lower_bound` is not set.")
    if safe_gate and use_gate_in_kernel:
        if lower_bound is None:
            raise ValueError("`lower_bound` must be specified when `safe_gate=True` and `use_gate_in_kernel=True`.")
        if not SAFE_GATE_RANGE[0] <= lower_bound < SAFE_GATE_RANGE[1]:
            raise ValueError(f"`lower_bound` must be in the safe range [-5, 0), got {lower_bound}.")


def check_gate_parameters(A_log: "torch.Tensor | None", dt_bias: "torch.Tensor | None", HV: int, K: int) -> None:
    """A_log (HV,) and dt_bias (HV * K,) or (HV, K), as FLA's layer keeps them (one per value head)."""
    if A_log is not None and A_log.numel() != HV:
        raise ValueError(f"A_log must have HV = {HV} entries (one per value head), got shape {tuple(A_log.shape)}")
    if dt_bias is not None and dt_bias.numel() != HV * K:
        raise ValueError(f"dt_bias must have HV * K = {HV * K} entries, (HV * K,) or (HV, K), got shape "
                         f"{tuple(dt_bias.shape)}")


def check_chunk_size(chunk_size: int) -> None:
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"`chunk_size` must be either 32 or 64 for KDA, got {chunk_size}.")


def check_beta_options(use_beta_sigmoid_in_kernel: bool, allow_neg_eigval: bool) -> None:
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`.")


def to_kernel_layout(state: "torch.Tensor | None", state_v_first: bool) -> "torch.Tensor | None":
    """A state (.., V, K) with state_v_first as S^T (.., K, V), the course's layout; the same view back."""
    return state.transpose(-1, -2) if state is not None and state_v_first else state


def _integer_dtypes():
    import torch

    return (torch.int32, torch.int64)
