"""The studies of the fast path's Kimi call (issue 40): the course's call (prefill, checks="device") timed as a
CUDA graph and each kernel by the profiler, o and the final state saved under TAG, run once in a checkout
of main and once in a copy changed as a study changes it (kda_u_in_the_recurrence.diff; the block
inverse in registers, the recurrence at 32 value columns), on the same warm GPU; FlashKDA timed beside
main's (TAG main).

    python archive/studies/kda_kimi_call_graph.py TAG T8192_H96,8x4096_H16 SAVE_DIR
"""
import os
import sys
import statistics

sys.path.insert(0, os.getcwd())
os.environ.setdefault("FLA_FLASH_KDA", "0")
import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.kimi_call import CASES, make_inputs, peer_calls

tag, cases, save = sys.argv[1], sys.argv[2].split(","), sys.argv[3]


def graph_ms(f, reps=50, rounds=7):
    for _ in range(3):
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            f()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    times = []
    cache = torch.empty(64 << 20, dtype=torch.int8, device="cuda")
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        total = 0.0
        for _ in range(reps):
            cache.zero_()  # L2 flushed
            start.record()
            g.replay()
            end.record()
            torch.cuda.synchronize()
            total += start.elapsed_time(end)
        times.append(total / reps)
    return statistics.median(times)


for name in cases:
    lengths, H = CASES[name]
    calls, missing = peer_calls(make_inputs(lengths, H))
    o, final = calls["course"]()
    torch.save({"o": o.float().cpu(), "final": final.float().cpu()}, f"{save}/{tag}_{name}.pt")
    line = f"{tag} {name}: course graph {graph_ms(calls['course']):.4f} ms"
    if "flashkda" in calls and tag == "main":
        line += f"; flashkda graph {graph_ms(calls['flashkda']):.4f} ms"
    print(line, flush=True)
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(10):
            calls["course"]()
        torch.cuda.synchronize()
    for e in p.key_averages():
        if e.device_time_total > 0 and ("kda" in e.key or "kernel" in e.key):
            print(f"   {tag} {name} {e.key[:60]:60s} {e.device_time_total / e.count / 1000:.4f} ms x{e.count}", flush=True)
