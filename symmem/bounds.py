"""What can be proven about byte formulas from the symbols' assumptions alone.

Every dimension (``b``, ``s``, ``h``, ``L``, ...) is an integer >= 1 and every byte price
is > 0. A polynomial is then provably >= 0 when, written in ``x - 1`` for each dimension
``x`` (and in the prices as they are), it has no negative coefficient: each monomial is a
product of non-negative factors. That one test decides which candidates of the peak can
be dropped (another is at least as large everywhere) and which moments of a repeated
block can be left out.
"""
from __future__ import annotations

from fractions import Fraction
from math import comb

import sympy as sp

from .symbols import DIMENSIONS

__all__ = ["provably_nonneg", "monomials", "shifted_coeffs", "dominates", "prune", "samples"]


def provably_nonneg(expr) -> bool:
    """True when ``expr >= 0`` follows from the assumptions (dimensions >= 1, bytes > 0)."""
    e = sp.sympify(expr)
    gens = sorted(e.free_symbols, key=str)
    poly = _polynomial(e, gens)
    if poly is None:                        # a ratio: numerator and denominator apart
        num, den = sp.fraction(sp.together(e))
        gens = sorted(num.free_symbols | den.free_symbols, key=str)
        polys = [monomials(sp.expand(num), gens), monomials(sp.expand(den), gens)]
    else:
        polys = [poly]
    return all(q is not None and all(c >= 0 for c in shifted_coeffs(q, gens).values()) for q in polys)


def monomials(e, gens) -> dict | None:
    """An expanded polynomial ``e`` as {exponents of ``gens``: Fraction}; None when ``e`` is
    not a polynomial in ``gens`` with rational coefficients. Read off the terms directly
    (sympy's ``Poly`` costs ten times more)."""
    index = {g: i for i, g in enumerate(gens)}
    out: dict = {}
    for term, c in sp.sympify(e).as_coefficients_dict().items():
        if not c.is_Rational:
            return None
        exps = [0] * len(gens)
        if term is not sp.S.One:
            for base, ex in term.as_powers_dict().items():
                if base not in index or not (ex.is_Integer and ex >= 0):
                    return None
                exps[index[base]] += int(ex)
        key = tuple(exps)
        out[key] = out.get(key, 0) + (int(c.p) if c.q == 1 else Fraction(int(c.p), int(c.q)))
    return {k: v for k, v in out.items() if v != 0}


def _polynomial(e, gens) -> dict | None:
    """:func:`monomials` of ``e``, expanding it only when it is not a sum of monomials yet
    (the counter's totals are sums of expanded parts: expanding again costs most)."""
    poly = monomials(e, gens)
    return poly if poly is not None else monomials(sp.expand(e), gens)


def shifted_coeffs(poly: dict, gens) -> dict:
    """The coefficients of a polynomial (:func:`monomials`) rewritten in (x - 1) for each
    dimension x, the byte prices left as they are. All of them >= 0 proves it >= 0."""
    shifted = [i for i, g in enumerate(gens) if g in DIMENSIONS]
    out: dict = {}
    for mono, c in poly.items():
        # x^e = ((x - 1) + 1)^e = sum_j C(e, j) (x - 1)^j, for each dimension x
        terms = [(mono, c)]
        for i in shifted:
            if mono[i]:
                terms = [(m[:i] + (j,) + m[i + 1:], v * comb(m[i], j)) for m, v in terms for j in range(m[i] + 1)]
        for m, v in terms:
            out[m] = out.get(m, 0) + v
    return out


def dominates(cj: dict, ci: dict) -> bool:
    """Does the polynomial with coefficients cj minus the one with ci have none negative?"""
    return all(cj.get(m, 0) >= c for m, c in ci.items()) and \
        all(c >= 0 for m, c in cj.items() if m not in ci)


_POINTS = (lambda n: [2] * n, lambda n: [3 + 2 * i for i in range(n)], lambda n: [1] * n,
           lambda n: [1000 - 7 * i for i in range(n)], lambda n: [1 + (i % 2) * 50 for i in range(n)],
           lambda n: [51 - (i % 2) * 50 for i in range(n)])


def _value(poly: dict, point) -> Fraction:
    total = 0
    for mono, c in poly.items():
        for x, e in zip(point, mono):
            if e:
                c = c * x ** e
        total += c
    return total


def samples(exprs) -> list[tuple]:
    """Each expression's exact value at a few points where every symbol is >= 1: a cheap
    first test (an expression larger somewhere cannot be dominated there)."""
    exprs = [sp.sympify(e) for e in exprs]
    gens = sorted(set().union(*(e.free_symbols for e in exprs)), key=str)
    points = [f(len(gens)) for f in _POINTS]
    out = []
    for e in exprs:
        poly = _polynomial(e, gens)
        if poly is None:
            out.append(tuple(e.xreplace(dict(zip(gens, map(sp.Integer, p)))) for p in points))
        else:
            out.append(tuple(_value(poly, p) for p in points))
    return out


def prune(exprs: list) -> list[int]:
    """Indices of the expressions no other provably dominates (of equal ones, the first).
    An expression can only be dominated by one at least as large at every sample point, so
    the coefficients are worked out only for those pairs."""
    totals = [sp.sympify(e) for e in exprs]
    gens = sorted(set().union(*(t.free_symbols for t in totals)), key=str)
    polys = [_polynomial(t, gens) for t in totals]
    points = [f(len(gens)) for f in _POINTS]
    values = [tuple(_value(q, p) for p in points) if q is not None
              else tuple(t.xreplace(dict(zip(gens, map(sp.Integer, p)))) for p in points)
              for q, t in zip(polys, totals)]
    coeffs: dict = {}

    def coeff(i):
        if i not in coeffs:
            coeffs[i] = shifted_coeffs(polys[i], gens) if polys[i] is not None else None
        return coeffs[i]

    keep = []
    for i in range(len(totals)):
        dominated = False
        for j in range(len(totals)):
            if j == i or any(x < y for x, y in zip(values[j], values[i])):
                continue
            ci, cj = coeff(i), coeff(j)
            if ci is None:
                break
            if cj is None or not dominates(cj, ci):
                continue
            if j < i or not dominates(ci, cj):   # strictly larger, or an earlier equal
                dominated = True
                break
        if not dominated:
            keep.append(i)
    return keep
