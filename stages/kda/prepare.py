"""The prepare kernel: one program per (chunk, batch x head), thousands of them, no state. Per chunk of C
tokens (gamma = cumsum of the log gates from the chunk start):

    A_kk, A_qk from GEMMs on 16-row sub-blocks with anchored exponents (every factor <= 1 off the
    diagonal blocks), written as A_qk (input dtype) and L = diag(beta) A_kk (fp32, on chip);
    Q e^gamma, K e^{gamma_C - gamma} (input dtype) and e^{gamma_C} (fp32) written;
    T = (I + L)^{-1} by blocks in fp32 (merges as TF32 GEMMs), then the GEMMs W = diag(beta) T (K e^gamma),
    U = diag(beta) T V.

One builder for every form the fast path runs, each a Python switch over one signature (a parameter
whose annotation is None is left out of the program, so each form has exactly its own buffers):
dense batches (B, N, ...) or a packed one (`packed`, stage 7's cu_seqlens: masked loads, chunk-aligned
outputs), with or without the device's value flags, with or without the solve's A_kk and T as outputs
(stage 6's backward).
"""

from dataclasses import dataclass
from typing import NamedTuple

from stages.common.tilelang_tools import LOG2_E
from stages.kda.config import CHANNEL_PASSES, DEFAULT_CHUNK_SIZE, default_prepare_threads
from stages.kda.inputs import InputForm
from stages.kda.tensor_types import tensor_types
from stages.kda.tiles import (activate_loads_macro, anchored_scores_macro, block_inverse_macro,
                              cumulative_gates_macro, flag_bad_values_macro, prepare_buffers_macro, scaled,
                              wy_outputs_macro)
from stages.s05_fast_kda.numerics import score_operand_dtypes

PLAIN = InputForm()  # q, k, g and beta read as they are


@dataclass(frozen=True)
class PackedBatch:
    """The sizes of a packed batch (stage 7's prefill): `tokens` packed rows of the inputs, `chunks` rows
    of the chunk table (the chunk-aligned outputs hold chunks * C rows), `sequences` sequences. Each may
    be a TileLang symbol (run_time_sizes), so that one compiled program serves every batch."""

    tokens: object
    chunks: object
    sequences: object


class ChunkAt(NamedTuple):
    """Where a prepare program's chunk lies: batch row b and value head h of the inputs, qk_h the head of
    q and k it reads (h // group with grouped value heads), its index among the chunks and its first
    row t0 in the outputs, and where its rows are read masked (a packed batch, or a dense one whose
    length is not a multiple of C) its first token `start` in the inputs and its `rows` tokens (a
    sequence's last chunk may be short). A macro takes it whole: a grid index passed to a macro by
    itself would be renamed after the macro's parameter in the program's TIR."""

    b: object
    h: object
    qk_h: object
    index: object
    t0: object
    start: object = None
    rows: object = None


def run_time_sizes() -> tuple:
    """The token count, the chunk-aligned row count, the chunk count and the sequence count of a batch,
    as TileLang symbols: the kernels compiled with them serve every batch."""
    import tilelang.language as T

    return T.dynamic("T_tokens"), T.dynamic("T_padded"), T.dynamic("n_chunks"), T.dynamic("N_seq")


def prepare_outputs(value_flags=False, solve_outputs=False, packed=False, raw_gate=False):
    """The indices of build_prepare_program's outputs among its parameters (tilelang.compile's out_idx):
    six (eight with solve_outputs) after the five inputs, A_log and Dt_bias (a raw gate), the packed
    index (two) and Flags."""
    first = 5 + 2 * raw_gate + 2 * packed + value_flags
    return list(range(first, first + (8 if solve_outputs else 6)))


