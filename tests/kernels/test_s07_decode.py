"""Stage 7, the decode step: the reference, the kernel and its wrapper `decode`.

The decode reference, run token by token, against stage 4's reference A (from a zero state) and
against the references that take an initial state (stage 6's reference A, stage 5's recurrence); the
kernel through the tile interpreter against the reference, in float64 (tight) and fp16 / bf16 (a few
units of the dtype's roundoff); pool slots not in `slots` untouched; bad inputs refused, by the
reference and by the wrapper on any machine; the kernel compiled for sm_90a (`compile`) and run on a
GPU (`gpu`). Prefill is tests/kernels/test_s07_prefill.py; the two serving together, tests/stages/test_s07_serving.py.
"""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.device_checks import BAD_BETA, BAD_GATE, BAD_SLOT, FLAG_COUNT
from stages.common.errors import error_report
from stages.s07_serving.reference import decode_step
from tests.stages.s07_cases import (B, BLOCK_DV, D_K, D_V, FP32_FLOOR, H, P, POOL_AXES, SLOTS, UNIT_ROUNDOFF,
                             final_state_of_reference_a, make_sequences)


def _slots(B, P, seed):
    """B distinct slots of a pool of P, in no particular order (never simply 0, 1, ..., B - 1)."""
    slots = np.random.default_rng(seed).permutation(P)[:B]
    return slots if not np.array_equal(slots, np.arange(B)) else slots[::-1].copy()


def _token(x, t):
    """Token t of every sequence: q, k (B, H, d_k), v (B, H, d_v), g (B, H, d_k), beta (B, H)."""
    return tuple(np.ascontiguousarray(a[:, t]) for a in (x.q, x.k, x.v, x.g, x.beta))


def _decode_all(x, pool, slots):
    """decode_step on every token in order: o (B, N, H, d_v); the pool ends with the final states."""
    return np.stack([decode_step(*_token(x, t), pool, slots) for t in range(x.q.shape[1])], axis=1)


# ------------------------------------------------------------------------------------------ reference


@pytest.mark.parametrize("B, N, H, d_k, d_v, P", [(3, 12, 2, 6, 4, 7), (1, 9, 3, 4, 8, 1), (2, 20, 1, 8, 8, 2)])
def test_decode_steps_from_zero_equal_reference_a(B, N, H, d_k, d_v, P):
    """Token by token from a zero pool: reference A's outputs and final states (rel L2 <= 1e-12)."""
    x = make_sequences(B, N, H, d_k, d_v, seed=N + P)
    expected_o, expected_state = final_state_of_reference_a(x)
    pool, slots = np.zeros((P, H, d_k, d_v)), _slots(B, P, seed=N)
    assert_close(_decode_all(x, pool, slots), expected_o, rel_l2=1e-12)
    assert_close(pool[slots], expected_state, rel_l2=1e-12, name="the final states", axes=("batch", "head", "d_k", "d_v"))


def test_decode_steps_from_a_state_equal_the_references_with_initial_state():
    """From a nonzero state: stage 6's reference A and stage 5's recurrence, both given initial_state."""
    from stages.s05_fast_kda.reference import prepare, recurrence
    from stages.s06_backward.reference import recurrent_backward

    B, N, H, d_k, d_v, P = 2, 13, 2, 8, 4, 5
    x = make_sequences(B, N, H, d_k, d_v, seed=11)
    initial_state = np.random.default_rng(12).standard_normal((B, H, d_k, d_v))
    pool, slots = np.random.default_rng(13).standard_normal((P, H, d_k, d_v)), _slots(B, P, seed=14)
    pool[slots] = initial_state
    o = _decode_all(x, pool, slots)
    a = recurrent_backward(x.q, x.k, x.v, x.g, x.beta, np.zeros((B, N, H, d_v)), initial_state)
    assert_close(o, a.o, rel_l2=1e-12)
    assert_close(pool[slots], a.final_state, rel_l2=1e-12, name="the final states", axes=("batch", "head", "d_k", "d_v"))
    chunk_o, chunk_state = recurrence(prepare(x.q, x.k, x.v, x.g, x.beta, 4, sub_block=2), 2, initial_state)
    assert_close(o, chunk_o[:, :N], rel_l2=1e-12, name="o against stage 5's recurrence")
    assert_close(pool[slots], chunk_state, rel_l2=1e-12, name="the final states against stage 5's recurrence",
                 axes=("batch", "head", "d_k", "d_v"))


