"""The recurrence kernel: one program per (block of d_v columns, batch x head), the state S^T
(d_k x block_dv) in registers as an fp32 fragment for the whole sequence, a pipelined chunk loop
(stage 1's kernel with three more GEMM operands); block_dv is 64 where that still gives every SM a
program, else 32 (config.default_block_dv):

    V_new = U - W S^T
    O     = (Q e^gamma) S^T + A_qk V_new            written before ...
    S^T  <- Diag(e^{gamma_C}) S^T + (K e^{gamma_C - gamma})^T V_new   ... the state moves on

One builder for a dense batch and a packed one (`packed`, stage 7's prefill: each program walks its
own sequence's chunks from its own state and stores o at the packed rows), a Python switch over one
signature.
"""

from stages.kda.config import (DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE, DEFAULT_NUM_STAGES, DEFAULT_THREADS, LOADER_REGISTERS,
                               computing_registers)
from stages.kda.prepare import PackedBatch
from stages.kda.tensor_types import tensor_types
from stages.kda.tiles import (CHUNK_ROW, KEY_ROWS, SCORE_ROWS, VALUE_BLOCK, advance_state_macro, chunk_operands_macro,
                              chunk_output_macro)


# --8<-- [start:recurrence_program]
def build_recurrence_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=DEFAULT_BLOCK_DV,
                             dtype="float16", num_stages=DEFAULT_NUM_STAGES, threads=DEFAULT_THREADS,
                             programs_per_sm: int = 1, packed: PackedBatch | None = None):
    """The recurrence kernel: the prepare kernel's outputs, W, Q e^gamma, K e^{gamma_C - gamma}
    (B, N, H, d_k), U (B, N, H, d_v) and A_qk (B, N, H, C) in `dtype`, e^{gamma_C} (B, N / C, H, d_k)
    fp32, and S_0^T (B, H, d_k, d_v) fp32 -> o (B, N, H, d_v) in `dtype` and the final state S^T
    (B, H, d_k, d_v) in fp32.

    N must be a multiple of chunk_size, block_dv must divide d_v.

    packed (a PackedBatch): the prepare's chunk-aligned outputs of a packed batch (B = 1, N =
    packed.chunks * C rows, each sequence from a chunk's first row), S_0^T (sequences, H, d_k, d_v),
    and two more inputs after it, Chunk_offsets and Cu_seqlens (sequences + 1,) int32
    (stages.s07_serving.reference.chunk_table) -> o (1, packed.tokens, H, d_v), packed as the inputs,
    and the final states (sequences, H, d_k, d_v). One program per (block of d_v columns, sequence x
    head) walks chunks chunk_offsets[i] to chunk_offsets[i + 1] - 1 of its sequence i, a loop whose
    trip count is read at run time (none for an empty sequence: its final state is its initial
    state), and stores each chunk's o at the sequence's packed rows, masked at its end.

    programs_per_sm: the launch bound, programs an SM the program is compiled for. 1 is TileLang's
    default (its register budget, 240 a thread, leaves one program an SM); 2 or 3 cap the registers
    at 128 or 80 a thread so that two or three programs share an SM, and the loading warp group hands
    what it does not use to the computing one (config.computing_registers: 232 or 136 a thread), as
    TileLang does at one program an SM (KernelConfig.programs_per_sm: 1 until the bounded programs are
    measured race-free; stage 5's page, "Where the parallelism runs out").
    """
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    num_chunks = N // C if packed is None else packed.chunks
    states = B if packed is None else packed.sequences  # the initial and final states' first axis
    # o's rows: N, or the packed tokens
    tensors = tensor_types(B, N, H, d_k, d_v, C, dtype, chunks=num_chunks, tokens=packed and packed.tokens,
                           sequences=packed and packed.sequences)
    # the prepare's outputs W, U, Q e^gamma, K e^{gamma_C - gamma}, A_qk, e^{gamma_C}: one chunk of each
    # in shared memory
    operands = chunk_operands_macro(C, d_k, block_dv, dtype,
                                    (KEY_ROWS, VALUE_BLOCK, KEY_ROWS, KEY_ROWS, SCORE_ROWS, CHUNK_ROW))
    chunk_output = chunk_output_macro(C, block_dv)
    advance_state = advance_state_macro(d_k, block_dv)

    @T.macro
    def recurrence(W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay, Initial_state, Chunk_offsets, Cu_seqlens, O,
                   Final_state):
        with T.Kernel(d_v // block_dv, states * H, threads=threads) as (i_v, i_bh):
            if programs_per_sm > 1:  # registers capped to fit, and shared between the warp groups within the cap
                T.annotate_min_blocks_per_sm(programs_per_sm)
                T.annotate_producer_reg_dealloc(LOADER_REGISTERS)
                # TileLang launches a loading warp group as large as the `threads` computing ones
                T.annotate_consumer_reg_alloc(computing_registers(2 * threads, programs_per_sm))
            if packed is None:
                b, h = i_bh // H, i_bh % H
                v0 = i_v * block_dv
            else:
                sequence, h = i_bh // H, i_bh % H
                v0 = i_v * block_dv
                first_chunk = Chunk_offsets[sequence]  # the sequence's chunks: no chunk holds two sequences

            W_s, U_s, Q_decayed_s, K_to_chunk_end_s, A_qk_s, chunk_decay_s = operands.declare()
            S_s = T.alloc_shared((d_k, block_dv), dtype)  # the state as a GEMM operand
            V_new_s = T.alloc_shared((C, block_dv), dtype)
            O_s = T.alloc_shared((C, block_dv), dtype)  # o staged for a store of whole rows

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state: lives across chunks
            V_new_f = T.alloc_fragment((C, block_dv), accum_dtype)
            acc_o = T.alloc_fragment((C, block_dv), accum_dtype)

            if packed is None:
                T.copy(Initial_state[b, h, :, v0:v0 + block_dv], S_f)  # once, outside the chunk loop
                for i_c in T.Pipelined(num_chunks, num_stages=num_stages):
                    t0 = i_c * C
                    operands.load((W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay),
                                  (W_s, U_s, Q_decayed_s, K_to_chunk_end_s, A_qk_s, chunk_decay_s), b, h, v0, i_c, t0)
                    chunk_output(S_f, S_s, W_s, U_s, Q_decayed_s, A_qk_s, V_new_f, V_new_s, acc_o, O_s)
                    # through shared memory, then one TMA store: from the fragment, o went out in 4-byte
                    # stores spread over 8 rows
                    T.fence_proxy_async()  # O_s seen by the TMA store (tiles.py: "TMA stores")
                    T.copy(O_s, O[b, t0:t0 + C, h, v0:v0 + block_dv])
                    advance_state(S_f, chunk_decay_s, K_to_chunk_end_s, V_new_s)
                T.copy(S_f, Final_state[b, h, :, v0:v0 + block_dv])
            else:
                T.copy(Initial_state[sequence, h, :, v0:v0 + block_dv], S_f)  # its own state, once
                for i in T.Pipelined(Chunk_offsets[sequence + 1] - first_chunk, num_stages=num_stages):
                    i_c = first_chunk + i  # the chunk's index in the whole batch
                    t0 = i_c * C  # its first row in the chunk-aligned layout
                    start = Cu_seqlens[sequence] + i * C  # ... and its first token in the packed batch
                    rows = T.min(C, Cu_seqlens[sequence + 1] - start)  # a sequence's last chunk may be short
                    operands.load((W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay),
                                  (W_s, U_s, Q_decayed_s, K_to_chunk_end_s, A_qk_s, chunk_decay_s), 0, h, v0, i_c, t0)
                    chunk_output(S_f, S_s, W_s, U_s, Q_decayed_s, A_qk_s, V_new_f, V_new_s, acc_o, O_s)
                    for r, j in T.Parallel(C, block_dv):  # masked store: the rows past the end are the next sequence's
                        if r < rows:
                            O[0, start + r, h, v0 + j] = O_s[r, j]
                    advance_state(S_f, chunk_decay_s, K_to_chunk_end_s, V_new_s)
                T.copy(S_f, Final_state[sequence, h, :, v0:v0 + block_dv])

    @T.prim_func
    def kda_recurrence(
        W: tensors.key_rows,
        U: tensors.value_rows,
        Q_decayed: tensors.key_rows,
        K_to_chunk_end: tensors.key_rows,
        A_qk: tensors.score_rows,
        Chunk_decay: tensors.chunk_rows_fp32,
        Initial_state: tensors.states,
        Chunk_offsets: tensors.offsets if packed else None,
        Cu_seqlens: tensors.offsets if packed else None,
        O: tensors.v,
        Final_state: tensors.states,
    ):
        recurrence(W, U, Q_decayed, K_to_chunk_end, A_qk, Chunk_decay, Initial_state, Chunk_offsets, Cu_seqlens, O,
                   Final_state)

    return kda_recurrence
# --8<-- [end:recurrence_program]
