"""Exercise s05.build_kernel (build): stage 5's recurrence kernel, written whole from an empty body.

Write build_recurrence_program so that it returns a `@T.prim_func` that walks the chunks of one
sequence with the state, from what the prepare kernel wrote (stages/s05_fast_kda/reference.py:
prepare, ChunkTensors), as reference C's `recurrence` does:

    V_new = U - W S^T
    O     = Q_decayed S^T + A_qk V_new                                  written before ...
    S^T  <- Diag(chunk_decay) S^T + K_to_chunk_end^T V_new             ... the state moves on

starting from S_0^T (Initial_state) and storing the last state (Final_state). Any correct program
passes: choose your own grid, tiles and order, within what the tests below ask.

What is given, and what the tests need:
- the signature below, and the parameters of the prim_func in this order: W, U, Q_decayed,
  K_to_chunk_end, A_qk, Chunk_decay, Initial_state (inputs; shapes in the docstring below), O and
  Final_state (the outputs, each element written once);
- the layout: the state is kept as S^T (d_k x d_v), as in reference C; a program may own a block of
  block_dv of its columns;
- the buffer names that the ordering check reads in your TIR (stages.common.ordering): the state is
  an fp32 fragment `S_f` that lives across the chunk loop, its copy that the products read is the
  shared buffer `S_s`, and each chunk's output is summed in the fp32 fragment `acc_o`; the state's
  decay is a store into `S_f` (an element-wise loop), its update a `T.gemm` into `S_f`;
- the chunk loop is the program's one `T.Pipelined` loop.

The tests (tests/exercises/s05_fast_kda/test_build_kernel.py), all on a CPU, feed the program what
reference C's prepare computes from q, k, v, g, beta and compare with KDA's delta-rule form
(tests/exercises/s05_fast_kda/oracle.py), the output and the final state:
- float64 through the tile interpreter, with one chunk and with several chunks and two blocks of
  value columns, a nonzero initial state, channel gates a in [0.5, 0.999], beta over [0, 1] with exact
  0s and 1s; fp16 within fp16's rounding;
- strong gates: channels with g = -50 per token, in float64 and fp16;
- a length that is not a multiple of the chunk (prepare pads it);
- the program writes O and Final_state and nothing else (the inputs are unchanged);
- ordering constraints 1 and 2: the output reads the state before the chunk changes it; the state
  decays before the product adds the chunk to it (constraint 7 asks for a cleared state: here it
  starts from S_0);
- the cost at B = 1, N = 1024, H = 4, d_k = d_v = 128, your tile defaults: at most 1.25 times the
  course kernel's global bytes and GEMM FLOPs, and at least half its GEMM FLOPs, as
  stages.common.program_cost counts them from your TIR (a tile loaded from global memory twice goes
  over; products summed element by element, off the tensor cores, fall short; the tune exercise asks
  for more);
- the H200's budget at d_k = d_v = 128, chunk_size = 64: at most 227 KiB of shared memory per block
  (counted from your TIR); with `course check s05 --compile` (nvcc), no register spills.
Read: stage 5 page, "s05.build_kernel".  Check: course check s05
"""

from stages.s05_fast_kda.kernel import DEFAULT_BLOCK_DV, DEFAULT_CHUNK_SIZE