def test_decode_step_writes_only_its_slots_and_leaves_inputs():
    B, H, d_k, d_v, P = 3, 2, 4, 5, 8
    x = make_sequences(B, 1, H, d_k, d_v, seed=3)
    token = _token(x, 0)
    before = [a.copy() for a in token]
    pool, slots = np.random.default_rng(4).standard_normal((P, H, d_k, d_v)), np.array([6, 0, 3])
    original = pool.copy()
    decode_step(*token, pool, slots)
    others = np.setdiff1d(np.arange(P), slots)
    assert np.array_equal(pool[others], original[others]), "a slot not in `slots` changed"
    assert not np.any(pool[slots] == original[slots]), "a slot in `slots` kept its state"
    for given, kept in zip(token, before):
        assert np.array_equal(given, kept), "decode_step changed an input"


BAD_INPUTS = [
    (dict(slots=np.array([0, 0])), ValueError, "slots must be distinct"),
    (dict(slots=np.array([0, 4])), ValueError, r"slots must lie in \[0, P\) = \[0, 4\)"),
    (dict(slots=np.array([-1, 2])), ValueError, r"slots must lie in \[0, P\)"),
    (dict(slots=np.array([0, 1, 2])), ValueError, r"slots must have shape \(B,\) = \(2,\)"),
    (dict(slots=np.array([0.0, 1.0])), TypeError, "slots must have an integer dtype"),
    (dict(slots=[0, 1]), TypeError, "slots must be a numpy.ndarray"),
    (dict(state_pool=np.zeros((4, 2, 3, 5))), ValueError, "state_pool must be"),
    (dict(state_pool=np.zeros((4, 2, 3, 4), np.float32)), TypeError, "state_pool must have dtype float64"),
    (dict(g=np.full((2, 2, 3), 0.1)), ValueError, "log gates must be <= 0"),
    (dict(beta=np.full((2, 2), 1.5)), ValueError, r"beta must lie in \[0, 1\]"),
    (dict(q=np.zeros((2, 1, 2, 3))), ValueError, "q must have rank 3"),
    (dict(k=np.zeros((2, 2, 4))), ValueError, "k must have q's shape"),
    (dict(v=np.zeros((2, 3, 4))), ValueError, "v must be"),
]


@pytest.mark.parametrize("change, error, message", BAD_INPUTS)
def test_decode_step_refuses_bad_inputs_and_leaves_the_pool(change, error, message):
    x = make_sequences(2, 1, 2, 3, 4, seed=5)
    q, k, v, g, beta = _token(x, 0)
    arguments = dict(q=q, k=k, v=v, g=g, beta=beta, state_pool=np.ones((4, 2, 3, 4)), slots=np.array([2, 0]))
    arguments.update(change)
    pool = arguments["state_pool"]
    kept = np.array(pool, copy=True)
    with pytest.raises(error, match=message):
        decode_step(**arguments)
    assert np.array_equal(pool, kept), "a refused call changed the pool"


# ------------------------------------------------------------------------------------------ kernel, interpreter

# the case: B, H, D_K, D_V, BLOCK_DV, P and SLOTS of tests.stages.s07_cases (the serving tests run it too)


def _run_kernel(x, pool, dtype, state_dtype="float32", steps=None):
    """Every token of x through the interpreted kernel, in order, on `pool` (float64 array, updated in
    place); returns o (B, N, H, d_v)."""
    from stages.common.interpreter import interpret
    from stages.kda.decode import build_decode_program

    kernel = interpret(build_decode_program(B, P, H, D_K, D_V, BLOCK_DV, dtype=dtype, state_dtype=state_dtype))
    outputs = []
    flags = np.zeros(FLAG_COUNT, dtype=np.int32)
    for t in range(steps or x.q.shape[1]):
        o = np.zeros((B, H, D_V))
        kernel(*_token(x, t), SLOTS.astype(np.int32), pool, flags, o)  # writes o and the pool in place
        outputs.append(o)
    assert not flags.any(), flags  # good inputs flag nothing
    return np.stack(outputs, axis=1)


def _kernel_case(seed, N=3):
    """Inputs for N steps and a pool whose entries are already fp32 values (so that rounding the pool
    to the kernel's fp32 changes no entry the kernel does not write)."""
    x = make_sequences(B, N, H, D_K, D_V, seed=seed, gate_range=(0.5, 1.0))
    pool = np.random.default_rng(seed).standard_normal((P, H, D_K, D_V)).astype(np.float32).astype(np.float64)
    return x, pool


