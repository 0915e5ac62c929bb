"""Stage 7's generated files: the error table of the varlen references against each sequence run
alone, the KDA cache's memory per sequence (state and convolution inputs) and the batch it allows, the chunk table of an example batch,
the padding of prefill's chunk-aligned layout, and the parts of prefill's call in the committed
varlen run."""

import numpy as np

from kdacourse.pages.tables import ROUNDING_NOTE, banner, markdown_table, rounding_level
from stages.common.errors import error_report
from stages.common.inputs import make_inputs
from stages.s07_serving.kernel import DEFAULT_CHUNK_SIZE
from stages.s07_serving.reference import chunk_aligned_rows, chunk_table, chunkwise, kernel_mirror, recurrent

SOURCE = "kdacourse/pages/s07_serving.py"
GIB = 2**30

# lengths of one packed batch, chunk_size, block_dv, sub_block
ERROR_TABLE_MIXES = [((5, 0, 17, 16, 1, 33), 8, 4, 4), ((100, 64, 1, 200), 64, 16, 16)]


def _each_sequence_alone(x, cu_seqlens, initial_state):
    """o and final states with each sequence run alone through stage 6's reference A (its own
    initial-state code, paper layout): an answer that shares no code with stage 7's references."""
    from stages.s06_backward.reference import recurrent_backward

    o, states = np.zeros(x.v.shape), initial_state.copy()
    for i, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
        if end > start:
            rows = slice(start, end)
            alone = recurrent_backward(*(a[:, rows] for a in (x.q, x.k, x.v, x.g, x.beta)), np.zeros(x.v[:, rows].shape),
                                       initial_state[i:i + 1])
            o[:, rows], states[i] = alone.o, alone.final_state[0]
    return o, states


def write_error_table(path):
    rows = []
    for lengths, C, block_dv, sub in ERROR_TABLE_MIXES:
        H, d_k, d_v = 2, 16, 16
        x = make_inputs(1, sum(lengths), H, d_k, d_v, gate="channel", gate_range=(0.5, 1.0), beta_range=(0.0, 1.0),
                        seed=0)
        cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
        S0 = np.random.default_rng(1).standard_normal((len(lengths), H, d_k, d_v))
        expected_o, expected_states = _each_sequence_alone(x, cu_seqlens, S0)
        args = (x.q, x.k, x.v, x.g, x.beta)
        for name, (o, states) in (
                ("A, one packed call", recurrent(*args, cu_seqlens, S0, output_final_state=True)),
                ("B, one packed call", chunkwise(*args, C, cu_seqlens, S0, output_final_state=True)),
                ("C, one packed call", kernel_mirror(*args, C, block_dv, cu_seqlens, S0, output_final_state=True,
                                                     sub_block=sub))):
            o_error, state_error = error_report(o, expected_o), error_report(states, expected_states)
            rows.append((", ".join(map(str, lengths)), f"C={C}", name, rounding_level(o_error.rel_l2),
                         rounding_level(state_error.rel_l2)))
    path.write_text(
        banner(SOURCE) + "H = 2, d_k = d_v = 16, a in [0.5, 1], beta in [0, 1], a random initial state per sequence. "
        "Each reference runs the packed batch once (cu_seqlens); the answer it is compared with runs each sequence "
        "alone through stage 6's reference A. Relative L2 errors.\n\n"
        + markdown_table(["lengths", "chunk", "reference", "o", "final states"], rows) + "\n" + ROUNDING_NOTE)


# the serving shape: Kimi Linear's KDA heads (H = 32, d_k = d_v = 128), fp32 states
SERVING_H, SERVING_D = 32, 128
KDA_LAYERS = (1, 24)  # one layer; a model of 24 KDA layers (3 of every 4 layers of a 32-layer model)
ATTENTION_LAYERS = 8  # the other layer in every 4 of that model: full attention, with a KV cache
CONV_SIZE = 4  # the short convolutions' width: KDALayer's default, and FLA's
STATE_BUDGETS_GIB = (8, 40)
LONG_CONTEXT = 2**20  # about a million tokens


# --8<-- [start:state_bytes]
def state_bytes(H: int, d_k: int, d_v: int, layers: int, bytes_per_entry: int = 4) -> int:
    """The state of one sequence: H heads of a d_k x d_v matrix per KDA layer, whatever its length."""
    return layers * H * d_k * d_v * bytes_per_entry


