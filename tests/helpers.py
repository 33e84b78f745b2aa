"""Checks shared by several test files."""
import sympy as sp

from symmem.symbols import L


def assert_repeat_matches_unrolled(rep, unr, n, points=((1, 1), (3, 7), (64, 2048))):
    """The estimate of a graph with a repeat of L equals that of the graph unrolled to n
    iterations: every component symbolically at L = n, the peak at each (b, s)."""
    for name, expr in rep.components.items():
        assert sp.expand(expr.subs(L, n) - unr.components[name]) == 0, name
    for bb, ss in points:
        assert rep.at(b=bb, s=ss, L=n).peak == unr.at(b=bb, s=ss).peak, (bb, ss)
