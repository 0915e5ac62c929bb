"""Tests of stages/common: the seeded inputs, the error measure, the shape and tile checks, and the
references' input checks of every stage."""

import numpy as np
import pytest

from stages.common.checks import check_array, check_chunking, check_divisor, check_qkv, check_values, padded_length
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.common.torch_checks import check_tile_sizes
from stages.s01_linear_attention import reference as s01
from stages.s02_scalar_decay import reference as s02
from stages.s03_gated_deltanet import reference as s03
from stages.s04_kda import reference as s04
from stages.s05_fast_kda import reference as s05


def test_inputs_are_normalized_and_gates_stay_in_their_range():
    x = make_inputs(2, 16, 3, 8, 5, gate="channel", gate_range=(0.9, 0.95), beta_range=(0.2, 0.3), seed=0)
    np.testing.assert_allclose(np.linalg.norm(x.q, axis=-1), 1.0)
    np.testing.assert_allclose(np.linalg.norm(x.k, axis=-1), 1.0)
    assert x.g.shape == (2, 16, 3, 8) and x.beta.shape == (2, 16, 3)
    assert np.all((np.exp(x.g) >= 0.9) & (np.exp(x.g) <= 0.95))
    assert np.all((x.beta >= 0.2) & (x.beta <= 0.3))


def test_inputs_are_seeded():
    first, second = make_inputs(1, 4, 1, 4, 4, seed=3), make_inputs(1, 4, 1, 4, 4, seed=3)
    assert np.array_equal(first.v, second.v)
    assert not np.array_equal(first.v, make_inputs(1, 4, 1, 4, 4, seed=4).v)


