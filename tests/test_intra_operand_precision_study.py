"""benchmarks.studies.s06_intra_operand_precision's variants of stage 6's intra kernel: each puts exactly
its group of GEMM operands in fp32 and leaves the others in the input dtype (the study itself runs the
backward through the interpreter, a few seconds a seed)."""

import re

import pytest

from benchmarks.studies.s06_intra_operand_precision import OPERAND_GROUPS, build_fp32_operand_intra


def _shared_dtypes(program):
    """{buffer: dtype} of a program's shared buffers, from its TIR (float32 is TIR's default, not written)."""
    found = re.findall(r'(\w+) = T\.\w*alloc_buffer\(\([^)]*\)(?:, "(\w+)")?, scope="shared', program.script())
    return {name: dtype or "float32" for name, dtype in found}


@pytest.mark.parametrize("group", OPERAND_GROUPS)
def test_a_variant_widens_its_group_and_nothing_else(group):
    from stages.s06_backward.kernel import build_intra_program

    shape = (1, 64, 1, 32, 32, 32, "bfloat16")
    kernel, variant = _shared_dtypes(build_intra_program(*shape)), _shared_dtypes(build_fp32_operand_intra(group)(*shape))
    assert set(kernel) == set(variant)
    widened = {name for name in kernel if kernel[name] != variant[name]}
    assert widened == set(OPERAND_GROUPS[group])
    assert all(kernel[name] == "bfloat16" and variant[name] == "float32" for name in widened)
