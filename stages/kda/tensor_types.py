"""The tensors the chunked kernels take, each declared once: `tensor_types` gives their shapes and dtypes
for one launch, and the prim_func signatures of the prepare, the recurrence and the backward name them
(`W: tensors.key_rows`). A row is one token's vector of one head (one chunk's, for the chunk rows); N
counts the chunk-aligned rows, `tokens` the inputs' rows as the caller passes them:

    name             shape                        dtype       holds
    qk               (B, tokens, H / group, d_k)  dtype       q and k as passed (grouped value heads share one)
    v                (B, tokens, H, d_v)          dtype       v as passed; o, dv
    g                (B, tokens, H, d_k)          gate_dtype  the log gates (or a raw gate's x)
    beta             (B, tokens, H)               beta_dtype  beta (or its logits); dbeta
    A_log            (H,)                         fp32        a raw gate's log rates
    Dt_bias          (H, d_k)                     fp32        ... and its bias on x
    chunk_table      (chunks, 2)                  int32       a packed batch's (sequence, chunk) per chunk
    offsets          (sequences + 1,)             int32       cu_seqlens, the chunk offsets
    flags            (FLAG_COUNT,)                int32       the device checks' flags
    key_rows         (B, N, H, d_k)               dtype       W, Q e^gamma, K e^{gamma_C - gamma}
    value_rows       (B, N, H, d_v)               dtype       U, V_new, dO, dV_new
    score_rows       (B, N, H, C)                 dtype       A_qk: row r of a chunk in token r's row
    key_rows_fp32    (B, N, H, d_k)               fp32        the backward's d_k-wide gradients
    score_rows_fp32  (B, N, H, C)                 fp32        A_kk, T = (I + L)^{-1}, as A_qk
    chunk_rows_fp32  (B, chunks, H, d_k)          fp32        e^{gamma_C}, d gamma_C
    chunk_states     (B, chunks, H, d_k, d_v)     dtype       S^T at every chunk start, dS^T at every end
    states           (B or sequences, H, d_k, d_v) fp32       S_0^T, the final S^T, their gradients

Each is a factory, which TileLang calls once per parameter (a callable annotation is called): every
parameter needs a buffer of its own, and one T.Tensor named by two parameters would make them one
buffer, the second's name on both.
"""

import functools
import types

from stages.common.device_checks import FLAG_COUNT


def tensor_types(B, N, H, d_k, d_v, C, dtype, chunks=None, tokens=None, sequences=None, group=1,
                 gate_dtype="float32", beta_dtype="float32") -> types.SimpleNamespace:
    """The types of the table above, as a namespace, for B batch rows of N chunk-aligned rows, H (value)
    heads, chunk size C and the input dtype `dtype`. chunks: the chunk rows (N // C by default);
    tokens: the inputs' rows (N by default); sequences: a packed batch's sequence count, which gives
    `offsets` and the states' first axis (B without it). group: value heads per q/k head."""
    import tilelang.language as T

    def tensor(shape, tensor_dtype):
        return functools.partial(T.Tensor, shape, tensor_dtype)

    accum_dtype = "float32"
    chunks = N // C if chunks is None else chunks
    tokens = N if tokens is None else tokens
    states = B if sequences is None else sequences
    return types.SimpleNamespace(
        qk=tensor((B, tokens, H // group, d_k), dtype),
        v=tensor((B, tokens, H, d_v), dtype),
        g=tensor((B, tokens, H, d_k), gate_dtype),
        beta=tensor((B, tokens, H), beta_dtype),
        A_log=tensor((H,), accum_dtype),
        Dt_bias=tensor((H, d_k), accum_dtype),
        chunk_table=tensor((chunks, 2), "int32"),
        offsets=None if sequences is None else tensor((sequences + 1,), "int32"),
        flags=tensor((FLAG_COUNT,), "int32"),
        key_rows=tensor((B, N, H, d_k), dtype),
        value_rows=tensor((B, N, H, d_v), dtype),
        score_rows=tensor((B, N, H, C), dtype),
        key_rows_fp32=tensor((B, N, H, d_k), accum_dtype),
        score_rows_fp32=tensor((B, N, H, C), accum_dtype),
        chunk_rows_fp32=tensor((B, chunks, H, d_k), accum_dtype),
        chunk_states=tensor((B, chunks, H, d_k, d_v), dtype),
        states=tensor((states, H, d_k, d_v), accum_dtype),
    )