def _reference_steps(x, pool):
    expected_pool = pool.copy()
    return _decode_all(x, expected_pool, SLOTS), expected_pool


def test_float64_kernel_matches_the_reference():
    """The program with float64 operands and a float64 state: the reference's values to 1e-12."""
    x, pool = _kernel_case(seed=21)
    expected_o, expected_pool = _reference_steps(x, pool)
    o = _run_kernel(x, pool, "float64", state_dtype="float64")
    assert_close(o, expected_o, rel_l2=1e-12, axes=("batch", "token", "head", "channel"))
    assert_close(pool, expected_pool, rel_l2=1e-12, name="the pool", axes=POOL_AXES)


def test_float64_kernel_with_the_fp32_state_rounds_like_fp32():
    """The GPU's state dtype, fp32, with exact operands: fp32's rounding and no more."""
    x, pool = _kernel_case(seed=22)
    expected_o, expected_pool = _reference_steps(x, pool)
    o = _run_kernel(x, pool, "float64")
    assert_close(o, expected_o, rel_l2=FP32_FLOOR, axes=("batch", "token", "head", "channel"))
    assert_close(pool, expected_pool, rel_l2=FP32_FLOOR, name="the pool", axes=POOL_AXES)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_kernel_rounds_like_its_dtype(dtype):
    """q, k, v and o in the dtype, the state in fp32: o within [u/4, 4u] of the reference's (the lower
    end shows that the casts round at all), the pool within 4u."""
    x, pool = _kernel_case(seed=23)
    expected_o, expected_pool = _reference_steps(x, pool)
    u = UNIT_ROUNDOFF[dtype]
    o = _run_kernel(x, pool, dtype)
    assert_close(o, expected_o, rel_l2=4 * u, axes=("batch", "token", "head", "channel"))
    assert error_report(o, expected_o).rel_l2 >= u / 4, f"{dtype} does not round"
    assert_close(pool, expected_pool, rel_l2=4 * u, name="the pool", axes=POOL_AXES)


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_kernel_leaves_other_slots_untouched(dtype):
    x, pool = _kernel_case(seed=24, N=2)
    original = pool.copy()
    _run_kernel(x, pool, dtype)
    others = np.setdiff1d(np.arange(P), SLOTS)
    assert np.array_equal(pool[others], original[others]), "the kernel wrote a slot not in `slots`"
    assert not np.any(pool[SLOTS] == original[SLOTS]), "the kernel left a slot in `slots` as it was"


def _one_step_flags(change):
    """One interpreted step with x's first token changed by `change(g, beta, slots)` (in place):
    (the flags it set, the pool before, the pool after)."""
    from stages.common.interpreter import interpret
    from stages.kda.decode import build_decode_program

    x, pool = _kernel_case(seed=25, N=1)
    q, k, v, g, beta = (a.copy() for a in _token(x, 0))
    slots = SLOTS.astype(np.int32)
    change(g, beta, slots)
    before, flags = pool.copy(), np.zeros(FLAG_COUNT, dtype=np.int32)
    interpret(build_decode_program(B, P, H, D_K, D_V, BLOCK_DV, dtype="float64", state_dtype="float64"))(
        q, k, v, g, beta, slots, pool, flags, np.zeros((B, H, D_V)))
    return flags, before, pool


def _set(name, index, value):
    def change(g, beta, slots):
        {"g": g, "beta": beta, "slots": slots}[name][index] = value
    return change


@pytest.mark.parametrize("name, index, value, flag", [
    ("g", (1, 0, 3), 0.25, BAD_GATE), ("g", (2, 1, 0), np.nan, BAD_GATE), ("g", (0, 1, 15), -np.inf, BAD_GATE),
    ("beta", (1, 1), 1.5, BAD_BETA), ("beta", (0, 0), -0.01, BAD_BETA), ("beta", (2, 0), np.nan, BAD_BETA),
    ("slots", 1, P, BAD_SLOT), ("slots", 2, -1, BAD_SLOT),
])
def test_the_kernel_flags_a_bad_value_on_the_device(name, index, value, flag):
    """A bad g, beta or slot sets its flag, and only its; the edges (g = 0, a large negative g, beta
    at 0 and 1, slots 0 and P - 1) set none."""
    flags, _, _ = _one_step_flags(_set(name, index, value))
    assert flags.tolist() == [int(kind == flag) for kind in range(FLAG_COUNT)]


