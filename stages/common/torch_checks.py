"""Input checks for the kernels' torch-facing wrappers.

Every failure raises an error that names the argument and says what was expected: a kernel fed a
wrong tensor otherwise reads out of bounds or returns garbage without a word.
"""

import math

KERNEL_DTYPES = ("float16", "bfloat16")


def check_kernel_tensor(name, x, rank, dtypes=KERNEL_DTYPES):
    """x is a contiguous torch tensor of the given rank and one of `dtypes` (names).

    The device is checked apart, by check_on_cuda, after the checks between tensors: that order lets
    every other mistake be shown, and tested, on a machine without a GPU.
    """
    import torch

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(f"{name} must have rank {rank}, got shape {tuple(x.shape)}")
    dtype_name = str(x.dtype).removeprefix("torch.")
    if dtype_name not in dtypes:
        raise TypeError(f"{name} must have dtype {' or '.join(dtypes)}, got {dtype_name}")
    if not x.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() first); its strides are {tuple(x.stride())}")


def check_on_cuda(tensors):
    """Every tensor of {name: tensor} is on one CUDA device (a None, an optional tensor left out, is skipped)."""
    devices = {name: x.device for name, x in tensors.items() if x is not None}
    for name, device in devices.items():
        if device.type != "cuda":
            raise ValueError(f"{name} must be on a CUDA device, got device {device}")
    if len(set(devices.values())) > 1:
        raise ValueError(f"all inputs must be on one device, got {devices}")


def check_same(name, x, reference_name, reference, what="shape"):
    """x has the same `what` ("shape" or "dtype") as `reference`."""
    if what == "shape":
        ours, theirs = tuple(x.shape), tuple(reference.shape)
    else:
        ours, theirs = getattr(x, what), getattr(reference, what)
    if ours != theirs:
        raise ValueError(f"{name} must have the {what} of {reference_name}, {theirs}; got {ours}")


def check_tile_sizes(d_k, d_v, chunk_size, block_dv):
    """Tile sizes the tensor cores accept: multiples of 16, block_dv dividing d_v."""
    if chunk_size < 16 or chunk_size % 16:
        raise ValueError(f"chunk_size must be a multiple of 16, got {chunk_size}")
    if d_k % 16:
        raise ValueError(f"d_k must be a multiple of 16, got {d_k}")
    if block_dv < 16 or block_dv % 16 or d_v % block_dv:
        raise ValueError(f"block_dv must be a multiple of 16 that divides d_v = {d_v}, got {block_dv}")


# ------------------------------------------------------------------ what every stage's forward checks

GATE_DTYPES = ("float32",)


def dtype_name(x):
    """'float16' for a torch.float16 tensor: the name the kernels are built for."""
    return str(x.dtype).removeprefix("torch.")


def check_qkv(q, k, v):
    """q, k: (B, N, H, d_k) and v: (B, N, H, d_v), contiguous, of one dtype, fp16 or bf16.

    Returns (B, N, H, d_k, d_v). Types, ranks and dtypes first, then shapes, then dtypes between tensors.
    """
    check_kernel_tensor("q", q, rank=4)
    check_kernel_tensor("k", k, rank=4)
    check_kernel_tensor("v", v, rank=4)
    check_same("k", k, "q", q, "shape")
    B, N, H, d_k = q.shape
    if tuple(v.shape[:3]) != (B, N, H):
        raise ValueError(f"v must be (B, N, H, d_v) = ({B}, {N}, {H}, d_v), got {tuple(v.shape)}")
    check_same("k", k, "q", q, "dtype")
    check_same("v", v, "q", q, "dtype")
    return B, N, H, d_k, v.shape[3]


def check_gate(name, x, shape, axes):
    """x is a contiguous float32 tensor of the given shape; `axes` names its axes, "(B, N, H)" say."""
    check_kernel_tensor(name, x, rank=len(shape), dtypes=GATE_DTYPES)
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {axes} = {tuple(shape)}, got {tuple(x.shape)}")


