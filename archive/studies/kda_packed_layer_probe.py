"""Why KimiDeltaAttention's packed batch fails through the course's backend on the GPU (issue 41): the
layer's test (tests/kernels/test_drop_in_gpu.py, `test_kimi_delta_attention_through_the_backend[True-*]`)
got NaN gradients (HV = 4) or a dA_log 3.1 (relative L2) from FLA's (HV = 8) on an H100, where the dense batch passes and
the tile interpreter runs the same calls clean. Found with `capture` and racecheck on `replay`: a barrier
TileLang left out of the prepare that trains a packed batch (stages/kda/tiles.py, "Barriers TileLang
leaves out"; tests/gpu_results/drop_in_h100/README.md).

    python -m archive.studies.kda_packed_layer_probe op       the op alone, FLA's and the course's
    python -m archive.studies.kda_packed_layer_probe layer    the layer, each order of the two paths
    python -m archive.studies.kda_packed_layer_probe repeat   the course's op again and again, the
                                                              caching allocator's free memory filled
                                                              with NaN, 0, 1e30 ... before each call
    python -m archive.studies.kda_packed_layer_probe capture DIR
                                              the layer's own call of chunk_kda (its inputs, A_log,
                                              dt_bias, cu_seqlens and the gradient of o) saved to
                                              DIR/layer_call.pt, then replayed on the op alone,
                                              the course's and FLA's
    compute-sanitizer --tool initcheck|memcheck|racecheck \\
        python -m archive.studies.kda_packed_layer_probe replay DIR
                                              the saved call once, the course's op only

The batch is the layer test's: sequences of 300, 47, 700 and 1 tokens, H = 4 q/k heads, d = 128, Kimi
Linear's flags (the bounded gate, the norms and beta's sigmoid in the kernel), A_log and dt_bias in bf16
as the layer's `.to(bf16)` leaves them (fp32 in `op`). `layer` needs flash-linear-attention's layers
(`source .gpu/fla_models.sh`).
"""

import os
import sys

import torch

LENGTHS, H, D = [300, 47, 700, 1], 4, 128


