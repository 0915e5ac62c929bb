"""The course's kernels as a backend of FLA 0.6.0: one import, and FLA's KDA runs on them.

    import stages.kda.fla_backend  # noqa: F401   (after that, FLA's chunk_kda and fused_recurrent_kda
                                   # dispatch here wherever the course takes the call)

FLA's backend registry (fla/backends.py) lets a package serve a dispatched function: FLA's `chunk_kda`
(decorated `@dispatch`) and FLA's `fused_recurrent_kda_fwd` (`@dispatch('kda')`, the function FLA's
`fused_recurrent_kda` calls and servers call directly). On each call FLA walks the registered backends
in order of priority (lower first; FlashKDA's is 3), skips those unavailable or switched off by their
environment variable, and asks each `<function>_verifier(*args, **kwargs)` whether it takes this call;
the first that says yes runs it, and if none does FLA's own Triton kernels run. A refusal is logged
once per backend and function, at INFO on the logger "fla.backends":

    [FLA Backend] fla.ops.kda.chunk.chunk_kda -> kdacourse rejected: <the reason>

The verifiers here run the course's own argument checks (stages.kda.autograd.plan_chunk_kda,
stages.kda.fused_recurrent.plan_fused_recurrent_kda_fwd) and on CUDA the kernels' size rules, so a
call is taken exactly when the course's chunk_kda would run it, and the reason of a refusal is the
course's error message. They read no tensor's values (no device sync), except the offsets and slot
indices that a packed backward or a pool of states needs on the host.

What is taken: CUDA calls in fp16 or bf16 with float32 states, for training and inference, every
FLA option of chunk_kda but `cp_context` (and `use_graph` with autograd on packed sequences), and
fused_recurrent_kda_fwd but beta per value column, in float32 too (the decode kernel token by token in
fp32, as FLA's fused_recurrent computes); CPU calls too (the float64 references: slow, exact, where
FLA's Triton kernels do not run at all). What falls back, and why, is the refusal's message: float32
q, k, v in chunk_kda on CUDA (its kernels' GEMMs take fp16 and bf16), context parallelism, FLA's own
argument errors (a `chunk_size` of 16, `A_log` missing: FLA's function then raises its own message).

Switched off with FLA_KDACOURSE=0 in the environment (FLA's convention for a backend's variable).
"""

import math

from stages.kda.autograd import KERNEL_MULTIPLE, chunk_kda, plan_chunk_kda
from stages.kda.fused_recurrent import DEFAULT_CHUNK_SIZE, fused_recurrent_kda_fwd, plan_fused_recurrent_kda_fwd

BACKEND_TYPE = "kdacourse"
ENV_VAR = "FLA_KDACOURSE"
PRIORITY = 2  # before FlashKDA (3): a caller who imports this module asks for the course's kernels


# --8<-- [start:verifiers]
def chunk_kda_verifier(*args, **kwargs) -> tuple[bool, str | None]:
    """(True, None) when the course's chunk_kda runs this call of FLA's, else (False, why)."""
    try:
        plan = plan_chunk_kda(*args, **kwargs)
        q, v = plan.inputs[0], plan.inputs[2]
        if q.is_cuda:
            check_kernel_sizes(q.shape[3], v.shape[3], plan.run.chunk_size)
    except (TypeError, ValueError, NotImplementedError) as error:
        return False, str(error)
    return True, None


def fused_recurrent_kda_fwd_verifier(*args, **kwargs) -> tuple[bool, str | None]:
    """(True, None) when the course's fused_recurrent_kda_fwd runs this call of FLA's, else (False, why)."""
    try:
        plan_fused_recurrent_kda_fwd(*args, **kwargs)
        q, v = _tensor(args, kwargs, 0, "q"), _tensor(args, kwargs, 2, "v")
        if q.is_cuda:
            check_kernel_sizes(q.shape[3], v.shape[3], DEFAULT_CHUNK_SIZE)
    except (TypeError, ValueError, NotImplementedError) as error:
        return False, str(error)
    return True, None
# --8<-- [end:verifiers]


def check_kernel_sizes(K: int, V: int, chunk_size: int) -> None:
    """The kernels' size rules on K and V as the course pads them (to multiples of 32), and the chunk."""
    from stages.kda.checks import check_kernel_sizes as check_sizes
    from stages.kda.config import DEFAULT_BLOCK_DV

    d_k, d_v = (math.ceil(x / KERNEL_MULTIPLE) * KERNEL_MULTIPLE for x in (K, V))
    check_sizes(d_k, d_v, chunk_size, DEFAULT_BLOCK_DV)


def _tensor(args, kwargs, position, name):
    return args[position] if len(args) > position else kwargs[name]


def register_with_fla() -> bool:
    """Register the backend for FLA's chunk_kda and for the 'kda' operations (fused_recurrent_kda_fwd);
    False where FLA is not installed (nothing to register with)."""
    try:
        from fla.backends import BaseBackend, register
        from fla.ops.kda.chunk import chunk_kda as fla_chunk_kda
    except ImportError:
        return False

    class KDACourseBackend(BaseBackend):
        """The course's TileLang kernels (CUDA) and float64 references (CPU) for FLA's KDA."""

        backend_type = BACKEND_TYPE
        package_name = None  # the course is importable, or this module would not be
        env_var = ENV_VAR
        default_enable = True
        priority = PRIORITY

        def chunk_kda_verifier(self, *args, **kwargs):
            return chunk_kda_verifier(*args, **kwargs)

        def chunk_kda(self, *args, **kwargs):
            return chunk_kda(*args, **kwargs)

        def fused_recurrent_kda_fwd_verifier(self, *args, **kwargs):
            return fused_recurrent_kda_fwd_verifier(*args, **kwargs)

        def fused_recurrent_kda_fwd(self, *args, **kwargs):
            return fused_recurrent_kda_fwd(*args, **kwargs)

    register(fla_chunk_kda)(KDACourseBackend)
    register("kda")(KDACourseBackend)
    return True


REGISTERED = register_with_fla()