def test_edge_values_flag_nothing():
    def edges(g, beta, slots):
        g[0, 0, 0], g[1, 1, 1], beta[0, 0], beta[1, 1] = 0.0, -1e4, 0.0, 1.0
        slots[:] = [P - 1, 0, 3]

    flags, _, _ = _one_step_flags(edges)
    assert not flags.any(), flags


def test_a_slot_outside_the_pool_writes_nothing_anywhere():
    """The program of a slot past the pool reads slot 0 (in bounds) and writes no state: every slot
    but the two good sequences' is as it was, the wrapped-around slot 0 included."""
    flags, before, after = _one_step_flags(_set("slots", 1, P + 3))
    assert flags[BAD_SLOT] == 1
    good = SLOTS[[0, 2]]
    untouched = np.setdiff1d(np.arange(P), good)
    assert np.array_equal(after[untouched], before[untouched])
    assert not np.any(after[good] == before[good])


def test_the_unflagged_decode_takes_no_flags_and_still_writes_no_slot_outside_the_pool():
    """value_flags=False (decode's checks="off"): no Flags parameter, so bad values set nothing; a slot
    past the pool still reads slot 0 and writes no state."""
    from stages.common.interpreter import interpret
    from stages.kda.decode import build_decode_program

    program = build_decode_program(B, P, H, D_K, D_V, BLOCK_DV, dtype="float64", state_dtype="float64",
                                   value_flags=False)
    assert "Flags" not in [program.buffer_map[p].name for p in program.params]
    x, pool = _kernel_case(seed=25, N=1)
    q, k, v, g, beta = (a.copy() for a in _token(x, 0))
    g[1, 0, 3], beta[0, 0] = 0.25, 1.5
    slots = SLOTS.astype(np.int32)
    slots[1] = P + 3
    before = pool.copy()
    interpret(program)(q, k, v, g, beta, slots, pool, np.zeros((B, H, D_V)))
    untouched = np.setdiff1d(np.arange(P), SLOTS[[0, 2]])
    assert np.array_equal(pool[untouched], before[untouched])


# ------------------------------------------------------------------------------------------ the wrapper


def _torch_arguments(B=2, H=2, d_k=16, d_v=32, P=4):
    import torch

    q, k = torch.randn(B, H, d_k, dtype=torch.float16), torch.randn(B, H, d_k, dtype=torch.float16)
    v = torch.randn(B, H, d_v, dtype=torch.float16)
    g, beta = -torch.rand(B, H, d_k), torch.rand(B, H)
    return dict(q=q, k=k, v=v, g=g, beta=beta, state_pool=torch.zeros(P, H, d_k, d_v),
                slots=torch.tensor([3, 1], dtype=torch.int32))


def _bad_wrapper_inputs():
    import torch

    from stages.kda.config import KernelConfig

    return [
        (dict(q=torch.randn(2, 2, 16, dtype=torch.float64)), TypeError,
         "q must have dtype float16 or bfloat16 or float32, got float64"),
        (dict(k=torch.randn(2, 2, 8, dtype=torch.float16)), ValueError, "k must have the shape of q"),
        (dict(v=torch.randn(2, 2, 32, dtype=torch.bfloat16)), ValueError, "v must have the dtype of q"),
        (dict(v=torch.randn(2, 3, 32, dtype=torch.float16)), ValueError, r"v must be \(B, H, d_v\)"),
        (dict(g=torch.zeros(2, 2, 16, dtype=torch.float16)), TypeError, "g must have dtype float32"),
        (dict(beta=torch.zeros(2, 3)), ValueError, r"beta must have shape \(B, H\)"),
        (dict(state_pool=torch.zeros(4, 2, 16, 32, dtype=torch.float16)), TypeError, "state_pool must have dtype float32"),
        (dict(state_pool=torch.zeros(4, 2, 32, 16)), ValueError, "state_pool must be"),
        (dict(state_pool=torch.zeros(4, 2, 32, 16).transpose(2, 3)), ValueError, "state_pool must be contiguous"),
        (dict(slots=torch.tensor([3, 1])), TypeError, "slots must have dtype int32"),
        (dict(slots=torch.tensor([3, 1, 0], dtype=torch.int32)), ValueError, r"slots must have shape \(B,\)"),
        (dict(checks="host", slots=torch.tensor([1, 1], dtype=torch.int32)), ValueError, "slots must be distinct"),
        (dict(checks="host", slots=torch.tensor([0, 4], dtype=torch.int32)), ValueError, r"slots must lie in \[0, P\) = \[0, 4\)"),
        (dict(checks="host", g=torch.full((2, 2, 16), 0.5)), ValueError, "g must be finite and <= 0"),
        (dict(checks="host", beta=torch.full((2, 2), 2.0)), ValueError, r"beta must lie in \[0, 1\]"),
        (dict(config=KernelConfig(block_dv=12)), ValueError, "block_dv must be a positive divisor of d_v = 32"),
        (dict(checks="sometimes"), ValueError, "checks must be one of 'device', 'host', 'off'"),
        (dict(), ValueError, "must be on a CUDA device"),  # every check passed: the device is last
    ]


