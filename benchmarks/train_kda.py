"""Train a tiny model of KDA layers on associative recall, on the CPU (the references) or on CUDA (the kernels).

    python -m benchmarks.train_kda --out DIR [--device cpu|cuda] [--steps 300] [--compare-fla]

The task (multi-query associative recall): each sequence lists `pairs` key-value pairs with distinct
keys, then `queries` keys drawn from them; at each query the model must name that key's value,
which it can only have read earlier in the sequence:

    k_1 v_1 k_2 v_2 ... k_n v_n | q_1 q_2 ... q_m        targets: value(q_j) at q_j's position

Keys and values come from separate vocabularies of `vocab` tokens each, so guessing scores a loss of
log(vocab) (3.47 at 32). A recurrent state has to store the pairs to do better: the delta rule writes
each value under its key, and the short convolution lets the value's token see its key.

The model (`TinyKDAModel`): an embedding, `layers` blocks of x + KDALayer(RMSNorm(x)) and
x + MLP(RMSNorm(x)), a final RMSNorm and a linear head. AdamW, the loss on the query positions only.
The forget gate is bounded below by default (--lower-bound, FLA's safe gate at -5), as FLA's
tensor-core path asks: the kernels' diagonal blocks scale q and k by up to e^{-(8 consecutive log
gates)}, which fp32 holds only down to a sum of -88.7. With the unbounded gate, on the H200
(2026-12-01), our loss followed FLA's to the third decimal until the kernels' value check refused
the call at step 161; past the check (then --no-value-check, now --checks off) the output was NaN at step 165, where eight
gates of one sub-block summed to -93.5 (benchmarks/results/train_kda_cuda_unbounded). --nan-trap
saves the first failing or refused call for `python -m benchmarks.replay_call`.

Writes DIR/train_kda.csv (step, loss, query accuracy, and FLA's with --compare-fla) and
DIR/train_kda_loss.svg (the loss curves), and prints a summary. --replot draws the plot again from
the CSV (for a run on a machine without matplotlib).
"""

import argparse
import copy
import csv
import functools
import math
import sys
import time
from pathlib import Path

import torch
from torch import nn

from stages.common.device_checks import CHECKS, raise_if_flagged
from stages.kda.autograd import chunk_kda
from stages.kda.layer import KDALayer

IGNORED = -100  # cross_entropy's ignore_index: positions without a target
LOWER_BOUND = -5.0  # the forget gate's floor, log space: FLA's recommended safe-gate bound


# --8<-- [start:task]
def recall_batch(generator: torch.Generator, batch: int, pairs: int, queries: int,
                 vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens, targets: (batch, 2 * pairs + queries) int64. Keys are tokens [0, vocab), values
    [vocab, 2 vocab); targets hold the queried key's value at each query and IGNORED elsewhere."""
    if pairs > vocab:
        raise ValueError(f"pairs must be at most vocab = {vocab} (the keys of a sequence are distinct), got {pairs}")
    keys = torch.rand(batch, vocab, generator=generator).argsort(dim=1)[:, :pairs]  # distinct per sequence
    values = vocab + torch.randint(vocab, (batch, pairs), generator=generator)
    asked = torch.randint(pairs, (batch, queries), generator=generator)
    listing = torch.stack([keys, values], dim=2).flatten(1)  # k_1 v_1 k_2 v_2 ...
    tokens = torch.cat([listing, keys.gather(1, asked)], dim=1)
    targets = torch.full_like(tokens, IGNORED)
    targets[:, 2 * pairs:] = values.gather(1, asked)
    return tokens, targets
# --8<-- [end:task]


# --8<-- [start:model]
class Block(nn.Module):
    """x + KDALayer(RMSNorm(x)), then x + MLP(RMSNorm(x)): a pre-norm residual block."""

    def __init__(self, d_model: int, n_heads: int, head_dim: int, lower_bound: float | None):
        super().__init__()
        self.attention_norm = nn.RMSNorm(d_model)
        self.attention = KDALayer(d_model, n_heads, head_dim, lower_bound=lower_bound)
        self.mlp_norm = nn.RMSNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.SiLU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))[0]
        return x + self.mlp(self.mlp_norm(x))


class TinyKDAModel(nn.Module):
    """tokens (B, T) -> logits (B, T, vocab_size): embedding, KDA blocks, RMSNorm, linear head."""

    def __init__(self, vocab_size: int, d_model: int, layers: int, n_heads: int, head_dim: int,
                 lower_bound: float | None = LOWER_BOUND):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, head_dim, lower_bound) for _ in range(layers))
        self.norm = nn.RMSNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def use_kernel(self, kernel) -> None:
        """Every KDA layer calls `kernel` (chunk_kda's convention): FLA's, to compare."""
        for block in self.blocks:
            block.attention.kernel = kernel
# --8<-- [end:model]


