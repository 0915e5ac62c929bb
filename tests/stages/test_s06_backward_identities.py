"""Stage 6 identities: every gradient identity proved, every common mistake refuted at one point and
shown to hide where the catalog says it does."""

import inspect

import pytest
import sympy as sp

from stages.common.symbolic import Identity, counterexample
from stages.s06_backward import identities


@pytest.mark.parametrize("build", identities.IDENTITIES, ids=lambda build: build.__name__)
def test_identity_holds(build):
    assert build().holds()


@pytest.mark.parametrize("build", identities.IDENTITIES, ids=lambda build: build.__name__)
def test_identity_is_not_vacuous(build):
    """The derivative side is not all zero, and changing one entry of the formula breaks the proof."""
    identity = build()
    assert not identity.lhs.applyfunc(sp.expand).is_zero_matrix
    changed = identity.rhs.copy()
    changed[0] = changed[0] + sp.Symbol("epsilon")
    assert not Identity(identity.name, identity.statement, identity.lhs, changed).holds()


@pytest.mark.parametrize("build", identities.REFUTED, ids=lambda build: build.__name__)
def test_refuted_form_differs(build):
    assert counterexample(build()) is not None


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