@pytest.mark.parametrize("case", range(18))
def test_wrapper_refuses_bad_inputs_on_any_machine(case):
    """Every check runs before the device check, so each shows on a CPU-only machine."""
    from stages.kda.calls import decode

    change, error, message = _bad_wrapper_inputs()[case]
    arguments = _torch_arguments()
    arguments.update(change)
    with pytest.raises(error, match=message):
        decode(**arguments)


def test_the_default_call_leaves_the_values_to_the_kernel():
    """checks="device": repeated slots and a positive gate reach the device check (no host read)."""
    import torch

    from stages.kda.calls import decode

    arguments = _torch_arguments()
    arguments.update(slots=torch.tensor([1, 1], dtype=torch.int32), g=torch.full((2, 2, 16), 0.5))
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        decode(**arguments)
    with pytest.raises(ValueError, match="must be on a CUDA device"):
        decode(**arguments, checks="off")


# ------------------------------------------------------------------------------------------ compile, GPU


@pytest.mark.compile
def test_kernel_compiles_for_sm90a_without_spills():
    """At the benchmark's shape (B=64, H=32, d=128, a pool of 256 slots, bf16)."""
    from stages.s07_serving.kernel import compile_report

    report = compile_report()
    print("decode sm_90a:", report.summary())
    assert report.spill_stores == 0 and report.spill_loads == 0, report.summary()
    assert not report.divergent_barriers, report.divergent_barriers  # a barrier some warps skip hangs the GPU
    assert not report.misplaced_warp_group_operands, report.misplaced_warp_group_operands  # wrong columns read
    assert report.registers <= 128, report.summary()  # 4 blocks of 128 threads per SM at least
    assert report.shared_memory <= 8 * 1024, report.summary()  # q, k, e^g, v and the reductions' scratch


@pytest.mark.compile
def test_a_pool_past_2_31_entries_is_indexed_in_64_bits():
    """8192 slots of H=32, d=128 hold 2^32 fp32 entries: the state's addresses must not wrap in int32."""
    from stages.common.tilelang_tools import lower
    from stages.kda.decode import build_decode_program

    source = lower(build_decode_program(64, 8192, 32, 128, 128, dtype="bfloat16")).kernel_source
    accesses = [line for line in source.splitlines() if "State_pool +" in line]
    assert len(accesses) == 2, accesses  # one read, one write
    assert all("(int64_t)slot" in line for line in accesses), accesses


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
@pytest.mark.parametrize("B, P, H, d_k, d_v", [(8, 32, 4, 128, 128), (5, 9, 2, 64, 128)])
def test_kernel_matches_reference_on_gpu(dtype_name, B, P, H, d_k, d_v):
    """Four steps on the GPU against the reference: o and the states within 4u, other slots bitwise kept."""
    import torch

    from stages.kda.calls import decode

    N = 4
    x = make_sequences(B, N, H, d_k, d_v, seed=B + d_k, gate_range=(0.5, 1.0))
    rng = np.random.default_rng(d_k)
    pool = rng.standard_normal((P, H, d_k, d_v)).astype(np.float32).astype(np.float64) * 0.1
    slots = _slots(B, P, seed=P)
    expected_pool = pool.copy()
    expected = _decode_all(x, expected_pool, slots)
    dtype = getattr(torch, dtype_name)
    pool_gpu = torch.tensor(pool, dtype=torch.float32, device="cuda")
    slots_gpu = torch.tensor(slots, dtype=torch.int32, device="cuda")
    outputs = []
    for t in range(N):
        q, k, v, g, beta = _token(x, t)
        outputs.append(decode(*(torch.tensor(a, dtype=dtype, device="cuda") for a in (q, k, v)),
                              *(torch.tensor(a, dtype=torch.float32, device="cuda") for a in (g, beta)),
                              pool_gpu, slots_gpu)[0])
    o = torch.stack(outputs, dim=1).double().cpu().numpy()
    u = UNIT_ROUNDOFF[dtype_name]
    print(f"{dtype_name} B={B} P={P} H={H} d_k={d_k} d_v={d_v}: o {error_report(o, expected)}, "
          f"pool {error_report(pool_gpu, expected_pool)}")
    assert_close(o, expected, rel_l2=4 * u, axes=("batch", "token", "head", "channel"))
    assert_close(pool_gpu.double().cpu().numpy(), expected_pool, rel_l2=4 * u, name="the pool", axes=POOL_AXES)
    others = np.setdiff1d(np.arange(P), slots)
    assert np.array_equal(pool_gpu.cpu().numpy()[others], pool[others].astype(np.float32)), "another slot changed"


