"""A small KDA model from FLA (fla.models' KDAForCausalLM, Kimi Linear's layer) trained twice from the same
weights on the same batches: on FLA's own kernels, and through the course's FLA backend.

    source .gpu/env.sh && python -m benchmarks.fla_backend_train --out DIR [--steps 200]

The task is train_kda's associative recall (benchmarks.train_kda.recall_batch): keys and values from two
vocabularies, then queried keys, the loss on the query positions only (log(vocab) for a guess). The
model: `layers` KDA blocks (KimiDeltaAttention with the bounded gate at -5 and safe_gate, as Kimi Linear,
and a gated MLP), bf16 on CUDA, AdamW. The backend is switched per run by FLA's own variable
(FLA_KDACOURSE=1 or 0, read by FLA at every call), and FLA's log says which backend served the calls.

Writes DIR/fla_backend_train.csv (step, loss_fla, loss_course, accuracy_fla, accuracy_course) and
DIR/fla_backend_train_meta.json (the command, device, versions, the backends FLA logged per run). Needs
flash-linear-attention 0.6.0 with fla.models, which needs transformers (docs/fla_backend.md lists the
wheels for the GPU machine).
"""

import argparse
import csv
import json
import logging
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.train_kda import IGNORED, recall_batch


def build_model(args, device):
    from fla.models import KDAConfig, KDAForCausalLM

    config = KDAConfig(hidden_size=args.hidden, num_hidden_layers=args.layers, num_heads=args.heads,
                       num_v_heads=args.v_heads, head_dim=args.head_dim, vocab_size=2 * args.vocab,
                       safe_gate=True, lower_bound=-5.0, fuse_cross_entropy=False, use_cache=False)
    torch.manual_seed(args.seed)
    return KDAForCausalLM(config).to(device, torch.bfloat16)


def train(model, args, device, backend_enabled: str) -> list[dict]:
    """args.steps AdamW steps with FLA_KDACOURSE=backend_enabled; the batches from args.seed."""
    os.environ["FLA_KDACOURSE"] = backend_enabled
    generator = torch.Generator().manual_seed(args.seed + 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    started = time.time()
    rows = []
    for step in range(args.steps):
        tokens, targets = recall_batch(generator, args.batch, args.pairs, args.queries, args.vocab)
        tokens, targets = tokens.to(device), targets.to(device)
        logits = model(input_ids=tokens).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORED)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        asked = targets != IGNORED
        accuracy = (logits.argmax(-1)[asked] == targets[asked]).float().mean()
        rows.append({"step": step, "loss": loss.item(), "accuracy": accuracy.item()})
        if step % 20 == 0 or step == args.steps - 1:  # a cut run still shows how far it came
            backend = "course" if backend_enabled == "1" else "FLA"
            print(f"[{time.time() - started:6.1f} s] {backend} step {step}: loss {loss.item():.4f}, "
                  f"accuracy {accuracy.item():.3f}", flush=True)
    return rows


class BackendLog(logging.Handler):
    """FLA's backend log lines, kept: which backend served (or refused) each function."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--queries", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--v-heads", type=int, default=4, help="value heads: grouped (GVA) when above --heads")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fla_backend_train runs on CUDA: FLA's own kernels are its baseline")
    import fla

    import stages.kda.fla_backend as backend

    device = torch.device("cuda")
    log = BackendLog()
    logging.getLogger("fla.backends").addHandler(log)
    logging.getLogger("fla.backends").setLevel(logging.INFO)
    runs, served, seconds = {}, {}, {}
    for name, enabled in (("fla", "0"), ("course", "1")):
        model = build_model(args, device)  # the same weights for both: one seed
        log.lines.clear()
        for registry in _registries():
            registry._logged.clear()  # FLA logs a backend once a process: again for each run
        start = time.perf_counter()
        runs[name] = train(model, args, device, enabled)
        seconds[name] = time.perf_counter() - start
        served[name] = sorted(set(log.lines))
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "fla_backend_train.csv", "w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["step", "loss_fla", "loss_course", "accuracy_fla", "accuracy_course"])
        for fla_row, course_row in zip(runs["fla"], runs["course"]):
            writer.writerow([fla_row["step"], f"{fla_row['loss']:.6f}", f"{course_row['loss']:.6f}",
                             f"{fla_row['accuracy']:.4f}", f"{course_row['accuracy']:.4f}"])
    meta = {"command": "python -m benchmarks.fla_backend_train " + " ".join(sys.argv[1:] if argv is None else argv),
            "device": torch.cuda.get_device_name(), "torch": torch.__version__, "fla": fla.__version__,
            "backend_registered": backend.REGISTERED, "fla_log": served, "seconds": seconds, "args": vars(args)}
    (args.out / "fla_backend_train_meta.json").write_text(json.dumps(meta, indent=1, default=str))
    last = {name: sum(row["loss"] for row in rows[-10:]) / 10 for name, rows in runs.items()}
    print(f"last 10 steps' mean loss: FLA {last['fla']:.4f}, course {last['course']:.4f}; FLA's log: {served}")


def _registries():
    from inspect import unwrap

    from fla.backends import _function_registries, _get_operation_registry
    from fla.ops.kda.chunk import chunk_kda

    return _function_registries[unwrap(chunk_kda)], _get_operation_registry("kda")


if __name__ == "__main__":
    main()