# --8<-- [start:prepare_setup]
def build_prepare_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, dtype="float16", threads=None,
                          channel_passes=CHANNEL_PASSES, value_flags=False, solve_outputs=False,
                          packed: PackedBatch | None = None, form: InputForm = PLAIN, group=1, gate_dtype="float32",
                          beta_dtype="float32", tokens=None):
    """The prepare kernel: q, k (B, N, H / group, d_k), v (B, N, H, d_v) in `dtype`, g (B, N, H, d_k) and
    beta (B, N, H) in fp32 -> W, Q e^gamma, K e^{gamma_C - gamma} (B, N, H, d_k), U (B, N, H, d_v),
    A_qk (B, N, H, C) in `dtype`, e^{gamma_C} (B, N / C, H, d_k) in fp32. H counts the value heads, one
    program's each; with grouped value heads (FLA's GVA, `group` > 1) value head h reads q's and k's head
    h // group.

    The score GEMMs sum over d_k in `channel_passes` passes, so their operands hold d_k /
    channel_passes channels: at C = 64, d_k = 128 in bf16, two passes bring shared memory to 113 KiB,
    two blocks an SM; at C = 32, 56 KiB with two passes (three blocks) and 47 KiB with four (four
    blocks: archive/studies/kda_prepare_occupancy.py). N must be a multiple of chunk_size (the wrapper
    pads), chunk_size of SUB_BLOCK, d_k of 16 * channel_passes. threads=None takes
    default_prepare_threads(chunk_size).

    form (stages.kda.inputs.InputForm): the inputs as a model passes them, made the recurrence's own
    as they are loaded (activate_loads): q and k normalized and q scaled; with a raw gate, g is the raw
    projection x in gate_dtype and two more inputs follow Beta, A_log (H,) and Dt_bias (H, d_k) fp32;
    beta logits in beta_dtype. tokens (dense batches with a form other than the plain one): the
    inputs' rows, N rounded up to a multiple of C in the outputs; the rows past them read as zero
    tokens, so that the caller pads nothing.

    value_flags=True adds a parameter Flags (FLAG_COUNT,) int32 before the outputs and checks every g
    and beta as it is loaded (flag_bad_values): the checks="device" kernel. solve_outputs=True adds two
    fp32 outputs after e^{gamma_C}: A_kk (B, N, H, C), strictly lower, and T = (I + L)^{-1} (B, N, H, C),
    row r of a chunk in token r's row as A_qk: stage 6's intra kernel reads them, so the backward
    differentiates the A_kk and T that the forward used, bit for bit.

    packed (a PackedBatch): the inputs are one packed batch (1, packed.tokens, H, ...) of
    packed.sequences sequences, with two more inputs after Beta, the chunk table Chunks
    (packed.chunks, 2) int32 (stages.s07_serving.reference.chunk_table) and Cu_seqlens (sequences + 1,)
    int32; B must be 1 and N = packed.chunks * C, the rows of the chunk-aligned outputs. One program per
    (row p of the table, head) reads chunk `chunk` of sequence `sequence` straight from the packed rows,
    zeros past the sequence's end (masked loads, as reference C's prepare_varlen), and writes rows
    p * C to p * C + C - 1 of the outputs. A row of the table whose chunk starts at or past its
    sequence's end loads nothing but zeros and writes a zero chunk's outputs to rows no sequence owns.
    (Skipping it with `if rows > 0:` around the body cost more: TileLang's shared-memory planner then
    gave every buffer its own bytes, 248,080 B, past an SM's 227 KiB.)
    """
    import tilelang.language as T

    threads = threads or default_prepare_threads(chunk_size)
    C = chunk_size
    num_chunks = N // C if packed is None else packed.chunks
    tokens = tokens or N  # the inputs' rows of a dense batch
    tail = packed is None and tokens % C != 0  # a dense batch whose last chunk is short: masked loads
    tensors = tensor_types(B, N, H, d_k, d_v, C, dtype, chunks=num_chunks, tokens=packed.tokens if packed else tokens,
                           sequences=packed and packed.sequences, group=group, gate_dtype=gate_dtype,
                           beta_dtype=beta_dtype)
    channels_per_pass = d_k // channel_passes
    diagonal_dtype, slab_dtype = score_operand_dtypes(dtype)
    prepare_buffers = prepare_buffers_macro(C, d_k, d_v, channels_per_pass, dtype, diagonal_dtype, slab_dtype)
    activate_loads = activate_loads_macro(C, d_k, form)
    flag_bad_values = flag_bad_values_macro(C, d_k, form.beta_bound)
    cumulative_gates = cumulative_gates_macro(C, d_k)
    anchored_scores = anchored_scores_macro(C, channel_passes, channels_per_pass, diagonal_dtype)
    block_inverse = block_inverse_macro(C)
    wy_outputs = wy_outputs_macro(C)

    # --8<-- [start:packed_loads]
    @T.macro
    def load_chunk(Q, K, G, Beta, s, at):
        # Q_s, K_s, gamma_s (the log gates, before the sum) and beta_s from one chunk's rows
        if at.rows is None:
            T.copy(Q[at.b, at.t0:at.t0 + C, at.qk_h, :], s.Q_s)
            T.copy(K[at.b, at.t0:at.t0 + C, at.qk_h, :], s.K_s)
            T.copy(Beta[at.b, at.t0:at.t0 + C, at.h], s.beta_s)
            T.copy(G[at.b, at.t0:at.t0 + C, at.h, :], s.gamma_s)  # all loads in flight at once, then the sum on chip
        else:
            # masked loads: a row past the sequence's end is a zero token (g = 0, beta = 0), which
            # changes nothing of the rows before it; the next sequence's tokens are never read. The
            # 2-byte and the 4-byte loads in loops of their own: each vectorizes to 16 bytes a lane
            for r, d in T.Parallel(C, d_k):
                s.Q_s[r, d] = T.if_then_else(r < at.rows, Q[at.b, at.start + r, at.qk_h, d], 0)
                s.K_s[r, d] = T.if_then_else(r < at.rows, K[at.b, at.start + r, at.qk_h, d], 0)
            for r, d in T.Parallel(C, d_k):
                s.gamma_s[r, d] = T.if_then_else(r < at.rows, G[at.b, at.start + r, at.h, d], 0)
            for r in T.Parallel(C):
                s.beta_s[r] = T.if_then_else(r < at.rows, Beta[at.b, at.start + r, at.h], 0)

    # --8<-- [end:packed_loads]

    @T.macro
    def prepare_chunk(Q, K, V, G, Beta, A_log, Dt_bias, Flags, W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay,
                      A_kk, Inverse, at):
        s = prepare_buffers()
        load_chunk(Q, K, G, Beta, s, at)
        if form.is_plain:
            q_factor, k_factor = None, None
        else:  # the model's tensors made the recurrence's own, on chip; q's and k's norms as row factors
            q_factor, k_factor = activate_loads(s, A_log, Dt_bias, at.h, at.rows)
            # every warp's gates stored before any thread reads another's (the checks, the sum): TileLang
            # may sync beta's in-place sigmoid with a barrier of the threads that run it and take that
            # for the whole block's (tiles.py: "Barriers TileLang leaves out")
            T.sync_threads()
        if value_flags:  # the gates and betas checked as they arrive
            flag_bad_values(s.gamma_s, s.beta_s, Flags)
        cumulative_gates(s.gamma_s)

        if solve_outputs:  # with unit betas (None) the scores give A_kk itself; it goes out, then takes its betas
            anchored_scores(s.Q_s, s.K_s, s.gamma_s, None, s.Q_row_s, s.K_row_s, s.K_col_s, s.Q_slab_s,
                            s.K_slab_row_s, s.K_slab_col_s, s.kk_f, s.qk_f, s.kk_slab_f, s.qk_slab_f, s.L_s, s.A_qk_s,
                            q_factor, k_factor)
            T.fence_proxy_async()  # L_s seen by the TMA store (tiles.py: "TMA stores")
            T.copy(s.L_s, A_kk[at.b, at.t0:at.t0 + C, at.h, :])
            for r, j in T.Parallel(C, C):
                s.L_s[r, j] = s.L_s[r, j] * s.beta_s[j]  # the product the scores form with beta: the same bits
        else:
            anchored_scores(s.Q_s, s.K_s, s.gamma_s, s.beta_s, s.Q_row_s, s.K_row_s, s.K_col_s, s.Q_slab_s,
                            s.K_slab_row_s, s.K_slab_col_s, s.kk_f, s.qk_f, s.kk_slab_f, s.qk_slab_f, s.L_s, s.A_qk_s,
                            q_factor, k_factor)
        # one store of whole rows (TMA), where writing from the fragments scattered 2-byte stores
        T.fence_proxy_async()  # A_qk_s seen by the TMA store (tiles.py: "TMA stores")
        T.copy(s.A_qk_s, A_qk[at.b, at.t0:at.t0 + C, at.h, :])
        # --8<-- [end:prepare_setup]

        # --8<-- [start:prepare_decayed]
        # the last reads of gamma and Q: the recurrence's decayed operands, and K e^gamma (in its
        # own buffer: written in place, K_s cost a barrier per unrolled step)
        for r, d in T.Parallel(C, d_k):
            decay_from_start = T.exp2(s.gamma_s[r, d] * LOG2_E)
            Q_decayed[at.b, at.t0 + r, at.h, d] = scaled(s.Q_s, q_factor, r, d) * decay_from_start
            K_to_chunk_end[at.b, at.t0 + r, at.h, d] = scaled(s.K_s, k_factor, r, d) * T.exp2(
                (s.gamma_s[C - 1, d] - s.gamma_s[r, d]) * LOG2_E)
            s.Kg_s[r, d] = scaled(s.K_s, k_factor, r, d) * decay_from_start
        for d in T.Parallel(d_k):
            Chunk_decay[at.b, at.index, at.h, d] = T.exp2(s.gamma_s[C - 1, d] * LOG2_E)
        # loaded this late, V_s can take the bytes of Q_s (TileLang plans shared memory by lifetime)
        if at.rows is None:
            T.copy(V[at.b, at.t0:at.t0 + C, at.h, :], s.V_s)
        else:
            for r, d in T.Parallel(C, d_v):
                s.V_s[r, d] = T.if_then_else(r < at.rows, V[at.b, at.start + r, at.h, d], 0)

        block_inverse(s.L_s, s.T_s, s.T_diag_s, s.merge_s, s.block_row_f)
        if solve_outputs:
            T.fence_proxy_async()  # T_s seen by the TMA store (tiles.py: "TMA stores")
            T.copy(s.T_s, Inverse[at.b, at.t0:at.t0 + C, at.h, :])
        wy_outputs(s.T_s, s.beta_s, s.A_hat_s, s.Kg_s, s.V_s, s.w_f, s.u_f, s.W_s, s.U_s)
        T.fence_proxy_async()  # W_s, U_s seen by the TMA store (tiles.py: "TMA stores")
        T.copy(s.W_s, W[at.b, at.t0:at.t0 + C, at.h, :])
        T.copy(s.U_s, U[at.b, at.t0:at.t0 + C, at.h, :])
        # --8<-- [end:prepare_decayed]

    def qk_head(h):
        return h if group == 1 else h // group  # one q/k head serves `group` value heads

    @T.macro
    def prepare(Q, K, V, G, Beta, A_log, Dt_bias, Chunks, Cu_seqlens, Flags, W, U, Q_decayed, K_to_chunk_end, A_qk,
                Chunk_decay, A_kk, Inverse):
        if packed is None:
            with T.Kernel(num_chunks, B * H, threads=threads) as (i_c, i_bh):
                b, h = i_bh // H, i_bh % H
                t0 = i_c * C
                if tail:  # the last chunk is short: every chunk's rows read masked
                    at = ChunkAt(b, h, qk_head(h), i_c, t0, t0, T.min(C, tokens - t0))
                else:
                    at = ChunkAt(b, h, qk_head(h), i_c, t0)
                prepare_chunk(Q, K, V, G, Beta, A_log, Dt_bias, Flags, W, U, Q_decayed, K_to_chunk_end, A_qk,
                              Chunk_decay, A_kk, Inverse, at)
        else:
            with T.Kernel(num_chunks, H, threads=threads) as (i_c, h):
                sequence = Chunks[i_c, 0]
                start = Cu_seqlens[sequence] + Chunks[i_c, 1] * C  # the chunk's first token in the packed batch
                rows = T.min(C, Cu_seqlens[sequence + 1] - start)  # a sequence's last chunk may be short
                t0 = i_c * C  # the chunk's first row in the chunk-aligned outputs
                prepare_chunk(Q, K, V, G, Beta, A_log, Dt_bias, Flags, W, U, Q_decayed, K_to_chunk_end, A_qk,
                              Chunk_decay, A_kk, Inverse, ChunkAt(0, h, qk_head(h), i_c, t0, start, rows))

    @T.prim_func
    def kda_prepare(
        Q: tensors.qk,
        K: tensors.qk,
        V: tensors.v,
        G: tensors.g,
        Beta: tensors.beta,
        A_log: tensors.A_log if form.raw_gate else None,
        Dt_bias: tensors.Dt_bias if form.raw_gate else None,
        Chunks: tensors.chunk_table if packed else None,
        Cu_seqlens: tensors.offsets if packed else None,
        Flags: tensors.flags if value_flags else None,
        W: tensors.key_rows,
        U: tensors.value_rows,
        Q_decayed: tensors.key_rows,
        K_to_chunk_end: tensors.key_rows,
        A_qk: tensors.score_rows,
        Chunk_decay: tensors.chunk_rows_fp32,
        A_kk: tensors.score_rows_fp32 if solve_outputs else None,
        Inverse: tensors.score_rows_fp32 if solve_outputs else None,
    ):
        prepare(Q, K, V, G, Beta, A_log, Dt_bias, Chunks, Cu_seqlens, Flags, W, U, Q_decayed, K_to_chunk_end, A_qk,
                Chunk_decay, A_kk, Inverse)

    return kda_prepare
