"""Stage 7, prefill and decode serving together, as an engine serves them.

Three sequences of one server: prompts prefilled in pieces of any sizes, each sequence's state
carried in a pool between steps, then decode steps; every token's output and the final states
against one pass of stage 4's reference A, through the references and the interpreted decode kernel
on the CPU and through the GPU kernels (`gpu`). Then stage 6's KDALayer with its kernel served the
same way: y and the cache against one forward of the layer. Each product alone:
tests/kernels/test_s07_decode.py and tests/kernels/test_s07_prefill.py.
"""

import numpy as np
import pytest

from stages.common.compare import assert_close
from stages.common.device_checks import FLAG_COUNT
from stages.common.errors import error_report
from stages.s07_serving.reference import decode_step
from tests.stages.s07_cases import (B, BLOCK_DV, D_K, D_V, H, P, POOL_AXES, SLOTS, UNIT_ROUNDOFF, final_state_of_reference_a,
                             make_sequences)


# ------------------------------------------------------------------------------------------ end to end, as a server

# Three sequences of one server: the prompt pieces each prefill step takes from each (one token,
# under, at and over the chunk of 64, and steps where a sequence has nothing to prefill), then
# DECODE_STEPS tokens each, one per step.
PIECES = [(1, 65, 64), (3, 0, 0), (63, 64, 0), (64, 1, 0), (65, 66, 132), (200, 200, 200)]
DECODE_STEPS = 3


def _serve(x, pool, slots, prefill_step, decode_token):
    """A server's life for the sequences of x (B, N, ...): prefill steps, each a packed batch of every
    sequence's next piece from its state in the pool (gathered, then written back), then decode steps
    that advance the pool in place. Returns o (B, N, H, d_v) for every token, prompt and decoded."""
    B, N = x.q.shape[:2]
    o, done = np.zeros(x.v.shape), np.zeros(B, dtype=int)
    for step in PIECES:
        rows = [np.arange(done[b], done[b] + n) for b, n in enumerate(step)]
        cu_seqlens = np.concatenate([[0], np.cumsum(step)])
        packed = [np.concatenate([a[b, r] for b, r in enumerate(rows)])[None] for a in (x.q, x.k, x.v, x.g, x.beta)]
        o_step, pool[slots] = prefill_step(*packed, cu_seqlens, pool[slots])
        for b, r in enumerate(rows):
            o[b, r] = o_step[0, cu_seqlens[b]:cu_seqlens[b + 1]]
        done += step
    for t in range(done[0], N):
        assert np.all(done == t), "every sequence's prompt is prefilled before its decode steps"
        o[:, t] = decode_token(*(np.ascontiguousarray(a[:, t]) for a in (x.q, x.k, x.v, x.g, x.beta)), pool, slots)
        done += 1
    return o


def _served_inputs(seed, gate_range=(0.5, 1.0), H=H, d_k=D_K, d_v=D_V):
    prompts = np.sum(PIECES, axis=0)
    assert np.all(prompts == prompts[0]), "the schedule prefills equal prompts (the test then decodes in lockstep)"
    return make_sequences(len(prompts), int(prompts[0]) + DECODE_STEPS, H, d_k, d_v, seed=seed, gate_range=gate_range)


