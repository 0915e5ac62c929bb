"""Compile on this machine, for the GPU, every program `python -m benchmarks.kimi_call` will build for
the course's calls (every case and the accuracy case; checks "device" and "off"; the prepare in two and
four channel passes), into TileLang's cache, so that the GPU machine finds them compiled
(CONTRIBUTING.md, "Sparing the GPU's time"):

    TILELANG_CACHE_DIR=.tlcache python scripts/precompile_kimi_call.py

The calls are made on zeros with CUDA faked and each program compiled and not run
(stages.kda.on_cpu.compiled_only), so they build exactly what they build on the GPU. About 10 s a
program not yet in the cache, on two cores.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kimi_call import ACCURACY_CASE, CASES, D, kimi_form  # noqa: E402
from stages.kda.calls import prefill  # noqa: E402
from stages.kda.config import resolve  # noqa: E402
from stages.kda.on_cpu import calls_on_cpu, compiled_only  # noqa: E402


def main():
    import torch

    with calls_on_cpu(compiled_only):
        for name, (lengths, H) in [*CASES.items(), ("accuracy", ACCURACY_CASE)]:
            T, N = sum(lengths), len(lengths)
            q, k, v, x = (torch.zeros(1, T, H, D, dtype=torch.bfloat16) for _ in range(4))
            beta = torch.zeros(1, T, H, dtype=torch.bfloat16)
            cu_seqlens = None if N == 1 else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()],
                                                          dtype=torch.int32)
            for checks, config in (("device", None), ("off", None),
                                   ("device", resolve(N, H, D, D, 132, channel_passes=4))):
                prefill(q, k, v, x, beta, cu_seqlens, torch.zeros(N, H, D, D), True, checks, config,
                        kimi_form(D ** -0.5), torch.zeros(H), torch.zeros(H * D))
            print(f"{name}: done", flush=True)


if __name__ == "__main__":
    main()
