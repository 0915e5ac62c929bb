"""benchmarks/replay_call.py on the CPU: a saved call run again kernel by kernel through the tile
interpreter names the first kernel whose output is not finite, and none for a sound call."""

import pytest
import torch

from benchmarks import replay_call


def _saved_call(path, strong_gate):
    """A bf16 call as the layer makes it (q, k unnormalized, fp32 gates), with one channel's gates at
    `strong_gate` on tokens 1 to 8: eight of them above the first sub-block's middle row."""
    generator = torch.Generator().manual_seed(0)
    B, N, H, d = 1, 20, 1, 32
    q, k, v, do = (torch.randn(B, N, H, d, generator=generator).bfloat16() for _ in range(4))
    g = -0.05 * torch.rand(B, N, H, d, generator=generator)
    g[0, 1:9, 0, 3] = strong_gate
    beta = torch.rand(B, N, H, generator=generator)
    torch.save({"inputs": [q, k, v, g, beta], "options": {"use_qk_l2norm_in_kernel": True}, "do": do}, path)
    return g


@pytest.mark.parametrize("strong_gate", [-11.0, -12.0, -1e4])
def test_replay_finds_every_kernel_finite_at_any_gate(tmp_path, capsys, strong_gate):
    """Eight gates of -11 sum to -88, inside fp32's range (e^88.7); eight of -12 (e^96) and of -1e4
    are past it, where stage 6's intra kernel overflowed until it took such sub-blocks by their
    definition, as stage 5's prepare kernel does: every kernel finite, forward and backward."""
    _saved_call(tmp_path / "call.pt", strong_gate)
    assert replay_call.main([str(tmp_path / "call.pt"), "--device", "cpu"]) is None
    printed = capsys.readouterr().out
    assert printed.count("outputs finite") == 7  # prepare and recurrence, then the backward's five
    assert "False" not in printed
    assert "first kernel with a non-finite output: none" in printed


def test_a_refused_call_is_replayed_past_the_check(tmp_path, capsys):
    """A call the value check refused (NanTrap saved its message) is run through every kernel, and
    the replay says so first."""
    _saved_call(tmp_path / "call.pt", -12.0)
    saved = torch.load(tmp_path / "call.pt")
    saved["refused"] = "g sums to -96 over 8 consecutive tokens"
    torch.save(saved, tmp_path / "call.pt")
    assert replay_call.main([str(tmp_path / "call.pt"), "--device", "cpu"]) is None
    printed = capsys.readouterr().out
    assert printed.startswith("the kernels' value check refused this call: g sums to -96 over 8 consecutive "
                              "tokens\nrun again past the check:\n")
    assert printed.count("outputs finite") == 7


def test_cuda_replay_needs_a_gpu(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    _saved_call(tmp_path / "call.pt", -1.0)
    with pytest.raises(SystemExit):
        replay_call.main([str(tmp_path / "call.pt")])
    assert "--device cuda needs a CUDA device" in capsys.readouterr().err


def test_the_unbounded_demos_nan_call_now_runs(capsys):
    """The call that went NaN at step 165 of the unbounded demo on the H200 (saved by NanTrap with
    the value check off): eight gates of one sub-block, rows 1 to 8 after its first, sum past fp32's
    e^88.7. The interpreter named the prepare kernel, as the GPU did, and then stage 6's intra
    kernel; both now take that sub-block by its definition, and every kernel is finite."""
    from kdacourse import REPO_ROOT
    from stages.kda.config import SUB_BLOCK
    from stages.s05_fast_kda.numerics import FP32_LARGEST_LOG

    path = REPO_ROOT / "benchmarks/results/train_kda_cuda_unbounded/nan_trap_step165.pt"
    g = torch.load(path, map_location="cpu")["inputs"][3]
    sub_blocks = g.unflatten(1, (-1, SUB_BLOCK))  # (B, N / 16, 16, H, d_k): N = 32, two sub-blocks
    anchored_exponent = -sub_blocks[:, :, 1:SUB_BLOCK // 2 + 1].sum(2)  # row 0's factor e^{gamma_0 - gamma_8}
    assert anchored_exponent.max() > FP32_LARGEST_LOG
    assert replay_call.main([str(path), "--device", "cpu"]) is None
    printed = capsys.readouterr().out
    assert "prepare: outputs finite [True, True, True, True, True, True]\nrecurrence: outputs finite [True, True]" in printed
    assert "intra: outputs finite [True, True, True, True, True]" in printed
    assert "first kernel with a non-finite output: none" in printed
