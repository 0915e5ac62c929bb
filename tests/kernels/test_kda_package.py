"""The fast path's kernel package, stages/kda: one program builder per kernel role whose variants are
Python switches over one signature, the resolved configuration, the calls' one return convention, and
stages 5-7's kernel modules holding no kernel body."""

import ast
import dataclasses
import os
import re

import pytest

from kdacourse import REPO_ROOT

PACKAGE = REPO_ROOT / "stages" / "kda"


def _decorated(path, decorator):
    """Names of the functions in `path` decorated with T.<decorator>, at any depth."""
    tree = ast.parse(path.read_text())
    return [node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)
            and any(isinstance(d, ast.Attribute) and d.attr == decorator for d in node.decorator_list)]


@pytest.mark.parametrize("module, programs", [("prepare", 1), ("recurrence", 1), ("decode", 1), ("backward", 4)])
def test_each_builder_writes_one_program(module, programs):
    """A kernel role's variants (value flags, solve outputs, packed batches) are switches, not signatures:
    one @T.prim_func for each builder (the backward has four kernels)."""
    builders = [node.name for node in ast.parse((PACKAGE / f"{module}.py").read_text()).body
                if isinstance(node, ast.FunctionDef) and node.name.startswith("build_")]
    assert len(builders) == programs
    assert len(_decorated(PACKAGE / f"{module}.py", "prim_func")) == programs


@pytest.mark.parametrize("stage", ["s05_fast_kda", "s06_backward", "s07_serving"])
def test_the_stage_kernel_modules_hold_no_kernel_body(stage):
    path = REPO_ROOT / "stages" / stage / "kernel.py"
    assert _decorated(path, "prim_func") == [] and _decorated(path, "macro") == []
    assert not [name for name in (node.name for node in ast.parse(path.read_text()).body
                                  if isinstance(node, ast.FunctionDef)) if name.startswith("build_")]


def _parameters(program):
    return [program.buffer_map[p].name for p in program.params]


def test_the_prepares_switches_add_their_parameters_and_nothing_else():
    """Flags after the inputs (and the packed index), A_kk and T after the six outputs, Chunks and
    Cu_seqlens after Beta: each variant's parameters are the plain one's with its own inserted."""
    from stages.kda.prepare import PackedBatch, build_prepare_program, prepare_outputs

    inputs, outputs = ["Q", "K", "V", "G", "Beta"], ["W", "U", "Q_decayed", "K_to_chunk_end", "A_qk", "Chunk_decay"]
    packed = PackedBatch(tokens=70, chunks=4, sequences=2)
    cases = {(False, False, None): inputs + outputs,
             (True, False, None): inputs + ["Flags"] + outputs,
             (False, True, None): inputs + outputs + ["A_kk", "Inverse"],
             (True, True, None): inputs + ["Flags"] + outputs + ["A_kk", "Inverse"],
             (False, False, packed): inputs + ["Chunks", "Cu_seqlens"] + outputs,
             (True, False, packed): inputs + ["Chunks", "Cu_seqlens", "Flags"] + outputs}
    for (flags, solve, batch), expected in cases.items():
        program = build_prepare_program(1, 128, 2, 32, 32, 32, value_flags=flags, solve_outputs=solve, packed=batch)
        names = _parameters(program)
        assert names == expected, (flags, solve, batch)
        assert [names[i] for i in prepare_outputs(flags, solve, batch is not None)] == names[len(names) - len(
            outputs) - 2 * solve:], (flags, solve, batch)


def test_the_packed_recurrence_takes_the_index_after_the_states():
    from stages.kda.prepare import PackedBatch
    from stages.kda.recurrence import build_recurrence_program

    dense = _parameters(build_recurrence_program(1, 128, 2, 32, 32, 32, 16))
    packed = _parameters(build_recurrence_program(1, 128, 2, 32, 32, 32, 16, packed=PackedBatch(70, 4, 2)))
    assert packed == dense[:7] + ["Chunk_offsets", "Cu_seqlens"] + dense[7:]


