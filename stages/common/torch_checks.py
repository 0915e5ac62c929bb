"""Input checks for the kernels' torch-facing wrappers.

Every failure raises an error that names the argument and says what was expected: a kernel fed a
wrong tensor otherwise reads out of bounds or returns garbage without a word.
"""

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
    """Every tensor of {name: tensor} is on one CUDA device."""
    devices = {name: x.device for name, x in tensors.items()}
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
