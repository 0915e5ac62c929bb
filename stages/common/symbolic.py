"""SymPy helpers for the identities of every stage.

An identity is two matrix expressions built from symbols of small size; it is proved when
lhs - rhs simplifies to the zero matrix. That is a proof for the sizes used (every entry is an
algebraic identity in the symbols), not a numerical sample.
"""

from dataclasses import dataclass

import sympy as sp


@dataclass
class Identity:
    """lhs == rhs, with a name and the sentence it stands for."""

    name: str
    statement: str
    lhs: sp.Matrix
    rhs: sp.Matrix

    def difference(self):
        """lhs - rhs, simplified entry by entry."""
        if self.lhs.shape != self.rhs.shape:
            raise ValueError(f"{self.name}: lhs is {self.lhs.shape}, rhs is {self.rhs.shape}")
        return (self.lhs - self.rhs).applyfunc(lambda entry: sp.simplify(sp.expand(entry)))

    def holds(self):
        return self.difference().is_zero_matrix


def counterexample(identity):
    """A point (symbol -> rational) where lhs - rhs is not zero: one point proves the two differ."""
    symbols = sorted(identity.lhs.free_symbols | identity.rhs.free_symbols, key=str)
    point = {symbol: sp.Rational(number + 2, number + 3) for number, symbol in enumerate(symbols)}
    return point if any((identity.lhs - identity.rhs).subs(point)) else None


def matrix(name, rows, cols):
    """A rows x cols matrix of distinct symbols name_{i,j} (real)."""
    return sp.Matrix(rows, cols, lambda i, j: sp.Symbol(f"{name}_{i}{j}", real=True))


def rows_of(M):
    """The rows of M as a list of 1 x n matrices."""
    return [M[i, :] for i in range(M.rows)]


def causal_mask(size, include_diagonal=True):
    """M[r, j] = 1 for j <= r (or j < r when include_diagonal is False)."""
    return sp.Matrix(size, size, lambda r, j: 1 if (j <= r if include_diagonal else j < r) else 0)


def print_identities(identities, refuted=()):
    """A stage's `python -m stages.<stage>.identities`: each identity proved (or FAILS), each wrong
    form refuted by a counterexample (or HOLDS)."""
    for build in identities:
        identity = build()
        print(f"{'proved' if identity.holds() else 'FAILS '}  {identity.name}: {identity.statement}")
    for build in refuted:
        identity = build()
        print(f"{'refuted' if counterexample(identity) else 'HOLDS  '}  {identity.name}: {identity.statement}")