@pytest.mark.gpu
def test_the_default_call_flags_bad_values_and_captures_in_a_cuda_graph():
    """checks="device" on the GPU: a good step replayed from a CUDA graph equals the eager steps and
    flags nothing; a positive gate, a beta above 1, a slot past the pool and a NaN g or beta each raise
    at raise_if_flagged (not at the call), the slot's step writing no state; with checks="off" none of
    them flags."""
    import torch

    from stages.common.device_checks import MESSAGES, raise_if_flagged
    from stages.kda.calls import decode

    device = torch.device("cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    B_, P_, H_, d = 4, 8, 2, 64
    q, k = (torch.randn(B_, H_, d, device=device, generator=generator).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(B_, H_, d, device=device, generator=generator).to(torch.bfloat16)
    k = k / k.float().norm(dim=-1, keepdim=True).to(k.dtype)
    g = -torch.rand(B_, H_, d, device=device, generator=generator)
    beta = torch.rand(B_, H_, device=device, generator=generator)
    slots = torch.tensor([5, 0, 7, 2], dtype=torch.int32, device=device)
    pool = torch.randn(P_, H_, d, d, device=device, generator=generator)
    raise_if_flagged(device)

    eager_pool = pool.clone()
    for _ in range(2):
        eager_o, _ = decode(q, k, v, g, beta, eager_pool, slots)
    graph_pool = pool.clone()
    decode(q, k, v, g, beta, graph_pool.clone(), slots)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_o, _ = decode(q, k, v, g, beta, graph_pool, slots)
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_o, eager_o) and torch.equal(graph_pool, eager_pool)
    raise_if_flagged(device)  # good values: quiet

    bad_gate, bad_beta, bad_slots = g.clone(), beta.clone(), slots.clone()
    bad_gate[1, 0, 3], bad_beta[2, 1], bad_slots[3] = 0.5, 1.5, P_
    nan_gate, nan_beta = g.clone(), beta.clone()  # NaN: the test the compiler could simplify away
    nan_gate[0, 1, 7], nan_beta[3, 0] = float("nan"), float("nan")
    for change, message in ((dict(g=bad_gate), MESSAGES[0]), (dict(beta=bad_beta), MESSAGES[1]),
                            (dict(slots=bad_slots), MESSAGES[2]), (dict(g=nan_gate), MESSAGES[0]),
                            (dict(beta=nan_beta), MESSAGES[1])):
        arguments = dict(q=q, k=k, v=v, g=g, beta=beta, state_pool=pool.clone(), slots=slots)
        arguments.update(change)
        before = arguments["state_pool"].clone()
        decode(**arguments)  # no sync, no error here
        with pytest.raises(ValueError) as raised:
            raise_if_flagged(device)
        assert str(raised.value) == message
        if "slots" in change:
            kept = torch.ones(P_, dtype=torch.bool, device=device)
            kept[slots[:3].long()] = False
            assert torch.equal(arguments["state_pool"][kept], before[kept]), "a slot past the pool wrote a state"
        decode(**dict(arguments, state_pool=before.clone()), checks="off")
        raise_if_flagged(device)  # "off": the kernel without the flags sets nothing


@pytest.mark.parametrize("d_v, block_dv", [(128, 64), (64, 64), (32, 32), (96, 32)])
def test_decode_takes_64_value_columns_where_they_divide_d_v(d_v, block_dv):
    from stages.kda.config import decode_block_dv

    assert decode_block_dv(d_v) == block_dv
