"""Shapes the dense kernels do not take, brought to ones they do, exactly, by zeros.

    expand_heads(x, HV)                (B, T, H, D) -> (B, T, HV, D): q, k over their value heads (GVA)
    pad_channels(x, size)              zero-pad the last axis (a head dim) up to `size`
    pad_state(state, d_k, d_v)         zero-pad a state S^T (..., K, V) to (..., d_k, d_v)
    PackedLayout.of(cu_seqlens, ...)   where each token of a packed batch sits in a zero-padded dense one
    layout.scatter(x), layout.gather(x)   (1, T, ...) <-> (N_seq, max_len, ...)

Each is exact for KDA's recurrence, S_t = S_{t-1} Diag(e^{g_t}) (I - beta_t k_t k_t^T) + beta_t v_t k_t^T,
o_t = S_t q_t:

- grouped value heads (FLA's GVA): value head j reads q and k of head j // (HV // H), so repeating each
  q, k head HV // H times gives HV independent heads; autograd sums the copies' gradients back;
- a zero key channel (q_d = k_d = 0) never reaches another channel (S^T k and S^T q skip it) and, from
  a zero state row, keeps its row zero whatever its gate: padding K is exact and its rows are cut off;
- a zero value column (v_j = 0) keeps its state column and output column zero: cut off likewise;
- a zero token (k = v = 0, beta = 0, g = 0) changes neither the state nor any other token's output, so
  a sequence padded with zero tokens at its end gives its own outputs and its own final state.

All of them are torch operations, so autograd takes gradients through them.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING

from stages.common.checks import check_cu_seqlens

if TYPE_CHECKING:
    import torch


def expand_heads(x: "torch.Tensor", HV: int) -> "torch.Tensor":
    """(..., H, D) -> (..., HV, D): head h repeated for value heads h * G to (h + 1) * G - 1, G = HV // H."""
    H = x.shape[-2]
    return x if HV == H else x.repeat_interleave(HV // H, dim=-2)


def pad_channels(x: "torch.Tensor", size: int) -> "torch.Tensor":
    """x with its last axis zero-padded to `size` (x itself if it has that size)."""
    import torch.nn.functional as F

    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def pad_state(state: "torch.Tensor", d_k: int, d_v: int) -> "torch.Tensor":
    """S^T (..., K, V) zero-padded to (..., d_k, d_v)."""
    import torch.nn.functional as F

    K, V = state.shape[-2:]
    return state if (K, V) == (d_k, d_v) else F.pad(state, (0, d_v - V, 0, d_k - K))


@dataclass(frozen=True)
class PackedLayout:
    """Where the T tokens of a packed batch (FLA's cu_seqlens, B = 1) sit in a dense batch of N_seq rows of
    max_len tokens, sequence i in row i from position 0, zeros after its end.

    Building it reads the offsets on the host: cu_seqlens_cpu when the caller has it (FLA's argument for
    that), else one device sync. The dense batch costs N_seq * max_len tokens of work and memory against
    T: 1.0x for equal lengths, 2.2x for lengths (1300, 547, 2048, 963, 271, 3063)."""

    cu_seqlens: tuple[int, ...]
    sequence: "torch.Tensor"  # (T,) int64: the row of each packed token
    position: "torch.Tensor"  # (T,) int64: its place in the row

    @staticmethod
    def of(cu_seqlens: "torch.Tensor", T: int, cu_seqlens_cpu: "torch.Tensor | None" = None) -> "PackedLayout":
        """The layout of T packed tokens; the offsets must start at 0, never decrease and end at T."""
        import numpy as np
        import torch

        offsets = (cu_seqlens if cu_seqlens_cpu is None else cu_seqlens_cpu).tolist()
        check_cu_seqlens(np.asarray(offsets, dtype=np.int64), 1, T)
        lengths = [end - start for start, end in zip(offsets[:-1], offsets[1:])]
        sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.int64))
        position = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.int64)
        device = cu_seqlens.device
        return PackedLayout(tuple(offsets), sequence.to(device), position.to(device))

    @property
    def lengths(self) -> list[int]:
        return [end - start for start, end in zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])]

    @property
    def max_len(self) -> int:
        return max(self.lengths, default=0)

    def scatter(self, x: "torch.Tensor") -> "torch.Tensor":
        """(1, T, ...) -> (N_seq, max_len, ...), zeros past each sequence's end."""
        dense = x.new_zeros((len(self.lengths), self.max_len, *x.shape[2:]))
        return dense.index_put((self.sequence, self.position), x[0])

    def gather(self, x: "torch.Tensor") -> "torch.Tensor":
        """(N_seq, max_len, ...) -> (1, T, ...): the tokens of each sequence, packed again."""
        return x[self.sequence, self.position].unsqueeze(0)

    def chunk_counts(self, chunk_size: int) -> list[int]:
        """The chunks of each sequence, ceil(length / chunk_size): FLA counts a packed batch's chunks so."""
        return [-(-n // chunk_size) for n in self.lengths]