@pytest.mark.parametrize("dtype, tolerance", [("float64", 1e-12), ("bfloat16", 4 * UNIT_ROUNDOFF["bfloat16"])])
def test_prefill_in_pieces_then_decode_equals_one_pass(dtype, tolerance):
    """Prefill through reference C (the varlen kernels' design) in pieces of any sizes, each sequence's
    state carried in the pool between steps, then decode steps through the decode kernel (tile
    interpreter; float64, or bf16 q, k, v, o with the fp32 state): the outputs of every token and
    the final states equal one pass of stage 4's reference A over each whole sequence."""
    from stages.common.interpreter import interpret
    from stages.s07_serving.kernel import build_decode_program
    from stages.s07_serving.reference import kernel_mirror

    x = _served_inputs(seed=41)
    pool = np.random.default_rng(42).standard_normal((P, H, D_K, D_V)).astype(np.float32).astype(np.float64)
    others = np.setdiff1d(np.arange(P), SLOTS)
    kept = pool[others].copy()
    pool[SLOTS] = 0.0  # new sequences start from a zero state
    program = build_decode_program(B, P, H, D_K, D_V, BLOCK_DV, dtype=dtype,
                                   state_dtype="float64" if dtype == "float64" else "float32")
    kernel = interpret(program)

    def prefill_step(q, k, v, g, beta, cu_seqlens, states):
        return kernel_mirror(q, k, v, g, beta, 64, BLOCK_DV, cu_seqlens, states, output_final_state=True)

    def decode_token(q, k, v, g, beta, pool, slots):
        o = np.zeros((B, H, D_V))
        kernel(q, k, v, g, beta, slots.astype(np.int32), pool, np.zeros(FLAG_COUNT, dtype=np.int32), o)
        return o

    o = _serve(x, pool, SLOTS, prefill_step, decode_token)
    expected_o, expected_state = final_state_of_reference_a(x)
    assert_close(o, expected_o, rel_l2=tolerance)
    prompt = x.q.shape[1] - DECODE_STEPS
    assert_close(o[:, :prompt], expected_o[:, :prompt], rel_l2=1e-12, name="the prefilled tokens' output")
    assert_close(pool[SLOTS], expected_state, rel_l2=tolerance, name="the final states", axes=POOL_AXES)
    assert np.array_equal(pool[others], kept), "a slot of another sequence changed"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_prefill_in_pieces_then_decode_on_gpu(dtype_name):
    """The server's life of test_prefill_in_pieces_then_decode_equals_one_pass with the GPU kernels:
    prefill (cu_seqlens, states gathered from and written back to the pool) and decode, at H=4, d=128,
    against one float64 pass of stage 4's reference A: every token's output and the final states."""
    import torch

    from stages.kda.calls import decode, prefill

    dtype = getattr(torch, dtype_name)
    x = _served_inputs(seed=43, H=4, d_k=128, d_v=128)
    pool = torch.zeros((9, 4, 128, 128), dtype=torch.float32, device="cuda")
    slots = np.array([7, 2, 4])

    def cuda(*arrays, as_dtype):
        return [torch.tensor(a, dtype=as_dtype, device="cuda") for a in arrays]

    def prefill_step(q, k, v, g, beta, cu_seqlens, states):
        o, final_states = prefill(*cuda(q, k, v, as_dtype=dtype), *cuda(g, beta, as_dtype=torch.float32),
                                  cu_seqlens=torch.tensor(cu_seqlens, device="cuda"),
                                  initial_state=torch.tensor(states, dtype=torch.float32, device="cuda"),
                                  output_final_state=True)
        return o.double().cpu().numpy(), final_states.double().cpu().numpy()

    def decode_token(q, k, v, g, beta, host_pool, slots):
        pool[torch.tensor(slots)] = torch.tensor(host_pool[slots], dtype=torch.float32, device="cuda")
        o, _ = decode(*cuda(q, k, v, as_dtype=dtype), *cuda(g, beta, as_dtype=torch.float32), pool,
                      torch.tensor(slots, dtype=torch.int32, device="cuda"))
        host_pool[slots] = pool[torch.tensor(slots)].double().cpu().numpy()
        return o.double().cpu().numpy()

    host_pool = np.zeros((9, 4, 128, 128))
    o = _serve(x, host_pool, slots, prefill_step, decode_token)
    expected_o, expected_state = final_state_of_reference_a(x)
    u = UNIT_ROUNDOFF[dtype_name]
    print(f"{dtype_name} served: o {error_report(o, expected_o)}, states {error_report(host_pool[slots], expected_state)}")
    assert_close(o, expected_o, rel_l2=8 * u)
    assert_close(host_pool[slots], expected_state, rel_l2=8 * u, name="the final states", axes=POOL_AXES)


# ------------------------------------------------------------------------------------------ a layer served

LAYER_PIECES = [1, 3, 7, 13, 16, 1, 1, 1]  # prefill pieces around the chunk of 8, then three decode steps


class _ServedKernel:
    """chunk_kda's calling convention, as stage 6's KDALayer calls it, served as an engine serves the
    layer's B sequences: a call of one token each is a decode step over a state pool (the sequences'
    states at scattered slots of a larger pool, copied there from the cache), any longer call one
    packed prefill of the B sequences (cu_seqlens = 0, T, 2T, ...) from their states.

    prefill(q, k, v, g, beta, cu_seqlens, states) -> (o, final states) on the packed batch;
    decode(q, k, v, g, beta, pool, slots) -> o, advancing pool[slots] in place. `calls` records which
    path each call took.
    """

    def __init__(self, prefill, decode, pool, slots):
        self.prefill, self.decode, self.pool, self.slots, self.calls = prefill, decode, pool, slots, []

    def __call__(self, q, k, v, g, beta, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, scale=None):
        import torch

        from stages.kda.inputs import InputForm, activate

        B, T, H, d_k = q.shape
        form = InputForm(l2_normalize=use_qk_l2norm_in_kernel, scale=d_k**-0.5 if scale is None else scale)
        q, k, _, _ = activate(form, q, k, g, beta)  # q and k as the kernels take them, rounded once
        q, k = q.to(v.dtype), k.to(v.dtype)
        states = (torch.zeros(B, H, d_k, v.shape[3], dtype=self.pool.dtype, device=q.device) if initial_state is None
                  else initial_state.to(self.pool.dtype))
        if T == 1:
            self.calls.append("decode")
            self.pool[self.slots] = states
            o = self.decode(*(x[:, 0].contiguous() for x in (q, k, v, g, beta)), self.pool, self.slots)
            return o[:, None], self.pool[self.slots].clone()
        self.calls.append("prefill")
        cu_seqlens = np.arange(B + 1) * T
        o, final_states = self.prefill(*(x.reshape(1, B * T, *x.shape[2:]).contiguous() for x in (q, k, v, g, beta)),
                                       cu_seqlens, states.contiguous())
        return o.reshape(B, T, *o.shape[2:]), final_states