def offsets(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")


def not_finite(tensors):
    return [name for name, x in tensors.items() if x is not None and not torch.isfinite(x).all()]


def op_leaves(lengths, HV, parameter_dtype, seed=0):
    torch.manual_seed(seed)
    T = sum(lengths)

    def leaf(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda").to(dtype).requires_grad_()

    return dict(q=leaf(1, T, H, D), k=leaf(1, T, H, D), v=leaf(1, T, HV, D), g=leaf(1, T, HV, D),
                beta=leaf(1, T, HV), A_log=leaf(HV, dtype=parameter_dtype), dt_bias=leaf(HV * D, dtype=parameter_dtype))


def op_call(chunk_kda, leaves, lengths, do):
    """o and every leaf's gradient of one forward and backward of `chunk_kda` (FLA's signature)."""
    for x in leaves.values():
        x.grad = None
    x = leaves
    o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                     use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                     safe_gate=True, lower_bound=-5.0, state_v_first=True, cu_seqlens=offsets(lengths))
    (o.float() * do.float()).sum().backward()
    return {"o": o.detach().clone(), **{name: leaf.grad.clone() for name, leaf in leaves.items()}}


def op():
    from fla.ops.kda import chunk_kda as fla_chunk_kda

    from stages.kda.autograd import chunk_kda as course_chunk_kda

    for lengths in (LENGTHS, LENGTHS[:3], [1, 300]):
        leaves = op_leaves(lengths, H, torch.float32)
        do = torch.ones(1, sum(lengths), H, D, device="cuda")
        for name, chunk_kda in (("FLA", fla_chunk_kda), ("course", course_chunk_kda)):
            print(f"op {lengths} {name}: not finite {not_finite(op_call(chunk_kda, leaves, lengths, do))}", flush=True)


def layer():
    import fla.layers as layers

    import stages.kda.fla_backend  # noqa: F401  (registers the backend)

    cu_seqlens = offsets(LENGTHS)
    for order in (("1", "0"), ("0", "1"), ("1", "1")):
        torch.manual_seed(0)
        attention = layers.KimiDeltaAttention(hidden_size=512, head_dim=D, num_heads=H, num_v_heads=H, mode="chunk",
                                              safe_gate=True, lower_bound=-5.0).to("cuda", torch.bfloat16)
        x = torch.randn(1, sum(LENGTHS), 512, device="cuda", dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        for enabled in order:
            os.environ["FLA_KDACOURSE"] = enabled
            attention.zero_grad()
            y = attention(x, cu_seqlens=cu_seqlens)[0]
            (y.float() * dy.float()).sum().backward()
            grads = {name: p.grad for name, p in attention.named_parameters()}
            print(f"order {order}, this run {'course' if enabled == '1' else 'FLA'}: not finite "
                  f"{not_finite({'y': y, **grads})}, dA_log {attention.A_log.grad.tolist()}", flush=True)


def repeat(calls=6):
    from stages.kda.autograd import chunk_kda

    leaves = op_leaves(LENGTHS, H, torch.bfloat16)
    do = torch.randn(1, sum(LENGTHS), H, D, device="cuda").to(torch.bfloat16)
    first = op_call(chunk_kda, leaves, LENGTHS, do)
    print(f"first call: not finite {not_finite(first)}", flush=True)
    if calls == 1:
        return
    for fill in [float("nan"), 0.0, 1e30, float("nan"), -7.0][:calls - 1]:
        junk = torch.full((1 << 28,), fill, device="cuda")
        del junk  # freed to the caching allocator: the next call's buffers start as this
        again = op_call(chunk_kda, leaves, LENGTHS, do)
        differences = {name: (again[name].float() - first[name].float()).abs().nan_to_num(1e38).max().item()
                       for name in first}
        print(f"after memory filled with {fill}: largest differences from the first call "
              f"{ {name: f'{d:.2e}' for name, d in differences.items() if d > 0} or 'none'}", flush=True)


def nonfinite_rows(x):
    """The token positions (axis 1) where x holds a value that is not finite: first, last and count."""
    bad = (~torch.isfinite(x.float())).flatten(2).any(2).any(0).nonzero().flatten().tolist()
    return f"{len(bad)} rows" + (f" ({bad[0]}..{bad[-1]})" if bad else "")


def capture(directory):
    """The layer (HV = 4, packed) through the backend, its call of chunk_kda saved, then replayed."""
    import fla.layers as layers

    import stages.kda.fla_backend as backend

    saved = {}
    course_chunk_kda = backend.chunk_kda

    def recording_chunk_kda(*args, **kwargs):
        names = ("q", "k", "v", "g", "beta")  # positional in FLA's signature; the layer passes them by name
        tensors = dict(zip(names, args))
        tensors.update({name: kwargs[name] for name in (*names, "A_log", "dt_bias", "cu_seqlens")
                        if isinstance(kwargs.get(name), torch.Tensor)})
        saved.update({name: x.detach().clone() for name, x in tensors.items()})
        saved["strides"] = {name: tuple(x.stride()) for name, x in tensors.items()}
        saved["options"] = {name: value for name, value in kwargs.items() if not isinstance(value, torch.Tensor)}
        o, final_state = course_chunk_kda(*args, **kwargs)
        o.register_hook(lambda grad: saved.update(do=grad.detach().clone(), do_stride=tuple(grad.stride())))
        return o, final_state

    backend.chunk_kda = recording_chunk_kda
    os.environ["FLA_KDACOURSE"] = "1"
    torch.manual_seed(0)
    attention = layers.KimiDeltaAttention(hidden_size=512, head_dim=D, num_heads=H, num_v_heads=H, mode="chunk",
                                          safe_gate=True, lower_bound=-5.0).to("cuda", torch.bfloat16)
    x = torch.randn(1, sum(LENGTHS), 512, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    y = attention(x, cu_seqlens=offsets(LENGTHS))[0]
    (y.float() * dy.float()).sum().backward()
    backend.chunk_kda = course_chunk_kda
    grads = {name: p.grad for name, p in attention.named_parameters()}
    print(f"layer through the backend: not finite {not_finite({'y': y, **grads})}", flush=True)
    print(f"captured: {sorted(k for k in saved if isinstance(saved[k], torch.Tensor))}, strides {saved['strides']}, "
          f"do's {saved.get('do_stride')}, options {saved['options']}", flush=True)
    print("captured dtypes " + ", ".join(f"{k} {tuple(v.shape)} {v.dtype}" for k, v in saved.items()
                                        if isinstance(v, torch.Tensor)), flush=True)
    os.makedirs(directory, exist_ok=True)
    torch.save({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in saved.items()},
               os.path.join(directory, "layer_call.pt"))
    replay(directory, peers=True)


def replay(directory, peers=False):
    """The saved call on the course's op (and FLA's with peers): which gradients are not finite, where."""
    from stages.kda.autograd import chunk_kda as course_chunk_kda

    saved = torch.load(os.path.join(directory, "layer_call.pt"))
    sides = [("course", course_chunk_kda)]
    if peers:
        from fla.ops.kda import chunk_kda as fla_chunk_kda

        os.environ["FLA_KDACOURSE"] = "0"
        sides.append(("FLA", fla_chunk_kda))
    for name, chunk_kda in sides:
        for attempt in range(2 if peers else 1):
            leaves = {k: saved[k].cuda().requires_grad_() for k in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")}
            o, _ = chunk_kda(*(leaves[k] for k in ("q", "k", "v", "g", "beta")), A_log=leaves["A_log"],
                             dt_bias=leaves["dt_bias"], cu_seqlens=saved["cu_seqlens"].cuda(), **saved["options"])
            o.backward(saved["do"].cuda())
            report = {"o": nonfinite_rows(o), **{k: nonfinite_rows(x.grad if x.dim() > 1 else x.grad.view(1, 1, -1))
                                                 for k, x in leaves.items()}}
            print(f"replay {name} #{attempt}: not finite {report}", flush=True)


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "repeat"
    if mode in ("capture", "replay"):
        {"capture": capture, "replay": replay}[mode](sys.argv[2])
    else:
        {"op": op, "layer": layer, "repeat": repeat, "once": lambda: repeat(1)}[mode]()