@pytest.mark.parametrize("kwargs, message", [
    (dict(gate="vector"), "gate must be one of"),
    (dict(gate="head", gate_range=(0.0, 0.9)), "gate_range"),
    (dict(gate="head", gate_range=(0.99, 0.9)), "gate_range"),
    (dict(beta_range=(0.5, 1.5)), "beta_range"),
])
def test_inputs_reject_bad_ranges(kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_inputs(1, 4, 1, 4, 4, **kwargs)


def test_error_report_gives_both_measures():
    expected = np.array([3.0, 4.0])
    report = error_report(np.array([3.0, 4.5]), expected)
    assert report.max_abs == pytest.approx(0.5)
    assert report.rel_l2 == pytest.approx(0.5 / 5.0)
    assert np.isnan(error_report(np.array([np.nan, 4.0]), expected).rel_l2)
    with pytest.raises(ValueError, match="shapes differ"):
        error_report(np.zeros(3), expected)


def test_shape_and_chunk_checks():
    x = make_inputs(1, 6, 2, 4, 3, seed=1)
    assert check_qkv(x.q, x.k, x.v) == (1, 6, 2, 4, 3)
    with pytest.raises(ValueError, match="block_dv"):
        check_chunking(6, 3, 4, block_dv=2)
    with pytest.raises(ValueError, match="chunk_size"):
        check_chunking(6, 3, 0)
    assert [padded_length(n, 4) for n in (1, 4, 5, 8)] == [4, 4, 8, 8]


@pytest.mark.parametrize("d_k, d_v, chunk_size, block_dv, message", [
    (128, 128, 48 + 1, 32, "chunk_size"),
    (128, 128, 8, 32, "chunk_size"),
    (100, 128, 64, 32, "d_k"),
    (128, 128, 64, 24, "block_dv"),
    (128, 96, 64, 64, "block_dv"),
])
def test_tile_sizes_the_tensor_cores_refuse(d_k, d_v, chunk_size, block_dv, message):
    with pytest.raises(ValueError, match=message):
        check_tile_sizes(d_k, d_v, chunk_size, block_dv)
    check_tile_sizes(128, 128, 64, 32)  # the default tiles pass


# ----------------------------------------------------------------------------- the references' input checks

# every public reference that takes (q, k, v[, g][, beta], ...): (function, gate, the arguments after them)
REFERENCES = [
    (s01.recurrent, "none", ()), (s01.chunkwise, "none", (4,)), (s01.kernel_mirror, "none", (4, 2)),
    (s02.recurrent, "head", ()), (s02.chunkwise, "head", (4,)), (s02.kernel_mirror, "head", (4, 2)),
    (s03.recurrent, "token", ()), (s03.chunkwise, "token", (4,)), (s03.kernel_mirror, "token", (4, 2)),
    (s04.recurrent, "channel", ()), (s04.chunkwise, "channel", (4,)), (s04.kernel_mirror, "channel", (4, 2)),
    (s05.chunkwise, "channel", (4,)), (s05.kernel_mirror, "channel", (4, 2, 2)), (s05.prepare, "channel", (4, 2)),
]


def _arguments(gate, extra, **changes):
    """The reference's arguments as a dict in call order, valid unless `changes` replaces one."""
    x = make_inputs(1, 8, 2, 4, 4, gate=gate, seed=5)
    names = ("q", "k", "v") + (("g",) if gate != "none" else ()) + (("beta",) if x.beta is not None else ())
    arguments = {name: getattr(x, name) for name in names}
    arguments.update({f"extra{i}": value for i, value in enumerate(extra)})
    unknown = set(changes) - set(arguments)
    assert not unknown, f"no argument {unknown} here"
    return {**arguments, **changes}


def _with(array, index, value):
    changed = array.copy()
    changed[index] = value
    return changed


def _bad_inputs(gate):
    """(argument, how to spoil it, error, message) for a reference of the given gate."""
    x = make_inputs(1, 8, 2, 4, 4, gate=gate, seed=5)
    cases = [
        ("q", x.q.tolist(), TypeError, "q must be a numpy.ndarray, got list"),
        ("k", x.k.astype(np.int64), TypeError, "k must have dtype float64, got int64"),
        ("v", x.v.astype(np.float32), TypeError, "v must have dtype float64, got float32"),
        ("q", _with(x.q, (0, 3, 1, 2), np.nan), ValueError, r"q must be finite, got nan at index \(0, 3, 1, 2\)"),
        ("v", _with(x.v, (0, 7, 0, 1), -np.inf), ValueError, r"v must be finite, got -inf at index \(0, 7, 0, 1\)"),
    ]
    if gate != "none":
        last = (-1,) * x.g.ndim
        cases += [
            ("g", _with(x.g, last, 0.25), ValueError,
             r"g: log gates must be <= 0 \(g = log\(a\), 0 < a <= 1\); its entries span \[.*, 0.25\]"),
            ("g", _with(x.g, last, -np.inf), ValueError, "g must be finite, got -inf"),
            ("g", x.g.astype(np.float32), TypeError, "g must have dtype float64, got float32"),
            ("g", x.g.tolist(), TypeError, "g must be a numpy.ndarray, got list"),
        ]
    if x.beta is not None:
        cases += [
            ("beta", _with(x.beta, (0, 2, 1), 1.5), ValueError, r"beta must lie in \[0, 1\]; its entries span \[.*, 1.5\]"),
            ("beta", _with(x.beta, (0, 2, 1), -0.5), ValueError, r"beta must lie in \[0, 1\]; its entries span \[-0.5, "),
            ("beta", _with(x.beta, (0, 2, 1), np.nan), ValueError, r"beta must be finite, got nan at index \(0, 2, 1\)"),
            ("beta", x.beta.astype(np.int64), TypeError, "beta must have dtype float64, got int64"),
        ]
    return cases


REFERENCE_IDS = [f"{function.__module__.split('.')[1][:3]}.{function.__name__}" for function, _, _ in REFERENCES]


@pytest.mark.parametrize("function, gate, extra", REFERENCES, ids=REFERENCE_IDS)
def test_references_refuse_bad_values_and_types(function, gate, extra):
    for name, spoiled, error, message in _bad_inputs(gate):
        with pytest.raises(error, match=message):
            function(*_arguments(gate, extra, **{name: spoiled}).values())


@pytest.mark.parametrize("function, gate, extra", REFERENCES, ids=REFERENCE_IDS)
def test_references_take_the_ends_of_the_ranges(function, gate, extra):
    """g = 0 (a = 1, no decay) and beta = 0 or 1 are gates and write strengths, not errors."""
    x = make_inputs(1, 8, 2, 4, 4, gate=gate, seed=5)
    edges = {}
    if gate != "none":
        edges["g"] = np.zeros_like(x.g)
    if x.beta is not None:
        edges["beta"] = np.where(np.arange(8)[None, :, None] % 2 == 0, 0.0, 1.0) + np.zeros_like(x.beta)
    function(*_arguments(gate, extra, **edges).values())


@pytest.mark.parametrize("function, gate, extra", [r for r in REFERENCES if r[2]],
                         ids=[i for i, r in zip(REFERENCE_IDS, REFERENCES) if r[2]])
@pytest.mark.parametrize("chunk_size", [0, -4, 4.0, True, None])
def test_references_refuse_a_chunk_size_that_is_not_a_positive_integer(function, gate, extra, chunk_size):
    with pytest.raises(ValueError, match=f"chunk_size must be a positive integer, got {chunk_size!r}"):
        function(*_arguments(gate, extra, extra0=chunk_size).values())


def test_the_references_other_public_functions_check_their_inputs():
    x = make_inputs(1, 8, 1, 4, 4, gate="channel", seed=6)
    with pytest.raises(ValueError, match=r"g_head: log gates must be <= 0 .*; its entries span \[0.1, 0.1\]"):
        s02.decay_table(0.1, 4)
    with pytest.raises(ValueError, match="g_head must be finite, got nan"):
        s02.decay_table(np.nan, 4)
    with pytest.raises(TypeError, match="g_head must be a real number or a numpy.ndarray, got str"):
        s02.decay_table("-0.1", 4)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer, got 4.0"):
        s02.decay_table(-0.1, 4.0)
    with pytest.raises(ValueError, match="sub_chunk_size must be a positive divisor of chunk_size = 4, got 2.0"):
        s04.kernel_mirror(x.q, x.k, x.v, x.g, x.beta, 4, 2, sub_chunk_size=2.0)
    with pytest.raises(ValueError, match="sub_block must be a positive divisor of chunk_size = 8, got 0"):
        s05.prepare(x.q, x.k, x.v, x.g, x.beta, 8, 0)
    Q, K, gamma = x.q[0, :, 0], x.k[0, :, 0], np.cumsum(x.g[0, :, 0], axis=0)
    with pytest.raises(ValueError, match=r"gamma must have shape K's \(C, d_k\) = \(8, 4\), got \(8, 3\)"):
        s05.intra_chunk_scores(Q, K, gamma[:, :3], 4)
    with pytest.raises(ValueError, match=r"Q must be finite, got nan at index \(2, 1\)"):
        s05.intra_chunk_scores(_with(Q, (2, 1), np.nan), K, gamma, 4)
    with pytest.raises(ValueError, match="sub_block must be a positive divisor of C = 8, got 3"):
        s05.intra_chunk_scores(Q, K, gamma, 3)
    with pytest.raises(ValueError, match=r"L must have shape \(C, C\) = \(8, 8\), got \(8, 4\)"):
        s05.block_inverse(np.zeros((8, 4)), 4)
    with pytest.raises(ValueError, match="block must be a positive divisor of C = 8, got 3"):
        s05.block_inverse(np.zeros((8, 8)), 3)
    tensors = s05.prepare(x.q, x.k, x.v, x.g, x.beta, 4, 2)
    with pytest.raises(ValueError, match=r"initial_state must have shape \(B, H, d_k, d_v\) = \(1, 1, 4, 4\), got \(1, 4, 4\)"):
        s05.recurrence(tensors, 2, initial_state=np.zeros((1, 4, 4)))
    with pytest.raises(TypeError, match="initial_state must have dtype float64, got float32"):
        s05.recurrence(tensors, 2, initial_state=np.zeros((1, 1, 4, 4), np.float32))


def test_checks_name_the_argument_and_pass_empty_arrays():
    check_array("x", np.zeros((2, 0)), 2)  # nothing to check: no minimum, no error
    with pytest.raises(ValueError, match=r"x must have rank 3 \(B, N, H\), got shape \(2, 0\)"):
        check_array("x", np.zeros((2, 0)), 3, "(B, N, H)")
    with pytest.raises(ValueError, match=r"y must lie in \[0.0, 1.0\]; its entries span \[0.5, 2\]"):
        check_values("y", np.array([0.5, 2.0]), 0.0, 1.0)
    check_divisor("block_dv", np.int64(2), "d_v", 4)  # NumPy integers are integers
    with pytest.raises(ValueError, match="block_dv must be a positive divisor of d_v = 4, got True"):
        check_divisor("block_dv", True, "d_v", 4)


@pytest.mark.parametrize("gate, has_beta", [("none", False), ("head", False), ("token", True), ("channel", True)])
def test_inputs_draw_beta_for_the_gates_that_take_it(gate, has_beta):
    x = make_inputs(1, 8, 2, 4, 4, gate=gate, seed=0)
    assert (x.beta is not None) == has_beta
    if has_beta:
        assert x.beta.shape == (1, 8, 2) and np.all((x.beta >= 0.1) & (x.beta <= 0.9))
        assert np.array_equal(x.beta, make_inputs(1, 8, 2, 4, 4, gate=gate, beta_range=(0.1, 0.9), seed=0).beta)


def test_compile_in_threads_runs_every_job_at_once_and_keeps_failures():
    """Each job in its own thread (all four wait on one barrier: run one after another they would time
    out), results by key in the jobs' order, a failure kept as its exception and logged."""
    import threading

    from stages.common.tilelang_tools import compile_in_threads

    together = threading.Barrier(4, timeout=10)

    def job(value):
        together.wait()
        if value == "bad":
            raise ValueError("no valid warp partition")
        return value * 2

    heard = []
    results = compile_in_threads({key: (lambda key=key: job(key)) for key in ("a", "b", "bad", "c")}, heard.append)
    assert list(results) == ["a", "b", "bad", "c"]
    assert [results[key] for key in ("a", "b", "c")] == ["aa", "bb", "cc"]
    assert isinstance(results["bad"], ValueError)
    assert len(heard) == 4 and any("FAILED to compile bad: ValueError: no valid warp partition" in m for m in heard)
    assert compile_in_threads({}) == {}


def test_barriers_in_thread_branches_finds_a_full_barrier_that_warps_skip():
    """The shape of stage 6's intra kernel at 256 threads (it hung on the H200): __syncthreads() in a
    loop under `if (32 <= (threadIdx.x & 127))`; in the else of such a branch too. Barriers in plain
    loops, partial barriers, and branches on other values are fine."""
    from stages.common.tilelang_tools import barriers_in_thread_branches

    source = """extern "C" __global__ void k(float* x) {
  __syncthreads();
  for (int i = 0; i < 8; ++i) {
    __syncthreads();
  }
  if (32 <= (((int)threadIdx.x) & 127)) {
    tl::__sync_thread_partial(4, 192);
    #pragma unroll
    for (int i_33 = 0; i_33 < 8; ++i_33) {
      __syncthreads();
      x[i_33] = 0;
    }
  }
  if (blockIdx.x == 0) {
    __syncthreads();
  }
  if (((int)threadIdx.x) < 64) {
    x[0] = 1;
  } else {
    __syncthreads();
  }
  __syncthreads();
}"""
    assert barriers_in_thread_branches(source) == [(10, "if (32 <= (((int)threadIdx.x) & 127)) {"),
                                                    (20, "if (((int)threadIdx.x) < 64) {")]
    assert barriers_in_thread_branches(source.replace("threadIdx", "blockIdx")) == []


def test_warp_group_offsets_between_atoms_finds_a_slice_read_by_the_wrong_warp_group():
    """Lines as TileLang 0.1.15 wrote them for stage 6's intra kernel at 256 threads: the whole
    64-row K_col_s moved by one atom (4096 bytes: fine), its 16-row slice by 1024 (wrong), a K-major
    operand (leading byte offset 1: no atoms along its rows) and a 16-row buffer of its own (fine)."""
    from stages.common.tilelang_tools import warp_group_offsets_between_atoms

    def gemm(name, layout, buffer, offset):
        return (f"tl::initialize_wgmma_descriptor<{layout}>({name}, (&(((bfloat16_t*){buffer})[0])));\n"
                f"tl::wgmma_ss<tl::DataType::kBFloat16, 64, 32, 16, true, true, 1, 1>(uint64_t(desc_a + 0), "
                f"uint64_t({name} + ((((((int)threadIdx.x) >> 7) * {offset}) + (ki * 1024)) >> 4)), "
                f"((uint32_t*)(rows_f + 0)), 0);\n")

    whole = gemm("desc_b_11", "2, 256, 32", "K_col_s", 4096)
    slice_ = gemm("desc_b_15", "2, 256, 32", "K_col_s", 1024)
    k_major = gemm("desc_b_1", "2, 1, 32", "K_col_s", 512)
    own = gemm("desc_b_16", "2, 64, 32", "K_slab_col_s", 1024)
    two_atoms = gemm("desc_b_6", "1, 512, 64", "dV_new_s", 16384)
    assert warp_group_offsets_between_atoms(whole + k_major + own + two_atoms) == []
    assert warp_group_offsets_between_atoms(whole + slice_ + own) == [("desc_b_15", "K_col_s", 1024, 4096)]


def test_a_lowered_kernel_is_kept_under_its_program_and_options(tmp_path, monkeypatch):
    """lower_kernel keeps a kernel in $KDACOURSE_COMPILE_CACHE: the same program lowered again comes from
    the folder (TileLang's lowering not called), equal to the first; another program, or the same under
    other pass options, is lowered anew."""
    pytest.importorskip("tilelang")
    from stages.common import tilelang_tools
    from stages.s01_linear_attention.kernel import build_program

    monkeypatch.setenv("KDACOURSE_COMPILE_CACHE", str(tmp_path))
    lowered = []
    real_lower = tilelang_tools.lower
    monkeypatch.setattr(tilelang_tools, "lower", lambda program: lowered.append(program) or real_lower(program))

    first = tilelang_tools.lower_kernel(build_program(1, 64, 1, 32, 32))
    again = tilelang_tools.lower_kernel(build_program(1, 64, 1, 32, 32))
    assert len(lowered) == 1 and again == first and first.threads > 0 and "__global__" in first.cuda_source
    assert len(list(tmp_path.glob("*.lowered.json"))) == 1

    longer = tilelang_tools.lower_kernel(build_program(1, 128, 1, 32, 32))
    assert len(lowered) == 2 and longer.cuda_source != first.cuda_source
    tilelang_tools.lower_kernel(build_program(1, 64, 1, 32, 32), {"tl.disable_warp_specialized": True})
    assert len(lowered) == 3 and len(list(tmp_path.glob("*.lowered.json"))) == 3
