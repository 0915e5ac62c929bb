"""Where the forward's time goes at Kimi Linear's shapes (issue 40), kernel by kernel: FlashKDA's two
kernels (torch's profiler), the course's prepare and recurrence at chunks 64, 32 and 16 with 32 or 64
value columns (and one or two pipeline stages at 64), the fused call (the gate, norms and sigmoid in
the prepare) against FlashKDA and against the course on the same tensors activated in torch. Ran once
on an H100 (the H200 was not lent that hour); its packed cases stopped at chunk 16, which the calls'
checks refuse. Results: benchmarks/results/kda_chunk_sizes_h100/."""
import os, sys, time, math, json
import torch
from triton.testing import do_bench

torch.manual_seed(0)
dev = "cuda"
OUT = os.environ.get("OUT", "/tmp")
LB = -5.0

def kimi_inputs(T, H, D=128, B=1):
    q = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
    x = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16)
    b = torch.randn(B, T, H, device=dev, dtype=torch.bfloat16)
    A_log = torch.rand(H, device=dev)
    dt_bias = torch.rand(H, D, device=dev)
    return q, k, v, x, b, A_log, dt_bias

def activated(q, k, x, b, A_log, dt_bias, scale):
    qf = torch.nn.functional.normalize(q.float(), dim=-1) * scale
    kf = torch.nn.functional.normalize(k.float(), dim=-1)
    H = q.shape[2]
    g = LB * torch.sigmoid(torch.exp(A_log).view(H, 1) * (x.float() + dt_bias))
    return qf.to(q.dtype), kf.to(k.dtype), g.contiguous(), torch.sigmoid(b.float()).contiguous()

def kernel_times(fn, iters=10):
    from torch.profiler import profile, ProfilerActivity
    fn(); torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" or getattr(e, "self_device_time_total", 0) > 0:
            t = getattr(e, "self_device_time_total", 0) / iters / 1000
            if t > 0.001:
                out[e.key[:60]] = round(t, 4)
    return out

def bench(fn):
    return round(do_bench(fn, warmup=10, rep=60, return_mode="median"), 4)

def main():
    t_start = time.time()
    import flash_kda
    from stages.kda.compiled import compiled_prepare, compiled_recurrence, compiled_prefill_kernels
    from stages.kda.config import default_prepare_threads
    from stages.kda.calls import prefill
    cases = [("8192x64", [8192], 64), ("8192x96", [8192], 96), ("packed6x96", [1300, 547, 2048, 963, 271, 3063], 96),
             ("8x1024x96", [1024] * 8, 96), ("16384x32", [16384], 32), ("65536x32", [65536], 32),
             ("b8_4096x16", [4096] * 8, 16)]
    results = {}
    for name, lens, H in cases:
        T = sum(lens)
        q, k, v, x, b, A_log, dt_bias = kimi_inputs(T, H)
        scale = 128 ** -0.5
        N = len(lens)
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), device=dev, dtype=torch.long)
        h0 = torch.zeros(N, H, 128, 128, device=dev)
        hT = torch.zeros_like(h0)
        out = torch.empty_like(v)
        fk = lambda: flash_kda.fwd(q, k, v, x, b, scale, out, A_log=A_log, dt_bias=dt_bias, lower_bound=LB,
                                   initial_state=h0, final_state=hT, cu_seqlens=cu if N > 1 else None)
        r = {"flashkda_ms": bench(fk), "flashkda_kernels": kernel_times(fk)}
        qa, ka, g, beta = activated(q, k, x, b, A_log, dt_bias, scale)
        r["activate_torch_ms"] = bench(lambda: activated(q, k, x, b, A_log, dt_bias, scale))
        for C in ((64, 16) if name in ("65536x32", "b8_4096x16") else (64, 32, 16)):
            if N == 1 or (name == "b8_4096x16"):
                Bd = N
                qd, kd, vd, gd, bd = (t.view(Bd, T // Bd, *t.shape[2:]) for t in (qa, ka, v, g, beta))
                Nt = T // Bd
                prep = compiled_prepare(Bd, Nt, H, 128, 128, C, "bfloat16", default_prepare_threads(C))
                for bdv in (32, 64):
                    for stages in ((2, 1) if C == 64 else (2,)):
                        rec = compiled_recurrence(Bd, Nt, H, 128, 128, C, bdv, "bfloat16", stages, 128)
                        prepared = prep(qd, kd, vd, gd, bd)
                        s0 = torch.zeros(Bd, H, 128, 128, device=dev)
                        r[f"C{C}_bdv{bdv}_stages{stages}_recurrence_ms"] = bench(lambda: rec(*prepared, s0))
                r[f"C{C}_prepare_ms"] = bench(lambda: prep(qd, kd, vd, gd, bd))
            else:
                cu32 = cu.to(torch.int32)
                s0 = torch.zeros(N, H, 128, 128, device=dev)
                from stages.kda.config import KernelConfig
                for bdv in (32, 64):
                    cfg = KernelConfig(chunk_size=C, block_dv=bdv, prepare_threads=default_prepare_threads(C))
                    fn = lambda: prefill(qa, ka, v, g, beta, cu32, s0, True, "off", cfg)
                    r[f"C{C}_bdv{bdv}_prefill_ms"] = bench(fn)
                    r[f"C{C}_bdv{bdv}_prefill_kernels"] = kernel_times(fn)
            print(name, C, "done", round(time.time() - t_start), flush=True)
        from stages.kda.calls import forward
        from stages.kda.inputs import InputForm
        KIMI = InputForm(gate="sigmoid", lower_bound=LB, l2_normalize=True, beta="sigmoid", scale=scale)
        dA, ddt = A_log, dt_bias.reshape(-1)
        for checks in ("off", "device"):
            if N == 1 or name == "b8_4096x16":
                Bd = N
                qd, kd, vd, xd, bd = (t.view(Bd, T // Bd, *t.shape[2:]) for t in (q, k, v, x, b))
                s0 = torch.zeros(Bd, H, 128, 128, device=dev)
                fn = lambda: forward(qd, kd, vd, xd, bd, s0, True, checks, None, KIMI, dA, ddt)
            else:
                s0 = torch.zeros(N, H, 128, 128, device=dev)
                fn = lambda: prefill(q, k, v, x, b, cu.to(torch.int32), s0, True, checks, None, KIMI, dA, ddt)
            o_f, S_f = fn()
            r[f"fused_{checks}_ms"] = bench(fn)
            r[f"fused_{checks}_kernels"] = kernel_times(fn)
        o_fk = out.clone(); S_fk = hT.clone()
        fk()
        rel = lambda a, b_: ((a.float() - b_.float()).norm() / b_.float().norm()).item()
        r["fused_vs_flashkda_o"] = rel(o_f.reshape(o_fk.shape), out)
        r["fused_vs_flashkda_state"] = rel(S_f.transpose(-1, -2), hT)
        if N == 1:
            s0 = torch.zeros(1, H, 128, 128, device=dev)
            o_p, S_p = forward(qa, ka, v, g, beta, s0, True, "off")
            r["fused_vs_plain_o"] = rel(o_f, o_p)
            r["fused_vs_plain_state"] = rel(S_f, S_p)
        results[name] = r
        print(name, json.dumps(r), flush=True)
        json.dump(results, open(f"{OUT}/probe1.json", "w"), indent=1)

main()