def test_resolve_fills_what_is_not_given():
    from stages.kda.config import KernelConfig, default_intra_threads, resolve

    wide = resolve(1, 32, 128, 128, num_sms=64)  # 32 heads x 2 blocks of 64 columns: every SM has a program
    narrow = resolve(1, 32, 128, 128, num_sms=132)
    assert (wide.block_dv, narrow.block_dv) == (64, 32)
    assert resolve(1, 32, 128, 128, num_sms=132, block_dv=64).block_dv == 64
    assert resolve(1, 8, 64, 64, num_sms=132, chunk_size=32).prepare_threads == 128  # two sub-blocks' slabs
    assert narrow.prepare_threads == 256 and narrow.intra_threads == default_intra_threads(64, 128) == 256
    with pytest.raises(dataclasses.FrozenInstanceError):
        narrow.block_dv = 64
    assert KernelConfig() == resolve(1, 1, 128, 128, num_sms=132)


def test_resolve_takes_chunk_32_and_wide_blocks_with_many_sequence_heads():
    """The forward's chunk by sequences x heads (default_chunk_size: 32 from 64 of them, the H100
    timings of kda_chunk_sizes_h100), and 64 value columns once they give nine SMs in ten a program."""
    from stages.kda.config import resolve

    assert [resolve(B, H, 128, 128, num_sms=132).chunk_size for B, H in ((1, 32), (1, 63), (1, 64), (8, 16))] == [
        64, 64, 32, 32]
    assert resolve(1, 64, 128, 128, num_sms=132).block_dv == 64  # 128 programs on 132 SMs
    assert resolve(1, 59, 128, 128, num_sms=132).block_dv == 32  # 118 programs: fewer than 9 in 10
    assert resolve(1, 64, 128, 128, num_sms=132, chunk_size=64).chunk_size == 64  # the backward's, when asked


def test_the_forward_s_prepare_takes_four_channel_passes_at_chunk_32():
    """default_channel_passes: four at C = 32 where d_k splits into four passes of whole 16-wide GEMM
    steps (four programs an SM where two passes fit three), two at C = 64 and where d_k does not split;
    a size given is kept."""
    from stages.kda.config import resolve

    assert [resolve(B, H, d_k, 128, num_sms=132).channel_passes for B, H, d_k in
            ((1, 96, 128), (8, 16, 128), (1, 64, 64), (1, 64, 96), (1, 64, 32), (1, 32, 128))] == [4, 4, 4, 2, 2, 2]
    assert resolve(1, 32, 128, 128, num_sms=132, chunk_size=32).channel_passes == 4
    assert resolve(1, 96, 128, 128, num_sms=132, channel_passes=2).channel_passes == 2


