"""symmem.exact: bound formulas read into integer terms agree with sympy, exactly."""
from fractions import Fraction

import sympy as sp

from symmem import exact
from symmem.symbols import L, a, b, h, s


def test_terms_agree_with_sympy_at_every_point():
    # a transformer-like sum: h/a (a negative exponent), a fraction, a square in s
    e = 34 * b * s * h * L + 5 * a * b * s**2 * L + h**2 * L / 2 + b * s * h / a
    f = exact.compile(e, {h: 768, a: 12})
    assert f.terms is not None and f.gens == (L, b, s)
    for point in [(1, 1, 1), (12, 8, 1024), (3, 7, 5)]:
        values = dict(zip((L, b, s), point))
        assert f(values) == e.xreplace({h: 768, a: 12, **values})


def test_fraction_stays_exact():
    f = exact.compile(b * s / 3, {})
    assert f({b: 2, s: 5}) == Fraction(10, 3)
    assert exact.number(sp.Rational(10, 3)) == Fraction(10, 3) and exact.number(sp.Integer(7)) == 7


def test_polynomial_in_one_symbol():
    # 2*b*s**2 + 3*b*s + 4 at s = 10: 200*b + 30*b + 4 -> [4, 230]
    f = exact.compile(2 * b * s**2 + 3 * b * s + 4, {})
    assert f.polynomial(b, {s: 10}) == [4, 230]
    assert f.polynomial(s, {b: 1}) == [4, 3, 2]
    # b/a is no polynomial in a
    assert exact.compile(b / a, {}).polynomial(a, {b: 2}) is None


def test_ceiling_falls_back_to_sympy():
    # int4 packs two elements a byte: ceiling(h*b/2)
    e = sp.ceiling(h * b / 2) + b
    f = exact.compile(e, {h: 7})
    assert f.terms is None and f.polynomial(b, {}) is None
    assert f({b: 3}) == 11 + 3      # ceiling(21/2) = 11