# --8<-- [start:gate_values]
def check_gate_values(g, beta=None):
    """g = log(a) finite and <= 0 (a decay, never a growth), beta (if given) in [0, 1]: one read of
    both to the host, one device sync (g None: beta alone). Returns g's smallest entry (0.0 for an empty g), which the
    kernels' range checks read.

    g > 0 is a growth, not a decay: a^(r - j) > 1 grows without bound along the sequence.
    g = -inf (a = 0) is a valid limit of the math (the state keeps the current token only) but not of
    the kernels: a decay table's diagonal is exp2(0 * -inf) = NaN. A large negative g, -1e4 say,
    gives a = 0 exactly in float32 and the same outputs.
    """
    import torch

    # one pass over each tensor (torch.aminmax) and one sync for all four numbers; a NaN makes its
    # tensor's min and max NaN, and NaN fails every comparison below
    extremes = [torch.aminmax(x.detach()) if x.numel() else (x.new_zeros(()), x.new_zeros(())) for x in (g, beta)
                if x is not None]
    if not extremes:
        return 0.0
    spans = torch.stack([value.float() for pair in extremes for value in pair]).tolist()
    g_min, g_max, *beta_span = spans if g is not None else [0.0, 0.0, *spans]
    bad_gate = not (g_max <= 0 and g_min > -math.inf)
    bad_beta = bool(beta_span) and not (beta_span[0] >= 0 and beta_span[1] <= 1)
    if bad_gate:
        raise ValueError(f"g must be finite and <= 0 (g = log(a), 0 < a <= 1; for a = 0 use a large negative g "
                         f"such as -1e4, since g = -inf makes exp2(0 * -inf) = NaN); its largest entry is "
                         f"{g.max().item():.3g}")
    if bad_beta:
        raise ValueError(f"beta must lie in [0, 1]; its entries span [{beta.min().item():.3g}, {beta.max().item():.3g}]")
    return g_min
# --8<-- [end:gate_values]


SLOT_DTYPES = ("int32",)


def check_slots(slots, B):
    """slots is a contiguous int32 tensor of shape (B,): one slot of the state pool per sequence."""
    check_kernel_tensor("slots", slots, rank=1, dtypes=SLOT_DTYPES)
    if tuple(slots.shape) != (B,):
        raise ValueError(f"slots must have shape (B,) = ({B},), one slot per sequence, got {tuple(slots.shape)}")


def check_slot_values(slots, P):
    """Every slot in [0, P) and no two equal: one read of three numbers to the host, one device sync.

    A slot out of range reads and writes another tensor's memory; two equal slots make two programs
    write one state, and which one wins is undefined.
    """
    import torch

    if slots.numel() == 0:
        return
    ordered = torch.sort(slots).values
    repeated = (ordered[1:] == ordered[:-1]).any() if slots.numel() > 1 else ordered.new_zeros((), dtype=torch.bool)
    lowest, highest, has_repeat = torch.stack([ordered[0].long(), ordered[-1].long(), repeated.long()]).tolist()
    if lowest < 0 or highest >= P:
        raise ValueError(f"slots must lie in [0, P) = [0, {P}), the pool's slots; they span [{lowest}, {highest}]")
    if has_repeat:
        duplicate = ordered[1:][ordered[1:] == ordered[:-1]][0].item()
        raise ValueError(f"slots must be distinct (one state per sequence), got slot {duplicate} more than once")


def pad_tokens(N_padded, *tensors):
    """The tensors zero-padded along their token axis (axis 1) to N_padded tokens. Exact for the
    course's kernels: a padded token has q = k = v = 0, g = 0 and beta = 0, and its outputs are cut off."""
    import torch

    return [x if x.shape[1] == N_padded else
            torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, N_padded - x.shape[1])) for x in tensors]


CU_SEQLENS_DTYPES = ("int32", "int64")


def check_cu_seqlens(cu_seqlens, B):
    """cu_seqlens: a contiguous int32 or int64 tensor (N_seq + 1,) of offsets into a packed batch of
    B = 1 row, FLA's convention. Its type and shape only: nothing is read from the device (the values
    are check_cu_seqlens_values's, or the device's: stages.kda.calls.varlen_index)."""
    check_kernel_tensor("cu_seqlens", cu_seqlens, rank=1, dtypes=CU_SEQLENS_DTYPES)
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must have shape (N_seq + 1,) with N_seq >= 1, got {tuple(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"with cu_seqlens the sequences are packed into one row: B must be 1, got B = {B}")


def check_cu_seqlens_values(cu_seqlens, T):
    """cu_seqlens's offsets run from 0 to T, the packed tokens, never decreasing (a sequence may be
    empty). Reads them to the host: one device sync."""
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != T or any(end < start for start, end in zip(offsets, offsets[1:])):
        shown = offsets if len(offsets) <= 8 else offsets[:8] + ["..."]
        raise ValueError(f"cu_seqlens must start at 0, never decrease and end at T = {T}, the packed tokens; "
                         f"got {shown}")