def conv_cache_bytes(H: int, d_k: int, d_v: int, layers: int, conv_size: int = CONV_SIZE,
                     bytes_per_entry: int = 2) -> int:
    """The rest of a sequence's KDA cache: each short convolution's last conv_size - 1 inputs, of q and
    k (H d_k channels each) and v (H d_v), per KDA layer (bf16), whatever its length."""
    return layers * (conv_size - 1) * H * (2 * d_k + d_v) * bytes_per_entry


def kv_cache_bytes(tokens: int, H: int, d: int, layers: int, bytes_per_entry: int = 2) -> int:
    """What full attention keeps instead: a key and a value per token, head and layer (bf16)."""
    return layers * tokens * 2 * H * d * bytes_per_entry
# --8<-- [end:state_bytes]


def write_state_memory_table(path):
    rows = []
    for layers in KDA_LAYERS:
        state = state_bytes(SERVING_H, SERVING_D, SERVING_D, layers)
        conv = conv_cache_bytes(SERVING_H, SERVING_D, SERVING_D, layers)
        tokens_equal = state // kv_cache_bytes(1, SERVING_H, SERVING_D, layers)
        cells = [str(layers), f"{state / 2**20:.0f} MiB", f"{conv / 2**10:.0f} KiB", f"{tokens_equal}"]
        cells += [f"{budget * GIB // (state + conv)}" for budget in STATE_BUDGETS_GIB]
        rows.append(cells)
    kda_cache = (state_bytes(SERVING_H, SERVING_D, SERVING_D, KDA_LAYERS[-1])
                 + conv_cache_bytes(SERVING_H, SERVING_D, SERVING_D, KDA_LAYERS[-1]))
    attention = kv_cache_bytes(LONG_CONTEXT, SERVING_H, SERVING_D, ATTENTION_LAYERS)
    crossing = kda_cache / (ATTENTION_LAYERS * LONG_CONTEXT)
    path.write_text(
        banner(SOURCE) + f"H = {SERVING_H} heads of d_k = d_v = {SERVING_D}, fp32 states, a convolution cache of "
        f"conv_size - 1 = {CONV_SIZE - 1} bf16 inputs of q, k and v. The KV cache of full attention with the same "
        "heads, bf16 keys and values, reaches the state's bytes after the number of tokens in the fourth column; "
        "the last columns are the sequences whose states and convolution caches fit in a pool of that size.\n\n"
        + markdown_table(["KDA layers", "state per sequence", "convolution cache per sequence",
                          "KV-cache tokens of the state's size"]
                         + [f"sequences in {budget} GiB" for budget in STATE_BUDGETS_GIB], rows)
        + f"\nIn the 3:1 mix of a 32-layer model ({KDA_LAYERS[-1]} KDA layers, {ATTENTION_LAYERS} full-attention "
        f"layers), at {LONG_CONTEXT} tokens: the {KDA_LAYERS[-1]} KDA layers keep {kda_cache / 2**20:.1f} MiB per "
        f"sequence, states and convolution caches; the {ATTENTION_LAYERS} full-attention layers with these heads "
        f"keep {attention / GIB:.0f} GiB, and any cache of more than {crossing:.1f} bytes per token and layer in "
        "them outweighs the KDA layers' whole cache.\n")


CHUNK_TABLE_LENGTHS, CHUNK_TABLE_C = (100, 0, 64, 1, 200), 64


def write_chunk_table(path):
    cu_seqlens = np.concatenate([[0], np.cumsum(CHUNK_TABLE_LENGTHS)])
    chunks, chunk_offsets = chunk_table(cu_seqlens, CHUNK_TABLE_C)
    rows = []
    for p, (sequence, chunk) in enumerate(chunks):
        start = cu_seqlens[sequence] + chunk * CHUNK_TABLE_C
        end = min(start + CHUNK_TABLE_C, cu_seqlens[sequence + 1])
        rows.append((str(p), str(sequence), str(chunk), f"{start} to {end - 1}", str(end - start)))
    path.write_text(
        banner(SOURCE) + f"Lengths {', '.join(map(str, CHUNK_TABLE_LENGTHS))} (cu_seqlens = "
        f"{', '.join(map(str, cu_seqlens))}), C = {CHUNK_TABLE_C}; chunk_offsets = "
        f"{', '.join(map(str, chunk_offsets))}.\n\n"
        + markdown_table(["program", "sequence", "chunk in sequence", "tokens", "rows loaded (the rest zeros)"], rows))