def build_recurrence_program(B, N, H, d_k, d_v, chunk_size=DEFAULT_CHUNK_SIZE, block_dv=DEFAULT_BLOCK_DV,
                             dtype="float16", num_stages=2, threads=128):
    """The recurrence kernel: the prepare kernel's outputs and S_0^T (B, H, d_k, d_v) fp32
    -> o (B, N, H, d_v) in `dtype` and the final state S^T (B, H, d_k, d_v) in fp32.

    W, Q_decayed, K_to_chunk_end: (B, N, H, d_k) and U: (B, N, H, d_v) in `dtype`; A_qk: (B, N, H,
    chunk_size) in `dtype`, row r of a chunk holding A_qk[r, :]; Chunk_decay: (B, N // chunk_size, H,
    d_k) fp32. N must be a multiple of chunk_size, block_dv must divide d_v.
    """
    # EXERCISE BEGIN
    import tilelang.language as T

    C = chunk_size
    accum_dtype = "float32"
    num_chunks = N // C

    @T.prim_func
    def kda_recurrence(
        W: T.Tensor((B, N, H, d_k), dtype),
        U: T.Tensor((B, N, H, d_v), dtype),
        Q_decayed: T.Tensor((B, N, H, d_k), dtype),
        K_to_chunk_end: T.Tensor((B, N, H, d_k), dtype),
        A_qk: T.Tensor((B, N, H, C), dtype),
        Chunk_decay: T.Tensor((B, num_chunks, H, d_k), accum_dtype),
        Initial_state: T.Tensor((B, H, d_k, d_v), accum_dtype),
        O: T.Tensor((B, N, H, d_v), dtype),
        Final_state: T.Tensor((B, H, d_k, d_v), accum_dtype),
    ):
        with T.Kernel(d_v // block_dv, B * H, threads=threads) as (i_v, i_bh):
            b, h = i_bh // H, i_bh % H
            v0 = i_v * block_dv

            W_s = T.alloc_shared((C, d_k), dtype)
            U_s = T.alloc_shared((C, block_dv), dtype)
            Q_decayed_s = T.alloc_shared((C, d_k), dtype)
            K_to_chunk_end_s = T.alloc_shared((C, d_k), dtype)
            A_qk_s = T.alloc_shared((C, C), dtype)
            chunk_decay_s = T.alloc_shared((d_k,), accum_dtype)
            S_s = T.alloc_shared((d_k, block_dv), dtype)  # the state as a GEMM operand
            V_new_s = T.alloc_shared((C, block_dv), dtype)
            O_s = T.alloc_shared((C, block_dv), dtype)  # o staged for a store of whole rows

            S_f = T.alloc_fragment((d_k, block_dv), accum_dtype)  # the state: lives across chunks
            V_new_f = T.alloc_fragment((C, block_dv), accum_dtype)
            acc_o = T.alloc_fragment((C, block_dv), accum_dtype)

            T.copy(Initial_state[b, h, :, v0:v0 + block_dv], S_f)  # once, outside the chunk loop
            for i_c in T.Pipelined(num_chunks, num_stages=num_stages):
                t0 = i_c * C
                T.copy(W[b, t0:t0 + C, h, :], W_s)
                T.copy(U[b, t0:t0 + C, h, v0:v0 + block_dv], U_s)
                T.copy(Q_decayed[b, t0:t0 + C, h, :], Q_decayed_s)
                T.copy(K_to_chunk_end[b, t0:t0 + C, h, :], K_to_chunk_end_s)
                T.copy(A_qk[b, t0:t0 + C, h, :], A_qk_s)
                T.copy(Chunk_decay[b, i_c, h, :], chunk_decay_s)

                # the pseudo-values V_new = U - W S^T (S^T cast to the input dtype first)
                T.copy(S_f, S_s)
                T.gemm(W_s, S_s, V_new_f, clear_accum=True)
                for r, j in T.Parallel(C, block_dv):
                    V_new_f[r, j] = U_s[r, j] - V_new_f[r, j]
                T.copy(V_new_f, V_new_s)

                # inter-chunk term, then the intra-chunk term added into the same accumulator
                T.gemm(Q_decayed_s, S_s, acc_o, clear_accum=True)
                T.gemm(A_qk_s, V_new_s, acc_o)
                T.copy(acc_o, O_s)
                # through shared memory, then one TMA store: from the fragment, o went out in 4-byte
                # stores spread over 8 rows
                T.fence_proxy_async()  # O_s seen by the TMA store (stages/kda/tiles.py: "TMA stores")
                T.copy(O_s, O[b, t0:t0 + C, h, v0:v0 + block_dv])

                # only now does the state move past this chunk: decay row by row, then the GEMM
                for d, j in T.Parallel(d_k, block_dv):
                    S_f[d, j] *= chunk_decay_s[d]
                T.gemm(K_to_chunk_end_s, V_new_s, S_f, transpose_A=True)
            T.copy(S_f, Final_state[b, h, :, v0:v0 + block_dv])

    return kda_recurrence
    # EXERCISE END
