"""The three checks every stage's SymPy identities take (stages 6 and 8 have modules of their own; stages
1-4 share tests/stages/test_stages.py): each identity holds, is not vacuous, and each refuted form is
refuted. `identity_tests(module)` makes them as parametrized tests over the module's IDENTITIES and
REFUTED, for a test file to bind at module level."""

import pytest
import sympy as sp

from stages.common.symbolic import Identity, counterexample


def identity_tests(identities):
    """(test_identity_holds, test_identity_is_not_vacuous, test_refuted_form_differs) for `identities`."""

    @pytest.mark.parametrize("build", identities.IDENTITIES, ids=lambda build: build.__name__)
    def test_identity_holds(build):
        assert build().holds()

    @pytest.mark.parametrize("build", identities.IDENTITIES, ids=lambda build: build.__name__)
    def test_identity_is_not_vacuous(build):
        """Both sides are not all zero, and changing one entry of the formula breaks the proof."""
        identity = build()
        assert not identity.lhs.applyfunc(sp.expand).is_zero_matrix
        changed = identity.rhs.copy()
        changed[0] = changed[0] + sp.Symbol("epsilon")
        assert not Identity(identity.name, identity.statement, identity.lhs, changed).holds()

    @pytest.mark.parametrize("build", identities.REFUTED, ids=lambda build: build.__name__)
    def test_refuted_form_differs(build):
        assert counterexample(build()) is not None

    return test_identity_holds, test_identity_is_not_vacuous, test_refuted_form_differs
