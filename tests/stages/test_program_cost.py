"""stages.common.program_cost: FLOPs and bytes counted from TileLang programs, checked against counts
made by hand on tiny programs, and against formulas for stage 1's and stage 5's kernels. CPU only."""

import pytest

pytest.importorskip("tilelang")

from stages.common.program_cost import CostError, CountedCost, counted_cost, program_cost  # noqa: E402


def _copy_program(N, block):
    import tilelang.language as T

    @T.prim_func
    def copy(A: T.Tensor((N,), "float16"), B: T.Tensor((N,), "float16")):
        with T.Kernel(N // block, threads=128) as i:
            A_s = T.alloc_shared((block,), "float16")
            T.copy(A[i * block:(i + 1) * block], A_s)
            T.copy(A_s, B[i * block:(i + 1) * block])

    return copy


def _gemm_program(M, N, K, block_m, block_n, block_k):
    import tilelang.language as T

    @T.prim_func
    def gemm(A: T.Tensor((M, K), "float16"), B: T.Tensor((K, N), "float16"), C: T.Tensor((M, N), "float32")):
        with T.Kernel(N // block_n, M // block_m, threads=128) as (bx, by):
            A_s = T.alloc_shared((block_m, block_k), "float16")
            B_s = T.alloc_shared((block_k, block_n), "float16")
            C_f = T.alloc_fragment((block_m, block_n), "float32")
            T.clear(C_f)
            for k in T.Pipelined(K // block_k, num_stages=2):
                T.copy(A[by * block_m, k * block_k], A_s)
                T.copy(B[k * block_k, bx * block_n], B_s)
                T.gemm(A_s, B_s, C_f)
            T.copy(C_f, C[by * block_m, bx * block_n])

    return gemm


def _triangle_program(C, blocks):
    """Per block: the lower triangle with its diagonal stored (C (C + 1) / 2 fp32 writes, 2 FLOPs
    each), and row r summing r loaded entries (C (C - 1) / 2 fp32 reads, one add each)."""
    import tilelang.language as T

    @T.prim_func
    def triangle(X: T.Tensor((blocks, C, C), "float32"), Y: T.Tensor((blocks, C, C), "float32"),
                 S: T.Tensor((blocks, C), "float32")):
        with T.Kernel(blocks, threads=128) as b:
            for r, j in T.Parallel(C, C):
                if j <= r:
                    Y[b, r, j] = T.exp2(r * 1.0) * 2.0
            for r in T.Parallel(C):
                total = T.alloc_var("float32")
                total = 0
                for j in T.serial(r):
                    total += X[b, r, j]
                S[b, r] = total

    return triangle


def _data_dependent_program(N):
    import tilelang.language as T

    @T.prim_func
    def gather(A: T.Tensor((N,), "float32"), B: T.Tensor((N,), "float32")):
        with T.Kernel(1, threads=128):
            for i in T.Parallel(N):
                if A[i] > 0:
                    B[i] = A[i]

    return gather


def test_a_copy_reads_and_writes_each_element_once():
    cost = program_cost(_copy_program(1024, 128))
    assert (cost.bytes_read, cost.bytes_written, cost.gemm_flops, cost.elementwise_flops) == (2048, 2048, 0, 0)
    assert cost.bytes_by_buffer == {"A": 2048, "B": 2048}


def test_a_tiled_gemm_counts_its_flops_and_its_rereads():
    M, N, K, bm, bn, bk = 256, 128, 512, 64, 64, 32
    cost = program_cost(_gemm_program(M, N, K, bm, bn, bk))
    assert cost.gemm_flops == 2 * M * N * K
    assert cost.gemm_flops_by_dtype == {"float16": 2 * M * N * K}
    # A is read once per column of blocks, B once per row of blocks; C written once in fp32
    assert cost.bytes_by_buffer == {"A": M * K * 2 * (N // bn), "B": K * N * 2 * (M // bm), "C": M * N * 4}
    assert cost.intensity == pytest.approx(cost.gemm_flops / cost.bytes)


def test_shared_memory_is_what_one_block_allocates_and_counted_cost_has_the_four_counts():
    """A_s and B_s in fp16, once per block however large the grid; the fragment C_f is registers, not
    shared memory. counted_cost gives the four counts a tuning exercise is graded on."""
    M, N, K, bm, bn, bk = 256, 128, 512, 64, 64, 32
    program = _gemm_program(M, N, K, bm, bn, bk)
    cost = program_cost(program)
    assert cost.shared_bytes == (bm * bk + bk * bn) * 2
    assert counted_cost(program) == CountedCost(global_bytes=cost.bytes, gemm_flops=2 * M * N * K,
                                                elementwise_flops=cost.elementwise_flops, shared_bytes=cost.shared_bytes)


def test_masked_stores_and_triangular_loops_count_only_what_runs():
    C, blocks = 16, 3
    cost = program_cost(_triangle_program(C, blocks))
    stored, summed = C * (C + 1) // 2, C * (C - 1) // 2
    assert cost.bytes_by_buffer == {"Y": blocks * stored * 4, "X": blocks * summed * 4, "S": blocks * C * 4}
    assert cost.bytes_written == blocks * (stored + C) * 4 and cost.bytes_read == blocks * summed * 4
    # exp2 and * per stored entry (TileLang folds r * 1.0 into a cast), one + per summed entry
    assert cost.elementwise_flops == blocks * (2 * stored + summed)


def test_a_condition_on_loaded_values_is_refused():
    with pytest.raises(CostError, match="an if's condition depends on a value loaded from A"):
        program_cost(_data_dependent_program(64))


@pytest.mark.parametrize("B, N, H, d, C, block_dv", [(1, 256, 2, 64, 64, 32), (2, 512, 3, 128, 32, 64)])
def test_stage1_kernel_matches_its_formula(B, N, H, d, C, block_dv):
    from stages.s01_linear_attention.kernel import build_program

    cost = program_cost(build_program(B, N, H, d, d, C, block_dv))
    programs = (d // block_dv) * B * H * (N // C)  # grid blocks times chunks
    # per chunk: Q K^T (C x C x d), Q S^T (C x block_dv x d), scores V (C x block_dv x C), K^T V (d x block_dv x C)
    assert cost.gemm_flops == 2 * programs * (C * C * d + C * block_dv * d + C * C * block_dv + d * block_dv * C)
    # per chunk: Q and K (C x d) and V (C x block_dv) read, O (C x block_dv) written, fp16
    assert cost.bytes_read == programs * (2 * C * d + C * block_dv) * 2
    assert cost.bytes_written == programs * C * block_dv * 2


def test_stage5_kernels_move_each_tensor_as_often_as_their_grids_say():
    from stages.kda.config import SUB_BLOCK
    from stages.kda.prepare import build_prepare_program
    from stages.kda.recurrence import build_recurrence_program

    B, N, H, d, C, block_dv = 1, 256, 2, 128, 64, 32
    tokens = B * N * H
    prepare = program_cost(build_prepare_program(B, N, H, d, d, C, "bfloat16"))
    # every input read once and every output written once: fp32 g, beta and e^{gamma_C}, bf16 the rest
    assert prepare.bytes_by_buffer == {
        "Q": tokens * d * 2, "K": tokens * d * 2, "V": tokens * d * 2, "G": tokens * d * 4, "Beta": tokens * 4,
        "W": tokens * d * 2, "U": tokens * d * 2, "Q_decayed": tokens * d * 2, "K_to_chunk_end": tokens * d * 2,
        "A_qk": tokens * C * 2, "Chunk_decay": tokens // C * d * 4}
    sub, slabs, chunks = SUB_BLOCK, C // SUB_BLOCK - 1, B * H * (N // C)
    # per chunk, over both channel passes: A_kk and A_qk on the whole chunk (C x C x d each) from fp32
    # operands (TF32), on each slab (C x sub x d each) from fp16 ones, then W and U (C x d x C each) in
    # bf16; the inverse's merges in TF32: per block row, L[P, :] T (sub x C x C) and T[P, P] times that
    # (sub x C x sub)
    assert prepare.gemm_flops_by_dtype == {
        "bfloat16": 2 * chunks * 2 * C * d * C,
        "float16": 2 * chunks * slabs * 2 * C * sub * d,
        "float32": 2 * chunks * (2 * C * C * d + slabs * (sub * C * C + sub * C * sub))}
    recurrence = program_cost(build_recurrence_program(B, N, H, d, d, C, block_dv, "bfloat16"))
    passes = d // block_dv  # each value block's program reads the chunk's W, Q e^gamma, K e^(gamma_C - gamma), A_qk
    state = B * H * d * d * 4
    assert recurrence.bytes_by_buffer == {
        "W": passes * tokens * d * 2, "Q_decayed": passes * tokens * d * 2, "K_to_chunk_end": passes * tokens * d * 2,
        "A_qk": passes * tokens * C * 2, "Chunk_decay": passes * tokens // C * d * 4, "U": tokens * d * 2,
        "O": tokens * d * 2, "Initial_state": state, "Final_state": state}
    # per chunk and value block: W S^T, (Q e^gamma) S^T (C x block_dv x d), A_qk V_new (C x block_dv x C),
    # and the state update (d x block_dv x C)
    chunks = passes * B * H * (N // C)
    assert recurrence.gemm_flops == 2 * chunks * (2 * C * block_dv * d + C * block_dv * C + d * block_dv * C)
