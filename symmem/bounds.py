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

__all__ = ["provably_nonneg", "shifted_coeffs", "dominates", "prune"]


def provably_nonneg(expr) -> bool:
    """True when ``expr >= 0`` follows from the assumptions (dimensions >= 1, bytes > 0)."""
    e = sp.expand(expr)
    if e == 0:
        return True
    num, den = sp.fraction(sp.together(e))
    gens = sorted(num.free_symbols | den.free_symbols, key=str)
    cn, cd = shifted_coeffs(num, gens), shifted_coeffs(den, gens)
    return cn is not None and cd is not None and all(c >= 0 for c in cn.values()) \
        and all(c >= 0 for c in cd.values())


def shifted_coeffs(e, gens) -> dict | None:
    """Coefficients of ``e`` as a polynomial in (x - 1) for each dimension x and in the
    byte prices; None when ``e`` is not a polynomial. All of them >= 0 proves e >= 0."""
    if not gens:
        return {(): Fraction(int(e.p), int(e.q))} if e.is_Rational else None
    try:
        coeffs = sp.Poly(e, *gens).as_dict()
    except sp.PolynomialError:
        return None
    if not all(c.is_Rational for c in coeffs.values()):
        return None
    shifted = [i for i, g in enumerate(gens) if g in DIMENSIONS]
    out: dict = {}
    for mono, c in coeffs.items():
        # x^e = ((x - 1) + 1)^e = sum_j C(e, j) (x - 1)^j, for each dimension x
        terms = [(mono, Fraction(int(c.p), int(c.q)))]
        for i in shifted:
            terms = [(m[:i] + (j,) + m[i + 1:], v * comb(m[i], j))
                     for m, v in terms for j in range(m[i] + 1)]
        for m, v in terms:
            out[m] = out.get(m, 0) + v
    return out


def dominates(cj: dict, ci: dict) -> bool:
    """Does the polynomial with coefficients cj minus the one with ci have none negative?"""
    return all(cj.get(m, 0) - c >= 0 for m, c in ci.items()) and \
        all(c >= 0 for m, c in cj.items() if m not in ci)


def prune(exprs: list) -> list[int]:
    """Indices of the expressions no other provably dominates (of equal ones, the first)."""
    totals = [sp.expand(e) for e in exprs]
    gens = sorted(set().union(*(t.free_symbols for t in totals)), key=str)
    coeffs = [shifted_coeffs(t, gens) for t in totals]
    keep = []
    for i, ci in enumerate(coeffs):
        if ci is None:
            keep.append(i)
            continue
        dominated = False
        for j, cj in enumerate(coeffs):
            if j == i or cj is None or not dominates(cj, ci):
                continue
            if j < i or not dominates(ci, cj):   # strictly larger, or an earlier equal
                dominated = True
                break
        if not dominated:
            keep.append(i)
    return keep