def write_padding_table(path):
    """Per mix of the committed varlen run (its lengths, from varlen_meta.json): prefill's chunk-aligned
    rows, the prepare's grid, and one batch padded to the longest sequence."""
    from kdacourse import results
    from stages.s07_serving.kernel import most_chunks

    C = DEFAULT_CHUNK_SIZE
    _, meta = results.committed_run("varlen.csv", "varlen_meta.json")
    if meta is None:
        path.write_text(banner(SOURCE) + "No varlen run committed (`python -m benchmarks.varlen --out DIR`).\n")
        return
    rows = []
    for name, lengths in results.varlen_mix_lengths(meta).items():
        chunks = int(chunk_aligned_rows(np.concatenate([[0], np.cumsum(lengths)]), C)[1][-1])
        grid = most_chunks(sum(lengths), len(lengths), C)
        one_batch = len(lengths) * max(-(-n // C) * C for n in lengths)
        rows.append((name, str(len(lengths)), str(sum(lengths)), f"{C * chunks} ({C * chunks / sum(lengths):.3f}x)",
                     str(chunks), f"{grid} (+{grid - chunks}, {grid / chunks - 1:.1%})",
                     f"{one_batch} ({one_batch / sum(lengths):.2f}x)"))
    path.write_text(
        banner(SOURCE) + f"The mixes of the committed `python -m benchmarks.varlen` run (benchmarks/results/"
        f"varlen_meta.json: lengths log-uniform; C = {C}). prefill's chunk-aligned "
        "layout against one batch padded to the longest sequence; the prepare's grid, sized before the chunks are "
        "counted (most_chunks), against the chunks.\n\n"
        + markdown_table(["mix", "sequences", "tokens", "rows chunk-aligned", "chunks", "prepare programs per head "
                          "(most_chunks)", "tokens padded to the longest"], rows))


# the committed varlen run, (impl, what) -> its label in the parts' table
PREFILL_PARTS = [(("ours", "call"), "whole call"), (("ours", "call_unchecked"), "whole call, value checks off"),
                 (("ours", "kernels"), "the two kernels alone"), (("ours", "graph"), "whole call as a CUDA graph"),
                 (("fla", "call"), "FLA's chunk_kda call"),
                 (("fla", "call_new_cu_seqlens"), "FLA's call, a new cu_seqlens tensor")]


def write_prefill_parts(path):
    """The committed run's medians over rounds for prefill's parts, what lies around the kernels (the call
    with checks off minus the kernels), the value checks' cost and FLA's call over ours."""
    from kdacourse.results import Spread, committed_run, difference, paired, ratio, varlen_times

    rows, _ = committed_run("varlen.csv", "varlen_meta.json")
    if rows is None:
        path.write_text(banner(SOURCE) + "No varlen run committed (`python -m benchmarks.varlen --out DIR`).\n")
        return
    table = []
    for mix, measured in varlen_times(rows).items():
        around = paired(measured, ("ours", "call_unchecked"), ("ours", "kernels"), difference)
        checks = paired(measured, ("ours", "call"), ("ours", "call_unchecked"), difference)
        speed_up = paired(measured, ("fla", "call"), ("ours", "call"), ratio)
        table += [(mix, label, Spread.of(measured[key].values()).text()) for key, label in PREFILL_PARTS
                  if key in measured]
        table += [(mix, "around the kernels (checks off minus kernels)", around.text()),
                  (mix, "the value checks (call minus checks off)", checks.text()),
                  (mix, "FLA's call / ours (ratio, not ms)", speed_up.text("{:.2f}"))]
    path.write_text(banner(SOURCE) + "The committed run of `python -m benchmarks.varlen` (benchmarks/results/varlen.csv), "
                    "medians over its rounds (min to max), ms.\n\n" + markdown_table(["mix", "part", "ms"], table))


def generated_files():
    return {
        "docs/generated/s07_errors.md": write_error_table,
        "docs/generated/s07_state_memory.md": write_state_memory_table,
        "docs/generated/s07_chunk_table.md": write_chunk_table,
        "docs/generated/s07_padding.md": write_padding_table,
        "docs/generated/s07_prefill_parts.md": write_prefill_parts,
    }
