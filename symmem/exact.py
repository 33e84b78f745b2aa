"""Exact bytes with Python integers: a formula read into its terms once, then evaluated
without sympy.

With the model's and the policy's numbers bound, a byte formula is a sum of terms
``c * x1**e1 * x2**e2 ...`` over the symbols left free (``b``, ``s``, a degree ``d``), each
``c`` a rational and each exponent an integer (negative where a count is divided: ``h/a``).
:func:`compile` reads the terms once (:func:`symmem.bounds.terms`); a call multiplies
integers and fractions: exact, and hundreds of times faster than ``xreplace`` on the
expression. :meth:`symmem.engine.Estimate.at` and the solver (:mod:`symmem.solve`) evaluate
through it. A formula with another kind of factor (a ceiling: int4 packs two elements a
byte) keeps sympy's path, exact too.
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

import sympy as sp

from .bounds import from_terms, terms as _read_terms

__all__ = ["Compiled", "compile", "compile_terms", "number"]


@dataclass(frozen=True)
class Compiled:
    """One formula with its numbers bound: ``expr`` (sympy, for messages and the fallback)
    and, when it is a sum of monomials in symbols, ``terms``: ``((exponents, coefficient),
    ...)`` over ``gens``, exponents in the order of ``gens``."""
    expr: sp.Expr
    gens: tuple
    terms: tuple | None

    def __call__(self, values: dict):
        """The exact value (an int, or a Fraction where it is not whole) at ``values``
        ({symbol: int}, every symbol of :attr:`gens` given; others are ignored)."""
        if self.terms is None:
            return number(self.expr.xreplace({k: sp.Integer(x) for k, x in values.items()}))
        xs = [values[g] for g in self.gens]
        return sum(_term(c, others, xs) for _, c, others in self._in(None))

    def polynomial(self, x, values: dict) -> list | None:
        """The formula as a polynomial in ``x`` with every other symbol of :attr:`gens` at
        its value: its coefficients, lowest degree first, each an int or Fraction; None when
        it is not one (a negative power of ``x``, or a factor that is not a monomial)."""
        plan = self._in(x)
        if plan is None:
            return None
        xs = [values.get(g) for g in self.gens]
        coeffs: dict = {}
        for deg, c, others in plan:
            coeffs[deg] = coeffs.get(deg, 0) + _term(c, others, xs)
        top = max(coeffs, default=0)
        return [coeffs.get(k, 0) for k in range(top + 1)]

    def _in(self, x) -> tuple | None:
        """Each term as (degree in ``x``, coefficient, ((index, exponent) of every other
        symbol, ...)), read once per ``x`` and kept (a solve reads every candidate's); None
        when the formula is not a polynomial in ``x``."""
        memo = self.__dict__.setdefault("_plans", {})
        if x not in memo:
            plan = None
            if self.terms is not None:
                i = self.gens.index(x) if x in self.gens else None
                plan = []
                for exps, c in self.terms:
                    deg = 0 if i is None else exps[i]
                    if deg < 0:
                        plan = None
                        break
                    plan.append((deg, c, tuple((j, e) for j, e in enumerate(exps) if e and j != i)))
                plan = None if plan is None else tuple(plan)
            memo[x] = plan
        return memo[x]


def _term(c, others, xs):
    """``c`` times ``xs[j] ** e`` for each (j, e) of ``others``: an int where it is whole."""
    num, den = c, 1
    for j, e in others:
        if e > 0:
            num = num * xs[j] ** e
        else:
            den *= xs[j] ** -e
    return num if den == 1 else Fraction(num, den)


def compile(expr, bindings: dict) -> Compiled:
    """``expr`` with ``bindings`` ({symbol: number}) substituted, read into its terms."""
    e = sp.expand(sp.sympify(expr).xreplace(bindings))
    gens = tuple(sorted(e.free_symbols, key=str))
    d = _read_terms(e)
    if d is None or any(not base.is_Symbol for key in d for base, _ in key):
        return Compiled(e, gens, None)
    index = {g: i for i, g in enumerate(gens)}
    out = []
    for key, c in d.items():
        exps = [0] * len(gens)
        for base, ex in key:
            exps[index[base]] += int(ex)
        out.append((tuple(exps), c))
    return Compiled(e, gens, tuple(out))


def compile_terms(d: dict, bindings: dict) -> Compiled:
    """:func:`compile` of the sum :func:`~symmem.bounds.terms` ``d`` stands for, its bound
    symbols multiplied into the coefficients without expanding an expression. A factor other
    than a symbol (a ceiling) is bound too; one that keeps a free symbol (``ceiling(s/128)``)
    leaves the result to sympy's path (``terms`` None), as :func:`compile` does."""
    bound = {k: number(v) for k, v in bindings.items()}
    merged: dict = {}
    atoms = False
    for key, c in d.items():
        rest = []
        for base, ex in key:
            if not base.is_Symbol and base not in bound:    # an atom: a number once its symbols are bound
                x = base.xreplace(bindings)
                bound[base] = number(x) if x.is_Rational else x
            x = bound.get(base)
            if x is None or isinstance(x, sp.Basic):
                rest.append((base if x is None else x, ex))
                atoms = atoms or x is not None
            else:
                c = c * x ** ex if ex > 0 else Fraction(c) / x ** -ex
        rest = frozenset(rest)
        merged[rest] = merged.get(rest, 0) + c
    merged = {k: (int(c) if isinstance(c, Fraction) and c.denominator == 1 else c)
              for k, c in merged.items() if c != 0}
    expr = from_terms(merged)
    if atoms:
        return Compiled(expr, tuple(sorted(expr.free_symbols, key=str)), None)
    gens = tuple(sorted({base for key in merged for base, _ in key}, key=str))
    index = {g: i for i, g in enumerate(gens)}
    out = []
    for key, c in merged.items():
        exps = [0] * len(gens)
        for base, ex in key:
            exps[index[base]] += int(ex)
        out.append((tuple(exps), c))
    return Compiled(expr, gens, tuple(out))


def number(v):
    """A sympy (or Python) number as a Python int or Fraction, what :class:`Compiled`
    computes with; anything else (a float, an irrational) is returned as it is."""
    if isinstance(v, (int, Fraction)):
        return v
    v = sp.sympify(v)
    if v.is_Integer:
        return int(v)
    return Fraction(int(v.p), int(v.q)) if v.is_Rational else v
