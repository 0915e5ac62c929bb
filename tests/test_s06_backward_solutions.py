"""Stage 6's solutions hold the library's functions (references A, B and C's intra-chunk step): the
same code, compared as syntax trees (comments and docstrings may differ)."""

import pytest

from stages.s06_backward import reference
from tests.solution_code import assert_solution_is_library_code


@pytest.mark.parametrize("name", ["recurrent_backward", "chunkwise_backward", "intra_gradients"])
def test_solutions_are_the_library_code(name):
    assert_solution_is_library_code("s06_backward", name, reference)
