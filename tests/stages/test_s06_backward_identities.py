"""Stage 6 identities: every gradient identity proved, every common mistake refuted at one point and
shown to hide where the catalog says it does."""

import inspect

import pytest

from tests.stages.identity_checks import identity_tests
from stages.s06_backward import identities


test_identity_holds, test_identity_is_not_vacuous, test_refuted_form_differs = identity_tests(identities)


HIDING = [build for build in identities.REFUTED if inspect.signature(build).parameters]


@pytest.mark.parametrize("build", HIDING, ids=lambda build: build.__name__)
def test_refuted_form_hides_where_its_docstring_says(build):
    """L = 0, M = 0, g = 0, equal gates, W = 0: on those inputs the mistake gives the right answer, so
    a test needs inputs away from them."""
    assert build(True).holds()


def test_the_mistakes_that_hide_are_the_expected_ones():
    assert {build.__name__ for build in HIDING} == {
        "inverse_gradient_untransposed", "beta_gradient_rows_only", "beta_gradient_columns_as_rows",
        "gate_gradient_without_gate", "step_adjoints_swapped", "chunk_state_gradient_without_pseudo_values"}