def _serve_layer(layer, x, pieces):
    """y of x (B, T, d_model) through `layer`, prefilled and decoded piece by piece with the cache
    carried between calls; and the last cache."""
    import torch

    cache, ys, start = None, [], 0
    for length in pieces:
        y, cache = layer(x[:, start:start + length], cache, use_cache=True)
        ys.append(y)
        start += length
    return torch.cat(ys, dim=1), cache


def test_a_layer_served_in_pieces_and_decode_steps_equals_one_forward():
    """Stage 6's KDALayer (float64, CPU) with its kernel served by stage 7: packed prefill through
    reference C in pieces of 1, 3, C - 1, C + 5 and 2C tokens, then decode steps through the decode
    reference over a pool, the cache carried: y and the final cache equal one forward of the layer on
    its own kernel (rel L2 <= 1e-12); the pool's other slots untouched."""
    import torch

    from stages.kda.layer import KDALayer
    from stages.s07_serving.reference import kernel_mirror

    def prefill(q, k, v, g, beta, cu_seqlens, states):
        o, final_states = kernel_mirror(*(a.numpy() for a in (q, k, v, g, beta)), 8, 4, cu_seqlens, states.numpy(),
                                        output_final_state=True, sub_block=4)
        return torch.from_numpy(o), torch.from_numpy(final_states)

    def decode(q, k, v, g, beta, pool, slots):
        return torch.from_numpy(decode_step(*(a.numpy() for a in (q, k, v, g, beta)), pool.numpy(), slots))

    torch.manual_seed(0)
    layer = KDALayer(d_model=24, n_heads=2, head_dim=8).double()
    x = torch.randn(3, sum(LAYER_PIECES), 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pool = torch.randn(7, 2, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    others, slots = pool[[0, 1, 3, 6]].clone(), np.array([5, 2, 4])
    with torch.no_grad():
        whole, whole_cache = layer(x, use_cache=True)
        layer.kernel = served = _ServedKernel(prefill, decode, pool, slots)
        y, cache = _serve_layer(layer, x, LAYER_PIECES)
    assert served.calls == ["decode", "prefill", "prefill", "prefill", "prefill", "decode", "decode", "decode"]
    assert error_report(y, whole).rel_l2 <= 1e-12
    for name, expected, actual in zip(whole_cache._fields, whole_cache, cache):
        assert error_report(actual, expected).rel_l2 <= 1e-12, name
    assert torch.equal(pool[[0, 1, 3, 6]], others), "a slot of another sequence changed"


@pytest.mark.gpu
def test_a_layer_served_by_prefill_and_decode_on_gpu():
    """The same on CUDA under bf16 autocast (H=4, d=128): stage 7's prefill (cu_seqlens, the varlen
    kernels) in pieces of 1, 3, 63, 69 and 128 tokens, then three steps of the decode kernel over a
    pool: y within twice the error of one prefill call on the whole, both against the float64 layer
    on the CPU."""
    import torch

    from stages.kda.calls import decode, prefill
    from stages.kda.layer import KDALayer

    def prefill_on_gpu(q, k, v, g, beta, cu_seqlens, states):
        return prefill(*(a.to(torch.bfloat16) for a in (q, k, v)), g.float(), beta.float(),
                       cu_seqlens=torch.tensor(cu_seqlens, device="cuda"), initial_state=states,
                       output_final_state=True)

    def decode_on_gpu(q, k, v, g, beta, pool, slots):
        return decode(*(a.to(torch.bfloat16) for a in (q, k, v)), g.float(), beta.float(), pool, slots)[0]

    torch.manual_seed(11)
    layer = KDALayer(d_model=256, n_heads=4, head_dim=128)
    pieces = [1, 3, 63, 69, 128, 1, 1, 1]
    x = torch.randn(3, sum(pieces), 256, generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        truth = layer.double()(x.double())[0]
    layer, x = layer.float().cuda(), x.cuda()
    pool = torch.zeros(9, 4, 128, 128, device="cuda")
    layer.kernel = served = _ServedKernel(prefill_on_gpu, decode_on_gpu, pool,
                                          torch.tensor([7, 2, 4], dtype=torch.int32, device="cuda"))
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        whole = layer(x)[0]
        y, cache = _serve_layer(layer, x, pieces)
    assert served.calls == ["prefill", "decode", "prefill", "prefill", "prefill", "prefill", "decode", "decode",
                            "decode"]
    whole_error, pieces_error = error_report(whole, truth), error_report(y, truth)
    print(f"served layer vs float64: one prefill {whole_error}, in pieces and decode steps {pieces_error}")
    # bf16 projections and kernels: a few 1e-3 expected; a lost state or a misplaced row is O(1)
    assert whole_error.rel_l2 <= 5e-2
    assert pieces_error.rel_l2 <= max(2 * whole_error.rel_l2, 1e-2)
