"""Each stage's chunked forward pass in plain torch: the benchmark's "same math, no custom kernel".

Batched over (B, H), a Python loop over chunks, torch matmuls inside; state S^T (d_k x d_v), the
kernel layout. Every function takes (B, N, H, D) tensors like the stages' references, with N a
multiple of chunk_size, and returns o in the dtype of v. They run in the inputs' dtype, so float64
on a GPU gives the precision study its reference at lengths where NumPy would take hours; the
tests check them against the NumPy references A in float64.
"""

import torch


def _heads_first(*tensors):
    """(B, N, H, ...) -> (B, H, N, ...) for each tensor."""
    return [x.transpose(1, 2) for x in tensors]


def _chunks(N, chunk_size):
    if N % chunk_size:
        raise ValueError(f"N = {N} must be a multiple of chunk_size = {chunk_size}")
    return [slice(start, start + chunk_size) for start in range(0, N, chunk_size)]


def linear_attention(q, k, v, chunk_size=64):
    """Stage 1: O = Q S^T + (Q K^T ⊙ M) V per chunk, then S^T += K^T V."""
    q, k, v = _heads_first(q, k, v)
    B, H, N, d_k = q.shape
    S_T = q.new_zeros(B, H, d_k, v.shape[-1])
    mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    o = torch.empty_like(v)
    for rows in _chunks(N, chunk_size):
        Q, K, V = q[:, :, rows], k[:, :, rows], v[:, :, rows]
        o[:, :, rows] = Q @ S_T + (Q @ K.transpose(-1, -2)).masked_fill(~mask, 0) @ V
        S_T = S_T + K.transpose(-1, -2) @ V
    return o.transpose(1, 2)


def scalar_decay(q, k, v, g, chunk_size=64):
    """Stage 2, g: (H,) log decay per head. Decay enters at q (gamma^r), k (gamma^(C-r)) and S (gamma^C)."""
    q, k, v = _heads_first(q, k, v)
    B, H, N, d_k = q.shape
    C = chunk_size
    positions = torch.arange(1, C + 1, device=q.device, dtype=q.dtype)
    log_gamma = g.to(q.dtype).view(H, 1) * positions  # (H, C): log of alpha^r, r = 1..C
    decay_table = torch.exp((log_gamma[:, :, None] - log_gamma[:, None, :]).tril())  # (H, C, C)
    decay_table = decay_table * torch.ones(C, C, device=q.device, dtype=q.dtype).tril()
    query_decay = torch.exp(log_gamma)[None, :, :, None]  # (1, H, C, 1)
    key_decay = torch.exp(log_gamma[:, -1:] - log_gamma)[None, :, :, None]
    state_decay = torch.exp(log_gamma[:, -1])[None, :, None, None]
    S_T = q.new_zeros(B, H, d_k, v.shape[-1])
    o = torch.empty_like(v)
    for rows in _chunks(N, C):
        Q, K, V = q[:, :, rows], k[:, :, rows], v[:, :, rows]
        o[:, :, rows] = (Q * query_decay) @ S_T + ((Q @ K.transpose(-1, -2)) * decay_table) @ V
        S_T = state_decay * S_T + (K * key_decay).transpose(-1, -2) @ V
    return o.transpose(1, 2)


def gated_deltanet(q, k, v, g, beta, chunk_size=64):
    """Stage 3, g: (B, N, H) log gate per token, beta: (B, N, H). The scalar case of `kda`."""
    return kda(q, k, v, g[..., None].expand(*q.shape), beta, chunk_size)


def kda(q, k, v, g, beta, chunk_size=64):
    """Stage 4, g: (B, N, H, d_k) per-channel log gate, beta: (B, N, H). Half-precision inputs are
    computed in float32 (torch has no half-precision triangular solve) and the output cast back.

    Per chunk, with gamma the chunk-local cumulative log gate (C x d_k):
        L = strict_tril(beta_i (K e^gamma)(K e^-gamma)^T)      A-hat = diag(beta) (I + L)^-1
        W = A-hat (K e^gamma),  U = A-hat V,  V~ = U - W S^T
        O = (Q e^gamma) S^T + tril((Q e^gamma)(K e^-gamma)^T) V~
        S^T <- Diag(e^gamma_C) S^T + (K e^(gamma_C - gamma))^T V~
    """
    output_dtype = v.dtype
    if q.dtype in (torch.float16, torch.bfloat16):  # torch's triangular solve has no half-precision kernel
        q, k, v = q.float(), k.float(), v.float()
    q, k, v, g = _heads_first(q, k, v, g.to(q.dtype))
    beta = beta.transpose(1, 2).to(q.dtype)  # (B, H, N)
    B, H, N, d_k = q.shape
    C = chunk_size
    identity = torch.eye(C, device=q.device, dtype=q.dtype)
    strict = torch.ones(C, C, dtype=torch.bool, device=q.device).tril(-1)
    inclusive = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    S_T = q.new_zeros(B, H, d_k, v.shape[-1])
    o = torch.empty_like(v)
    for rows in _chunks(N, C):
        Q, K, V, b = q[:, :, rows], k[:, :, rows], v[:, :, rows], beta[:, :, rows]
        gamma = g[:, :, rows].to(q.dtype).cumsum(dim=2)
        K_plus, K_minus = K * torch.exp(gamma), K * torch.exp(-gamma)
        L = (b[..., None, :] * (K_plus @ K_minus.transpose(-1, -2))).masked_fill(~strict, 0)
        T = torch.linalg.solve_triangular(identity + L, identity.expand_as(L), upper=False, unitriangular=True)
        A_hat = b[..., :, None] * T
        pseudo_values = A_hat @ V - (A_hat @ K_plus) @ S_T
        Q_plus = Q * torch.exp(gamma)
        A_qk = (Q_plus @ K_minus.transpose(-1, -2)).masked_fill(~inclusive, 0)
        o[:, :, rows] = Q_plus @ S_T + A_qk @ pseudo_values
        gamma_C = gamma[:, :, -1:]
        S_T = torch.exp(gamma_C).transpose(-1, -2) * S_T + (K * torch.exp(gamma_C - gamma)).transpose(-1, -2) @ pseudo_values
    return o.transpose(1, 2).to(output_dtype)