# --8<-- [start:step]
def train_step(model: TinyKDAModel, optimizer: torch.optim.Optimizer, tokens: torch.Tensor,
               targets: torch.Tensor) -> tuple[float, float]:
    """One AdamW step on one batch; returns (loss, accuracy over the queries) before the step."""
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=tokens.is_cuda):
        logits = model(tokens)
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORED)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    asked = targets != IGNORED
    accuracy = (logits.argmax(-1)[asked] == targets[asked]).float().mean()
    return loss.item(), accuracy.item()
# --8<-- [end:step]


def train(args) -> list[dict]:
    """Train (and with --compare-fla, train FLA's copy beside it); one row per step."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = TinyKDAModel(2 * args.vocab, args.d_model, args.layers, args.heads, args.head_dim,
                         args.lower_bound).to(device)
    models = {"ours": model}
    kernel = functools.partial(chunk_kda, checks=args.checks)
    if args.nan_trap:
        kernel = NanTrap(args.out / "nan_trap.pt", kernel)
    model.use_kernel(kernel)
    if args.compare_fla:
        from fla.ops import chunk_kda as fla_chunk_kda

        models["fla"] = copy.deepcopy(model)  # the same initial weights
        models["fla"].use_kernel(fla_chunk_kda)
    optimizers = {name: torch.optim.AdamW(m.parameters(), lr=args.lr, weight_decay=0.01) for name, m in models.items()}
    generator = torch.Generator().manual_seed(args.seed + 1)
    rows, started = [], time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens, targets = (t.to(device) for t in recall_batch(generator, args.batch, args.pairs, args.queries,
                                                              args.vocab))
        row = {"step": step}
        for name, m in models.items():  # the same batch for every copy
            row[f"loss_{name}"], row[f"accuracy_{name}"] = train_step(m, optimizers[name], tokens, targets)
        raise_if_flagged(device)  # a bad g or beta our kernels flagged (checks="device"): read where the loss is
        if not all(math.isfinite(row[f"loss_{name}"]) for name in models):
            raise FloatingPointError(f"the loss is not finite at step {step}: {row}")
        rows.append(row)
        _progress(step, args.steps, row, time.perf_counter() - started)
    print(file=sys.stderr)
    return rows


class NanTrap:
    """`kernel` (our chunk_kda, by default) that stops at its first non-finite output or gradient,
    or at a call its value check refuses, and saves what it was called with to `path` (torch.save:
    q, k, v, g, beta, the keyword arguments, do = dLoss/do once the backward has it, and the
    refusal's message), so that the failing call can be run again kernel by kernel. One device sync
    per check: for finding a fault, not for timing."""

    def __init__(self, path: Path, kernel=chunk_kda):
        self.path, self.kernel = path, kernel

    def __call__(self, q, k, v, g, beta, **options):
        saved = {"inputs": [x.detach().clone() for x in (q, k, v, g, beta)], "options": options}
        try:
            o, final_state = self.kernel(q, k, v, g, beta, **options)
        except ValueError as error:  # the kernels' value check refused the call: keep it, to replay past the check
            saved["refused"] = str(error)
            torch.save(saved, self.path)
            raise FloatingPointError(f"our chunk_kda refused the call ({error}); its inputs are saved in "
                                     f"{self.path}") from error
        self._check(saved, "the forward's output", o, final_state)
        if o.requires_grad:
            o.register_hook(lambda do: saved.__setitem__("do", do.detach().clone()))
            for name, x in zip(("q", "k", "v", "g", "beta"), (q, k, v, g, beta)):
                if x.requires_grad:
                    x.register_hook(lambda grad, name=name: self._check(saved, f"the gradient of {name}", grad))
        return o, final_state

    def _check(self, saved, what, *tensors):
        if all(t is None or bool(torch.isfinite(t).all()) for t in tensors):
            return
        torch.save(saved, self.path)
        raise FloatingPointError(f"{what} is not finite; the call's inputs are saved in {self.path}")


def _progress(step, steps, row, elapsed, width=30):
    """One line, rewritten in place: a bar, the step, the losses, the time left."""
    filled = width * step // steps
    losses = "  ".join(f"{key.removeprefix('loss_')} {value:.3f}" for key, value in row.items() if key.startswith("loss_"))
    left = elapsed / step * (steps - step)
    print(f"\r[{'#' * filled}{'.' * (width - filled)}] {step}/{steps}  loss {losses}  {left:.0f} s left",
          end="", file=sys.stderr, flush=True)


def summary(rows: list[dict], window: int = 10) -> dict:
    """Mean loss and accuracy over the first and last `window` steps; with FLA's curve, how far apart."""
    window = min(window, len(rows))
    first, last = rows[:window], rows[-window:]
    names = [key.removeprefix("loss_") for key in rows[0] if key.startswith("loss_")]
    result = {}
    for name in names:
        result[f"first_loss_{name}"] = sum(r[f"loss_{name}"] for r in first) / window
        result[f"last_loss_{name}"] = sum(r[f"loss_{name}"] for r in last) / window
        result[f"last_accuracy_{name}"] = sum(r[f"accuracy_{name}"] for r in last) / window
    if "fla" in names:
        gaps = [abs(r["loss_ours"] - r["loss_fla"]) for r in rows]
        result["max_loss_gap"], result["mean_loss_gap"] = max(gaps), sum(gaps) / len(gaps)
        result["last_loss_gap"] = result["last_loss_ours"] - result["last_loss_fla"]
    return result


def read_csv(path: Path) -> list[dict]:
    """The rows write_csv wrote: the step an int, the rest floats."""
    with path.open(newline="") as file:
        return [{key: int(value) if key == "step" else float(value) for key, value in row.items()}
                for row in csv.DictReader(file)]


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], path: Path, title: str, guess: float) -> None:
    """The loss curves against the step, with `guess` (log(vocab), the loss of a guess among the values)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    labels = {"ours": "stage 5 forward + stage 6 backward", "fla": "FLA chunk_kda"}
    for name, label in labels.items():
        if f"loss_{name}" in rows[0]:
            ax.plot(steps, [r[f"loss_{name}"] for r in rows], label=label, linewidth=1.2,
                    linestyle="-" if name == "ours" else "--")
    ax.axhline(guess, color="grey", linewidth=0.8, linestyle=":", label="a guess among the values")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy on the queries")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.train_kda", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for train_kda.csv and train_kda_loss.svg")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--steps", type=_positive, default=300)
    parser.add_argument("--batch", type=_positive, default=16, help="sequences per step (default 16)")
    parser.add_argument("--pairs", type=_positive, default=8, help="key-value pairs per sequence (default 8)")
    parser.add_argument("--queries", type=_positive, default=16, help="queries per sequence (default 16)")
    parser.add_argument("--vocab", type=_positive, default=32, help="keys, and values, in the vocabulary (default 32)")
    parser.add_argument("--d-model", type=_positive, default=64)
    parser.add_argument("--layers", type=_positive, default=2)
    parser.add_argument("--heads", type=_positive, default=2)
    parser.add_argument("--head-dim", type=_positive, default=32,
                        help="d_k = d_v per head (default 32; stage 5's kernels need a multiple of 32 on CUDA)")
    parser.add_argument("--lower-bound", type=_lower_bound, default=LOWER_BOUND,
                        help=f"the forget gate's floor in log space (default {LOWER_BOUND}, FLA's safe gate); "
                             "'none': the unbounded gate, which the kernels refuse once 8 gates sum below -88")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare-fla", action="store_true", help="also train the same model on FLA's chunk_kda (CUDA)")
    parser.add_argument("--nan-trap", action="store_true",
                        help="stop at our chunk_kda's first non-finite output or gradient, or at a call its value "
                             "check refuses, the call's inputs saved in DIR/nan_trap.pt")
    parser.add_argument("--checks", choices=CHECKS, default="device",
                        help="how our chunk_kda checks g's and beta's values: 'device' (flagged by the kernels, "
                             "raised after the step, where the loss is read), 'host' (refused at the call, a sync "
                             "per call: with --nan-trap, to save the refused call) or 'off'")
    parser.add_argument("--replot", action="store_true",
                        help="train nothing: draw DIR/train_kda_loss.svg from DIR/train_kda.csv (give the run's --vocab)")
    args = parser.parse_args(argv)
    if args.compare_fla and args.device != "cuda":
        parser.error("--compare-fla needs --device cuda (FLA's kernels are Triton kernels for a GPU)")
    if args.pairs > args.vocab:
        parser.error(f"--pairs must be at most --vocab = {args.vocab}: the keys of a sequence are distinct")
    return args


def _lower_bound(text):
    if text.lower() == "none":
        return None
    value = float(text)
    if not value < 0:
        raise argparse.ArgumentTypeError(f"must be a negative log gate or 'none', got {text}")
    return value


def _positive(text):
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def main(argv=None):
    args = parse_args(argv)
    csv_path, plot_path = args.out / "train_kda.csv", args.out / "train_kda_loss.svg"
    if args.replot:
        rows = read_csv(csv_path)
    else:
        args.out.mkdir(parents=True, exist_ok=True)
        threads = torch.get_num_threads()
        if args.device == "cpu":
            torch.set_num_threads(1)  # tensors of a few KiB: more threads only wait on each other (3x slower on 2 cores)
        try:
            rows = train(args)
        finally:
            torch.set_num_threads(threads)
        write_csv(rows, csv_path)
    result = summary(rows)
    for key, value in result.items():
        print(f"{key}: {value:.4f}")
    try:
        plot(rows, plot_path, f"associative recall, {args.pairs} pairs, {args.layers} KDA layers",
             guess=math.log(args.vocab))
    except ImportError as error:  # a GPU machine without matplotlib: the CSV is what matters
        print(f"no plot ({error}); draw it where matplotlib is: python -m benchmarks.train_kda --out DIR --replot")
        return result
    print(f"wrote {csv_path} and {plot_path}")
    return result


if __name__ == "__main__":
    main()