@pytest.fixture
def stubbed_kernels(monkeypatch):
    """stages.kda.calls on CPU tensors with every compiled kernel replaced by a stub that returns zeros
    of its outputs' shapes: the calls' wiring and return conventions, no kernel."""
    torch = pytest.importorskip("torch")
    from stages.kda import calls, checks

    def prepare_stub(B, N, H, d_k, d_v, C, dtype, threads, value_flags, solve_outputs=False, channel_passes=2):
        def run(q, k, v, g, beta, *flags):
            shapes = [(B, N, H, d_k), (B, N, H, d_v), (B, N, H, d_k), (B, N, H, d_k), (B, N, H, C), (B, N // C, H, d_k)]
            return [torch.zeros(shape) for shape in shapes + [(B, N, H, C)] * 2 * solve_outputs]
        return run

    def recurrence_stub(B, N, H, d_k, d_v, *sizes):
        return lambda *tensors: (torch.zeros(B, N, H, d_v), tensors[6] + 1)

    monkeypatch.setattr(checks, "check_on_cuda", lambda tensors: None)
    monkeypatch.setattr(calls, "compiled_prepare", prepare_stub)
    monkeypatch.setattr(calls, "compiled_recurrence", recurrence_stub)
    monkeypatch.setattr(calls, "compiled_decode",
                        lambda B, P, H, d_k, d_v, *sizes: lambda q, k, v, *rest: torch.zeros(B, H, d_v))
    return torch


def test_every_forward_call_returns_the_output_and_the_final_state_or_none(stubbed_kernels):
    torch = stubbed_kernels
    from stages.kda.calls import decode, forward, forward_and_prepared, prefill
    from stages.kda.config import KernelConfig

    config = KernelConfig(chunk_size=32, block_dv=16, prepare_threads=128)
    q, g, beta = torch.zeros(1, 40, 2, 32, dtype=torch.float16), -torch.ones(1, 40, 2, 32), torch.ones(1, 40, 2) / 2
    o, final_state = forward(q, q, q, g, beta, config=config)
    assert o.shape == (1, 40, 2, 32) and final_state is None  # o cut back to N
    o, final_state = forward(q, q, q, g, beta, output_final_state=True, config=config)
    assert final_state.shape == (1, 2, 32, 32) and torch.equal(final_state, torch.ones(1, 2, 32, 32))
    assert prefill(q, q, q, g, beta, output_final_state=True, config=config)[1].shape == (1, 2, 32, 32)
    *_, prepared = forward_and_prepared(q, q, q, g, beta, config=config)
    assert len(prepared) == 8 and prepared[0].shape == (1, 64, 2, 32)  # padded to whole chunks
    pool = torch.zeros(4, 2, 32, 32)
    o, returned = decode(q[:, 0], q[:, 0], q[:, 0], g[:, 0], beta[:, 0], pool, torch.tensor([1], dtype=torch.int32))
    assert o.shape == (1, 2, 32) and returned is pool


def _dynamic_shared_bytes(program) -> int:
    """The dynamic shared memory TileLang's lowering gives one program's kernel (no GPU needed)."""
    from stages.common.tilelang_tools import lower

    sizes = [int(fn.attrs["dyn_shared_memory_buf"]) for _, fn in lower(program).device_mod.functions.items()
             if fn.attrs is not None and "dyn_shared_memory_buf" in fn.attrs]
    assert len(sizes) == 1, f"expected one kernel with dynamic shared memory, found {len(sizes)}"
    return sizes[0]


@pytest.mark.parametrize(("chunk_size", "d_k", "block_dv", "num_stages"),
                         [(64, 256, 32, 2), (64, 256, 32, 1), (32, 128, 64, 2)])
def test_recurrence_shared_bytes_is_what_the_lowered_program_asks_for(chunk_size, d_k, block_dv, num_stages):
    """config.recurrence_shared_bytes, which decides the recurrence's pipeline stages, against the dynamic
    shared memory TileLang's lowering gives the program (no GPU needed); and the stages it picks: one where
    two would pass an H100's or H200's 227 KiB."""
    from stages.kda.config import SHARED_MEMORY_PER_BLOCK, default_num_stages, recurrence_shared_bytes
    from stages.kda.recurrence import build_recurrence_program

    program = build_recurrence_program(1, 4 * chunk_size, 2, d_k, d_k, chunk_size, block_dv, "bfloat16", num_stages)
    assert _dynamic_shared_bytes(program) == recurrence_shared_bytes(chunk_size, d_k, block_dv, num_stages)
    two_fit = recurrence_shared_bytes(chunk_size, d_k, block_dv, 2) <= SHARED_MEMORY_PER_BLOCK
    assert default_num_stages(chunk_size, d_k, block_dv) == (2 if two_fit else 1)
    assert (chunk_size, d_k, two_fit) != (64, 256, True)  # the case that failed its launch on an H100


def test_the_backward_s_programs_fit_at_head_dims_of_256_at_the_chunk_they_run_at():
    """d_k = d_v = 256: at backward_chunk_size's chunk (32) every backward program's shared memory fits a
    program's SHARED_MEMORY_PER_BLOCK (the state products by blocks of 64 columns); at 64 the intra
    program does not, which is why such a call trains at 32."""
    from stages.kda.backward import BUILDERS, kernel_arguments
    from stages.kda.config import SHARED_MEMORY_PER_BLOCK, backward_chunk_size

    chunk_size = backward_chunk_size(256, 256)
    arguments = kernel_arguments(1, 4 * chunk_size, 2, 256, 256, chunk_size, 64, "bfloat16")
    sizes = {name: _dynamic_shared_bytes(BUILDERS[name][0](*arguments[name])) for name in arguments}
    wide_chunk = kernel_arguments(1, 256, 2, 256, 256, 64, 64, "bfloat16")["intra"]
    intra_at_64 = _dynamic_shared_bytes(BUILDERS["intra"][0](*wide_chunk))
    print(f"d = 256, bytes of shared memory at C = {chunk_size}: {sizes}; the intra program at C = 64: {intra_at_64}")
    assert all(size <= SHARED_MEMORY_PER_BLOCK for size in sizes.values()), sizes
    assert intra_at_64 > SHARED_MEMORY_PER_BLOCK


@pytest.mark.compile
@pytest.mark.parametrize(("packed", "programs_per_sm"), [(False, 2), (False, 3), (True, 2), (True, 3)])
def test_the_recurrence_s_launch_bound_fits_that_many_programs_an_sm(packed, programs_per_sm):
    """programs_per_sm: the compiled recurrence (32 value columns, C = 32) asks for that many programs an
    SM (its launch bound) and its registers fit them (65,536 an SM over programs_per_sm programs of 256
    threads) without spills; the loading warp group gives its registers back and the computing one
    takes no more than it gave (setmaxnreg's pool is the program's own: asking for more waits
    forever); at the default (1) TileLang's own bound stands."""
    from stages.common.tilelang_tools import compile_report
    from stages.kda.compiled import packed_sizes
    from stages.kda.config import LOADER_REGISTERS, REGISTERS_PER_SM, computing_registers
    from stages.kda.recurrence import build_recurrence_program

    rows, batch = packed_sizes() if packed else (8192, None)
    arguments = (1, rows, 96, 128, 128, 32, 32, "bfloat16")
    bounded = compile_report(build_recurrence_program(*arguments, packed=batch, programs_per_sm=programs_per_sm))
    default = compile_report(build_recurrence_program(*arguments, packed=batch))
    assert f"__launch_bounds__({bounded.threads}, {programs_per_sm})" in bounded.cuda_source
    assert bounded.registers * bounded.threads * programs_per_sm <= REGISTERS_PER_SM and not bounded.spill_stores
    computing = computing_registers(bounded.threads, programs_per_sm)
    # one setmaxnreg a warp group, each in its own branch: none in the code both groups run
    assert re.findall(r"warpgroup_reg_dealloc<(\d+)>", bounded.cuda_source) == [str(LOADER_REGISTERS)]
    assert re.findall(r"warpgroup_reg_alloc<(\d+)>", bounded.cuda_source) == [str(computing)]
    assert LOADER_REGISTERS + computing <= 2 * bounded.registers  # the two warp groups are the same size
    assert f"__launch_bounds__({default.threads}, 1)" in default.cuda_source


@pytest.mark.parametrize("programs_per_sm", [2, 3])
def test_the_launch_bound_changes_no_arithmetic(programs_per_sm):
    """The bounded recurrence computes, on the tile interpreter, the same bits as the default one: the
    bound and the registers the warp groups hold change where values live, not what they are (two
    chunks of 32, decays in (0, 1], a nonzero initial state)."""
    import numpy as np

    from stages.common.interpreter import interpret
    from stages.kda.recurrence import build_recurrence_program

    def outputs(bound):
        program = build_recurrence_program(1, 64, 1, 64, 64, chunk_size=32, block_dv=32, dtype="float16",
                                           programs_per_sm=bound)
        generator = np.random.default_rng(7)
        arrays = []
        for buffer in (program.buffer_map[p] for p in program.params):
            shape, name = [int(n) for n in buffer.shape], buffer.name
            values = generator.uniform(0.2, 1.0, shape) if name == "Chunk_decay" else generator.normal(0, 0.3, shape)
            arrays.append(values.astype(np.float32 if "float32" in str(buffer.dtype) else np.float16))
        interpret(program)(*arrays)
        return arrays[-2:]  # o and the final state

    default, bounded = outputs(1), outputs(programs_per_sm)
    assert all(np.isfinite(x).all() and np.array_equal(x, y) for x, y in zip(default, bounded))


def test_each_case_of_a_precompile_runs_in_a_process_of_its_own_and_failures_are_named(tmp_path):
    from stages.kda.on_cpu import each_in_a_process

    script = tmp_path / "precompile.py"  # writes its case's process id and arguments; fails at case "b"
    script.write_text("import os, sys\n"
                      "name = sys.argv[sys.argv.index('--cases') + 1]\n"
                      f"open(os.path.join({str(tmp_path)!r}, name + '.pid'), 'w').write(str(os.getpid()))\n"
                      f"open(os.path.join({str(tmp_path)!r}, name + '.args'), 'w').write(' '.join(sys.argv[1:]))\n"
                      "sys.exit(name == 'b')\n")
    assert each_in_a_process(script, ["a", "b", "c"], jobs=2, arguments=("--gates", "softplus")) == ["b"]
    pids = {(tmp_path / f"{name}.pid").read_text() for name in "abc"}
    assert len(pids) == 3 and str(os.getpid()) not in pids  # three processes, none of them this one
    assert [(tmp_path / f"{name}.args").read_text() for name in "abc"] == [
        f"--cases {name} --gates softplus" for name in "abc"]  # its case, then the arguments every case takes
