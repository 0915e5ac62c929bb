"""Value checks on the device: what only the data can tell, found without a host sync.

A shape, a dtype or a device is known on the host and checked there. Whether a log gate is above 0,
a beta outside [0, 1], a value NaN, a slot outside the pool or offsets `cu_seqlens` out of order only
the data can tell, and reading the data to the host costs a device sync on every call: at decode,
213 us on a 77 us step, and a call that syncs cannot be captured in a CUDA graph, which is how
servers run decode. So the kernels check the values they read anyway, as they read them, and set a
flag in `Flags` (FLAG_COUNT int32, one per kind of bad value, only ever set to 1; prefill's
cu_seqlens are checked by the device ops that build its chunk table). The flags live in a small
tensor per device that the caller passes to every call; nothing is read back per call.

The flags are read where the caller synchronizes anyway: `raise_if_flagged(device)` waits for the
device, and raises ValueError naming what was wrong (clearing the flags). A server calls it where
it reads a step's output (it syncs there already: the sampled tokens go to the host), a training
loop where it logs the loss, a test after the call. Until then a bad value costs nothing but its
own wrong outputs: the kernels write nothing outside their tensors whatever the values (a slot
outside the pool is read as slot 0 and written nowhere; offsets out of order are read as the nearest
ordered ones inside the batch).

The flags are sticky: a call never clears them, so a CUDA graph replayed a thousand times reports a
bad value of any replay at the next raise_if_flagged.

Every fast call (stage 5's forward, stage 6's chunk_kda, stage 7's prefill and decode) takes one of
CHECKS: "device" (the default: the kernels flag, nothing is read per call), "host" (the values read
to the host and refused before any kernel runs: a sync per call, the mode to debug a caller with) or
"off" (the caller vouches for the values: kernels built without the flags, what the benchmarks time
as unchecked).
"""

BAD_GATE, BAD_BETA, BAD_SLOT, BAD_CU_SEQLENS = range(4)
FLAG_COUNT = 4
CHECKS = ("device", "host", "off")
# Stages 2-4's kernels carry no flags: their forward checks the values on the host or not at all.
HOST_CHECKS = ("host", "off")
MESSAGES = {
    BAD_GATE: "g must be finite and <= 0 (g = log(a), 0 < a <= 1; for a = 0 use a large negative g such as "
              "-1e4): a call saw a g above 0, NaN or -inf",
    BAD_BETA: "beta must lie in [0, 1]: a call saw a beta outside it or NaN",
    BAD_SLOT: "slots must lie in [0, P): a call saw a slot outside the pool (its sequence was not advanced)",
    BAD_CU_SEQLENS: "cu_seqlens must start at 0, never decrease and end at T, the packed tokens: a call saw one "
                    "that does not (read as the nearest such offsets: no token outside the batch was touched, but "
                    "its outputs are not the batch's)",
}


def check_mode(checks, modes=CHECKS):
    """checks is one of `modes`: CHECKS (see above) for the fast calls, HOST_CHECKS for stages 2-4."""
    if checks not in modes:
        raise ValueError(f"checks must be one of {', '.join(map(repr, modes))}, got {checks!r}")


def bad_gate(g, dtype="float32"):
    """The TIR condition, in a kernel, that a log gate g (a `dtype` value it loaded) is bad: NaN,
    above 0, or -inf (a decay table's exp2(0 * -inf) would be NaN).

    NaN is asked for by name: "not (g <= 0)" would hold for it, but TVM's simplifier rewrites that
    as "g > 0", false for NaN, and the CUDA kernel would miss it (the interpreter, which runs the
    program before that rewrite, would not)."""
    import tilelang.language as T

    return T.Or(T.isnan(g), T.Or(g > 0, g < -T.max_value(dtype)))


def bad_beta(beta, bound=1):
    """The TIR condition, in a kernel, that a beta it loaded is NaN or lies outside [0, bound] (NaN by
    name, as in bad_gate): bound 1, or 2 where FLA's allow_neg_eigval takes beta to [0, 2)."""
    import tilelang.language as T

    return T.Or(T.isnan(beta), T.Or(beta < 0, beta > bound))


def flags_for(device):
    """The flags of `device` (a torch.device or its name): a (FLAG_COUNT,) int32 tensor on it, one per
    device for the whole process, zeros until a kernel flags a bad value.

    Made by the first call on a device, which must not be inside a CUDA graph's capture: the tensor
    would live in the graph's memory and its zeroing would be captured, so that every replay cleared
    the flags. A capture follows a warm-up call anyway (the kernels compile on their first call). Made
    outside inference mode whatever mode that call is in: an inference tensor could not be cleared by a
    later call outside it (a server's first call is often under torch.inference_mode, a training step's
    is not)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if str(device) not in _FLAGS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"the value flags of {device} are made by the first checked call, which must not be "
                               f"captured in a CUDA graph: make one call before the capture")
        with torch.inference_mode(False):
            _FLAGS[str(device)] = torch.zeros(FLAG_COUNT, dtype=torch.int32, device=device)
    return _FLAGS[str(device)]


_FLAGS = {}  # device name -> its flags (flags_for)


def raise_if_flagged(device):
    """Raise ValueError for the bad values the kernels flagged on `device` since the flags were last
    cleared (every call queued before this one), and clear them. One device sync."""
    flags = flags_for(device)
    seen = flags.tolist()  # the sync
    if any(seen):
        flags.zero_()
        raise ValueError("; ".join(MESSAGES[kind] for kind, flagged in enumerate(seen) if flagged))
