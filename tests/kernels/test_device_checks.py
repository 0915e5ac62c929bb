"""stages.common.device_checks: the flags the kernels set on bad values, read where the caller syncs."""

import re

import pytest

from stages.common.device_checks import BAD_BETA, BAD_GATE, BAD_SLOT, FLAG_COUNT, MESSAGES, flags_for, raise_if_flagged

torch = pytest.importorskip("torch")


def test_one_flag_tensor_per_device_whatever_its_name():
    assert flags_for("cpu") is flags_for(torch.device("cpu"))
    assert flags_for("cpu").shape == (FLAG_COUNT,) and flags_for("cpu").dtype == torch.int32


@pytest.mark.parametrize("kinds", [[BAD_GATE], [BAD_BETA], [BAD_SLOT], [BAD_GATE, BAD_SLOT]])
def test_flags_raise_once_with_each_message_and_are_cleared(kinds):
    raise_if_flagged("cpu")  # nothing flagged: no error
    flags_for("cpu")[kinds] = 1
    with pytest.raises(ValueError) as raised:
        raise_if_flagged("cpu")
    for kind in range(FLAG_COUNT):
        assert (MESSAGES[kind] in str(raised.value)) == (kind in kinds)
    assert not flags_for("cpu").any()
    raise_if_flagged("cpu")  # cleared: the next read is quiet


def test_flags_made_inside_inference_mode_are_cleared_outside_it(monkeypatch):
    """A server's first checked call is often under torch.inference_mode, a training step's is not: the
    process-wide flags made by the first must still be cleared (in place) by the second."""
    import stages.common.device_checks as device_checks

    monkeypatch.setattr(device_checks, "_FLAGS", {})  # this process's first call on the CPU
    with torch.inference_mode():
        flags_for("cpu")[BAD_GATE] = 1
    with pytest.raises(ValueError, match=re.escape(MESSAGES[BAD_GATE])):
        raise_if_flagged("cpu")
    assert not flags_for("cpu").any()


def _flag_guards(cuda_source, kind):
    """The conditions of the ifs that set Flags[kind] in a kernel's CUDA source (the line above each store)."""
    lines = cuda_source.splitlines()
    return [lines[i - 1] for i, line in enumerate(lines) if line.strip() == f"Flags[{kind}] = 1;"]


def _flagged_reports():
    """The CUDA sources of the three kernels that flag values, at the shapes their stages' compile tests
    use (compile_report's cache shares one nvcc run)."""
    from stages.kda.compiled import compile_report as forward_report
    from stages.s07_serving.kernel import compile_report as decode_report
    from stages.s07_serving.kernel import varlen_compile_report

    return {"stage 5's prepare": lambda: forward_report("prepare", B=2, N=1024, H=4, d_k=128, d_v=128, value_flags=True),
            "prefill's varlen prepare": lambda: varlen_compile_report("prepare", value_flags=True),
            "decode": decode_report}


@pytest.mark.compile
@pytest.mark.parametrize("kernel", ["stage 5's prepare", "prefill's varlen prepare", "decode"])
def test_the_compiled_kernels_still_test_for_nan(kernel):
    """Each store of BAD_GATE and BAD_BETA in the CUDA source is guarded by a test that holds for NaN,
    a value compared with itself (x != x, what TIR's isnan lowers to). Written as "not (g <= 0)", the
    guard is simplified to "0 < g", false for NaN: the GPU missed NaN while the interpreter, which
    runs the TIR before that rewrite, caught it."""
    source = _flagged_reports()[kernel]().cuda_source
    for kind in (BAD_GATE, BAD_BETA):
        guards = _flag_guards(source, kind)
        assert guards, f"{kernel} sets no Flags[{kind}]"
        assert all("!=" in guard for guard in guards), guards


@pytest.mark.gpu
def test_the_flags_are_not_made_inside_a_cuda_graph_capture(monkeypatch):
    """Made in a capture, the flags would be zeroed by every replay: the first call must come before."""
    from stages.common import device_checks

    monkeypatch.setattr(device_checks, "_FLAGS", {})  # as in a fresh process
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="make one call before the capture"):
        with torch.cuda.graph(graph):
            flags_for("cuda")
    assert flags_for("cuda").device.type == "cuda"  # made outside: fine
