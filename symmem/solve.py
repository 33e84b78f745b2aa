"""The largest (or smallest) value of a symbol that fits a memory budget.

Memory grows with the batch, the sequence length, the layers and the hidden size, and
falls with parallel degrees and with gradient-accumulation steps at a fixed global batch.
:func:`solve` finds, with every other symbol fixed, the largest value of a growing
symbol (``direction="max"``) or the smallest value of a falling one (``"min"``) whose
peak fits ``M - R`` (the budget minus the reserve), exactly: it evaluates the peak
(a ``Max`` of candidate formulas) with integers and searches (doubling, then bisection),
then proves the answer by evaluating at it and one step past it.

It also gives the boundary in closed form: the candidate that crosses the budget first
(it *binds*) is a polynomial in the symbol, so ``candidate(x) = M - R`` solves as
``x = (M - R - c0)/c1`` (linear) or by the quadratic formula (``s`` with explicit
attention's ``a*b*s**2`` terms); the answer is its floor (or ceiling for ``"min"``).
"""
from __future__ import annotations

import textwrap

from dataclasses import dataclass, field
from functools import cached_property
from fractions import Fraction
from math import gcd

import sympy as sp

from .engine import Estimate, Evaluation, canonical
from .exact import number
from .errors import ConfigError, Infeasible, SearchLimit
from .gpus import as_budget
from .printing import format_bytes, html_escape, html_table, latex, mathml, values_text
from .counter import Point
from .symbols import BYTE_SYMBOLS, DIMENSIONS, M, R, b, symbol as lookup

__all__ = ["Solution", "solve", "max_batch", "max_seq", "frontier"]

LIMIT = 2**40   # the search gives up past this value of the symbol


@dataclass(frozen=True)
class Solution:
    """The answer of :func:`solve` with its proof and its closed form."""
    symbol: str
    direction: str              # "max" or "min"
    value: int
    total: int                  # the device's bytes (M)
    reserve: int                # bytes set aside (R)
    binding: Point              # the candidate of the peak that crosses the budget
    fixed: dict
    limit: str | None = None    # set when the model's own limit, not memory, stops the search
    step: int | None = None     # the value one step past the answer (value +- 1, or the next
                                # multiple or divisor the model allows); None: past_value's
    past: bool = False          # is there a value one step past it to show (past_value)?
    closed: tuple | None = field(default=None, repr=False, compare=False)
    # what _boundary needs, (x, subs); None where there is no closed form (multiples, divisors,
    # the model's limit). The boundary is derived when first read: a solve that is not shown
    # does not pay sympy's time for it.
    est: object = field(default=None, repr=False, compare=False)
    # the estimate solved: at_value and past_value are its exact evaluations, made when first
    # read (the search has already compared those peaks with the budget in exact integers)

    @cached_property
    def at_value(self) -> Evaluation:
        """Exact bytes at the answer: peak <= total - reserve."""
        return self.est.at(**self.fixed, **{self.symbol: self.value})

    @cached_property
    def past_value(self) -> Evaluation | None:
        """Exact bytes one step past it (the next value the model allows): peak > usable; None
        where no value is past it (the model's own limit)."""
        return self.est.at(**self.fixed, **{self.symbol: self.step}) if self.past else None

    @cached_property
    def _forms(self) -> tuple:
        if self.closed is None:
            return None, None
        x, subs = self.closed
        return _boundary(self.binding, x, self.direction, self.value, subs, self.total, self.reserve)

    @property
    def boundary(self) -> sp.Expr | None:
        """The answer as a formula in M, R and the other symbols (a floor, or a ceiling for
        "min"); None where it is not linear or quadratic in the symbol, or no closed form
        applies (multiples, divisors, the model's limit)."""
        return self._forms[0]

    @property
    def boundary_numeric(self) -> sp.Expr | None:
        """:attr:`boundary` with the model's and the fixed numbers, in M and R."""
        return self._forms[1]

    @property
    def usable(self) -> int:
        return self.total - self.reserve

    def linear_terms(self):
        """``(c0, c1)`` with the binding candidate ``c0 + c1 * symbol`` when it is linear in
        the symbol (then ``boundary`` is ``floor((M - R - c0) / c1)``); else None."""
        try:
            poly = sp.Poly(sp.expand(self.binding.total), lookup(self.symbol))
        except sp.PolynomialError:
            return None
        if poly.degree() != 1:
            return None
        c1, c0 = (canonical(c) for c in poly.all_coeffs())
        return c0, c1

    def __str__(self) -> str:
        past = self.past_value
        lines = [f"{self.direction} {self.symbol} = {self.value:,}",
                 f"  peak at {self.symbol} = {self.value:,}: {self.at_value.peak:,} bytes "
                 f"({format_bytes(self.at_value.peak)}) <= usable {self.usable:,} "
                 f"({format_bytes(self.total)} - reserve {format_bytes(self.reserve)})"]
        if past is not None:
            step = self.step if self.step is not None else self.value + (1 if self.direction == "max" else -1)
            lines.append(f"  peak at {self.symbol} = {step:,}: {past.peak:,} bytes "
                         f"({format_bytes(past.peak)}) > usable")
        if self.limit:
            lines.append(f"  limited by the model: {self.limit}")
        else:
            lines.append(f"  binding: {self.binding.where}")
        if self.boundary is not None:
            lines.append(f"  boundary: {self.symbol} = {self.boundary}")
        # lines of at most 88 characters, broken at spaces (a formula at its + and - signs)
        return "\n".join(textwrap.fill(line, 88, subsequent_indent="      ", break_on_hyphens=False,
                                        break_long_words=False) for line in lines)

    def _repr_latex_(self) -> str:
        # "\max\, s" rather than s_{\max}, which is the name of the symbol s_max
        name = f"\\{self.direction}\\, {latex(lookup(self.symbol))}"
        if self.boundary is None:
            return f"${name} = {self.value}$"
        return f"${name} = {latex(self.boundary)} = {self.value}$"

    def _repr_html_(self) -> str:
        esc = html_escape
        x, at, past = self.symbol, self.at_value, self.past_value
        rows = [[f"peak at {esc(x)} = {self.value:,}",
                 f"{at.peak:,} bytes ({esc(format_bytes(at.peak))}) &le; usable {self.usable:,} "
                 f"({esc(format_bytes(self.total))} &minus; reserve {esc(format_bytes(self.reserve))})"]]
        if past is not None:
            step = self.step if self.step is not None else self.value + (1 if self.direction == "max" else -1)
            rows.append([f"peak at {esc(x)} = {step:,}",
                         f"{past.peak:,} bytes ({esc(format_bytes(past.peak))}) &gt; usable"])
        if self.limit:
            rows.append(["limited by the model", esc(self.limit)])
        else:
            rows.append(["binding", esc(self.binding.where)])
        for name, form in (("boundary", self.boundary), ("with the numbers", self.boundary_numeric)):
            if form is not None:
                rows.append([name, mathml(sp.Eq(lookup(x), form, evaluate=False), display=False)])
        if self.fixed:
            rows.append(["fixed", esc(values_text(self.fixed))])
        return (f"<div><p><b>{esc(self.direction)} {esc(x)} = {self.value:,}</b></p>"
                + html_table(None, rows) + "</div>")

    def _repr_pretty_(self, p, cycle) -> None:
        p.text(f"Solution({self.symbol} = {self.value})" if cycle else str(self))


class _Peak:
    """The peak as a function of one symbol, every other symbol bound: exact and fast. Each
    candidate is a polynomial in ``x`` with integer coefficients over one denominator
    (:meth:`symmem.engine.Estimate.compiled`), evaluated by Horner's rule with Python
    integers; a candidate that is not one (a ceiling) is kept as ``(None, expr)`` and
    evaluated by sympy."""

    def __init__(self, est: Estimate, x: sp.Symbol, subs: dict):
        self.x, self.polys, self.one = x, [], None
        if subs.get(b) == 1:            # b fixed at 1: the step derived for it
            est = est.at_one
        self.est, self.free, self.known = est, None, None
        free = {x} | {k for k, v in subs.items() if est.bindings.get(k) != v}
        known = {k: number(v) for k, v in subs.items()}
        given = set(known) | {x}
        compiled = est.compiled(free)
        if not given.issuperset(compiled.gens):
            names = sorted(str(v) for v in compiled.gens - given)
            raise ConfigError("values", names, f"a value for every symbol but {x}",
                              f"Pass them, e.g. {names[0]}=....")
        for f, coeffs in zip(compiled.totals, compiled.polynomials(x, known)):
            if coeffs is None:
                e = f.expr.xreplace({k: sp.sympify(v) for k, v in known.items()})
                self.polys.append((None, e))
                continue
            den = 1
            for c in coeffs:
                if type(c) is Fraction:
                    den = den * c.denominator // gcd(den, c.denominator)
            self.polys.append((coeffs[::-1] if den == 1 else [int(c * den) for c in reversed(coeffs)], den))
        if x == b and est.at_one is not est:      # b = 1: the step derived for it
            ones = est.at_one.compiled(free)
            at = {**known, b: 1}
            self.one = max(number(sum(c) if c is not None else f(at))
                           for f, c in zip(ones.totals, ones.polynomials(b, known)))
            self.free, self.known = free, known
        self.search = _frontier(self.polys)

    def _value(self, i: int, v: int):
        coeffs, den = self.polys[i]
        if coeffs is None:                  # den is the sympy expression
            return number(den.xreplace({self.x: v}))
        acc = 0
        for c in coeffs:
            acc = acc * v + c
        return acc if den == 1 else Fraction(acc, den)

    def __call__(self, v: int):
        if v == 1 and self.one is not None:
            return self.one
        return max(self._value(i, v) for i in self.search)

    def binding(self, v: int):
        """The candidate of the peak (a :class:`~symmem.counter.Point`) that is largest at ``v``:
        at b = 1, one of the step derived for it."""
        if v == 1 and self.one is not None:
            one = self.est.at_one
            totals = one.compiled(self.free).totals
            i = max(range(len(totals)), key=lambda i: number(totals[i]({**self.known, self.x: 1})))
            return one.points[i]
        return self.est.points[max(range(len(self.polys)), key=lambda i: self._value(i, v))]


def _frontier(polys: list) -> list:
    """The candidates the peak can be at some x >= 1 (every value the solver tries): where all
    are linear in x (a batch, the layers), candidate i is left out when another is at least
    as large at x = 1 and grows at least as fast, i.e. never smaller -- the Pareto front of
    (value at 1, slope), found by one sort. Otherwise all of them."""
    if any(c is None or len(c) > 2 for c, _ in polys):
        return list(range(len(polys)))
    common = 1                          # over one denominator: whole numbers compare fast
    for _, den in polys:
        common = common * den // gcd(common, den)
    points = []
    for i, (c, den) in enumerate(polys):
        slope, const = (c[0], c[1]) if len(c) == 2 else (0, c[0] if c else 0)
        scale = common // den
        points.append(((slope + const) * scale, slope * scale, i))
    points.sort(key=lambda p: (-p[0], -p[1], p[2]))
    keep, steepest = [], None
    for _, slope, i in points:
        if steepest is None or slope > steepest:
            keep.append(i)
            steepest = slope
    return sorted(keep)


def solve(est: Estimate, symbol: str, budget, *, reserve=None, direction: str = "max",
          **fixed) -> Solution:
    """The largest (``direction="max"``) or smallest (``"min"``) integer value of ``symbol``
    whose peak fits ``budget - reserve`` bytes, every other symbol fixed by ``fixed`` or by
    the model's bindings. ``budget``: a :class:`~symmem.gpus.Budget` or a size (bytes, or
    "80GiB", "80GB"). ``reserve`` follows symmem's one rule (:data:`~symmem.gpus.DEFAULT_RESERVE`):
    a size gets a 10% reserve unless ``reserve`` says otherwise (bytes, a size, a percentage,
    0 for none); a Budget keeps its own unless ``reserve`` replaces it.

    Only the values the model allows are answers: a multiple of ``a`` for ``h`` (the heads
    split the hidden size evenly), a divisor of ``h`` for ``a``, at most ``s_max`` for
    ``s``. A question without meaning is refused with :class:`ConfigError`: a byte price
    or the budget itself, a symbol the peak does not depend on, a direction in which memory
    does not move (the smallest ``b``: memory grows with ``b``). :class:`SearchLimit` says
    when the search, not the formula, stopped (a budget beyond what ``symbol`` <= 2^40
    reaches). Raises :class:`~symmem.errors.Infeasible` when no value fits."""
    if direction not in ("max", "min"):
        raise ConfigError("direction", direction, "'max' or 'min'")
    x = lookup(symbol)
    _askable(est, x)
    if symbol in fixed:
        raise ConfigError(symbol, fixed[symbol], "not fixed: it is the symbol solved for")
    bud = as_budget(budget, reserve)
    total, res = bud.total, bud.reserve
    usable = total - res
    est = est._region(fixed)        # s fixed at or past a sliding window: that region's formulas
    subs = est._subs(fixed)
    subs.pop(x, None)
    peak = _Peak(est, x, subs)
    dom = _Domain(est, x, subs)
    _moves(peak, dom, x, direction)
    if direction == "max":
        k = _search_max(peak, dom, usable, est, symbol, fixed)
        value = dom.value(k)
        if k == dom.last:               # the model's own limit, not memory, ends the search
            return Solution(symbol, direction, value, total, res, peak.binding(value), dict(fixed), limit=dom.why,
                            est=est)
        step = dom.value(k + 1) if dom.last is None or k < dom.last else None
    else:
        k = _search_min(peak, dom, usable, est, symbol, fixed)
        value = dom.value(k)
        step = dom.value(k - 1) if k > 1 else None
    past = step is not None and not _beyond(est, fixed, symbol, step)
    bind = peak.binding(step if past else value)
    # a closed form of the boundary where every integer is allowed (not multiples or divisors)
    closed = (x, subs) if dom.step == 1 and dom.divisors is None else None
    return Solution(symbol, direction, value, total, res, bind, dict(fixed), step=step, past=past, closed=closed,
                    est=est)


def _askable(est: Estimate, x) -> None:
    """Refuse a symbol no memory question can be asked of."""
    if x in BYTE_SYMBOLS:
        raise ConfigError("symbol", str(x), "a dimension (b, s, h, a, L, V, ...), not a byte price",
                          "Byte prices come from the precision (--precision, Policy(precision=...)).")
    if x in (M, R):
        raise ConfigError("symbol", str(x), "a dimension (b, s, h, a, L, V, ...), not the budget or the "
                          "reserve", "Those are given (--budget, --reserve); ask for what fits in them.")
    if x not in est.peak_symbols:
        used = sorted(str(v) for v in est.peak_symbols if v in DIMENSIONS)
        raise ConfigError("symbol", str(x), f"a symbol the peak of {est.graph.name} depends on: "
                          f"{', '.join(used)}", f"Memory does not change with {x} in this model.")


class _Domain:
    """The values the model allows for ``x``, numbered k = 1, 2, ...: every integer, the
    positive x with m | x + c (a ``divides`` requirement: the multiples of m for c = 0; a quanto
    cache's decoding steps n_g = P + 1 + R k' for ``R | n_g - 1 - P``), or the divisors of n / m
    (``m x | n``); ``last`` is the largest k within an ``at most`` requirement (``s <= s_max``)."""

    def __init__(self, est: Estimate, x, subs: dict):
        self.step, self.offset, self.divisors, self.last, self.why = 1, 0, None, None, None
        cap = None
        for lhs, rhs, reason, kind in est.requirements:
            lv, rv = sp.sympify(lhs).xreplace(subs), sp.sympify(rhs).xreplace(subs)
            if kind == "divides" and lv.is_Integer and (rv - x).is_Integer:
                m, c = int(lv), int(rv - x)          # x = offset + m k, the first of them in 1..m
                self.step, self.offset = m, (-c - 1) % m + 1 - m
            elif kind == "divides" and rv.is_Integer and x in lv.free_symbols and (lv / x).is_Integer:
                m, n = int(lv / x), int(rv)          # m x | n: x divides n / m
                self.divisors = [d for d in (self.divisors or range(1, n + 1)) if n % (m * d) == 0]
                self.why = (self.why + "; " if self.why else "") + f"{lhs} divides {rhs} = {n}: {reason}"
            elif kind == "at most" and lv == x and rv.is_Integer:
                cap = int(rv)
                self.why = f"{x} <= {rhs} = {cap}: {reason}"
        if self.divisors is not None:
            if cap is not None:
                self.divisors = [d for d in self.divisors if d <= cap]
            self.last = len(self.divisors)
        elif cap is not None:
            self.last = (cap - self.offset) // self.step

    def value(self, k: int) -> int:
        return self.divisors[k - 1] if self.divisors is not None else self.offset + self.step * k


def _probes(dom: _Domain) -> list[int]:
    """k = 1, 2, 4, ... up to the domain's last (or the search's limit): where a direction is
    judged. A few points, not the far end alone: FSDP's padded gathers make memory rise again
    with d once d passes a parameter's rows, after falling."""
    last = dom.last if dom.last is not None else LIMIT // dom.step
    ks = [1 << i for i in range(last.bit_length()) if 1 << i <= last]
    return ks + ([last] if ks[-1] != last else [])


def _moves(peak: "_Peak", dom: _Domain, x, direction: str) -> None:
    """Refuse a direction in which memory does not move: the largest value needs memory
    that grows with x somewhere, the smallest memory that falls somewhere."""
    first = dom.value(1)
    at_first = peak(first)
    others = [peak(dom.value(k)) for k in _probes(dom)[1:]]
    if direction == "min" and not any(v < at_first for v in others):
        raise ConfigError("direction", "min", f"'max': memory does not fall as {x} grows, so the smallest "
                          f"{x} that fits is {first} whenever any does", "Ask for the largest.")
    # (memory that falls first, as with d, rising again only past FSDP's padding: no largest)
    if direction == "max" and (not others or others[0] < at_first or not any(v > at_first for v in others)) \
            and dom.last is None:
        raise ConfigError("direction", "max", f"'min': memory does not grow with {x}, so every {x} fits "
                          "once one does: there is no largest", "Ask for the smallest.")


def _beyond(est, fixed, symbol, value) -> bool:
    try:
        est._subs({**fixed, symbol: value})
        return False
    except ConfigError:
        return True


def _search_max(peak: "_Peak", dom: _Domain, usable: int, est, symbol, fixed) -> int:
    """The largest k whose value fits (peak grows with k)."""
    def fits(k):
        return peak(dom.value(k)) <= usable
    if not fits(1):
        _infeasible(est, symbol, dom.value(1), usable, fixed, "a larger device or budget, a smaller "
                    "reserve, or less memory elsewhere (fix another symbol lower)")
    last = dom.last
    if last is not None and fits(last):
        return last
    lo, hi = 1, 2 if last is None else min(2, last)
    while fits(hi):                     # with a last k, that one does not fit: this ends
        lo, hi = hi, hi * 2 if last is None else min(hi * 2, last)
        if dom.value(hi) > LIMIT:
            v = dom.value(lo)
            raise SearchLimit(symbol, v, int(peak(v)), usable)
    while hi - lo > 1:                  # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _search_min(peak: "_Peak", dom: _Domain, usable: int, est, symbol, fixed) -> int:
    """The smallest k whose value fits where memory falls with k: the first of 1, 2, 4, ...
    that fits, then bisection down to the value before which the previous does not fit.
    Memory that rises again past some value (FSDP's padding, with d beyond a parameter's rows)
    never ends the search early; where none fits, the lowest peak probed is reported."""
    def fits(k):
        return peak(dom.value(k)) <= usable
    if fits(1):
        return 1
    probes = _probes(dom)
    for lo, hi in zip(probes, probes[1:]):
        if fits(hi):
            break
    else:
        best = min(probes, key=lambda k: peak(dom.value(k)))
        _infeasible(est, symbol, dom.value(best), usable, fixed,
                    f"the part of the peak that does not shrink with {symbol} is too large")
    while hi - lo > 1:                  # lo does not fit, hi fits
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def _infeasible(est, symbol, value, usable, fixed, hint):
    ev = est.at(**fixed, **{symbol: value})
    role = max(ev.peak_parts, key=ev.peak_parts.get)
    share = 100 * ev.peak_parts[role] / ev.peak
    hint += f"; the largest part of that peak is {role} ({share:.0f}%)"
    raise Infeasible(symbol, value, ev.peak, usable, ev.peak_point.where, ev.table(), hint)


def _boundary(point: Point, x, direction, value, subs, total, res):
    """``x`` where the binding candidate meets ``M - R``, as the floor (``"max"``) or the
    ceiling (``"min"``) of a closed form: linear or quadratic in x (after clearing a
    denominator); None when it is neither. Returns the formula and the same with the
    model's numbers (in M and R)."""
    num, den = sp.fraction(sp.together(sp.expand(point.total)))
    budget = (M - R) * den                       # candidate = M - R  <=>  num = (M - R)*den
    try:
        cs = [canonical(c) for c in sp.Poly(sp.expand(num - budget), x).all_coeffs()]
    except sp.PolynomialError:
        return None, None
    if len(cs) == 2:
        c1, c0 = cs
        forms = [lambda c1, c0: sp.Mul(-c0, sp.Pow(c1, -1, evaluate=False), evaluate=False)]
    elif len(cs) == 3:
        c2, c1, c0 = cs
        forms = [lambda c2, c1, c0, sign=sign: sp.Mul(-c1 + sign * sp.sqrt(c1**2 - 4 * c2 * c0),
                                                    sp.Pow(2 * c2, -1, evaluate=False), evaluate=False)
                 for sign in (1, -1)]
    else:
        return None, None
    rnd = sp.floor if direction == "max" else sp.ceiling
    numbers = [canonical(c.xreplace(subs)) for c in cs]
    for form in forms:
        r = form(*numbers).xreplace({M: total, R: res})
        if r.is_real and rnd(r) == value:
            return rnd(form(*cs)), rnd(form(*numbers))
    return None, None


def max_batch(est: Estimate, budget, *, reserve=None, **fixed) -> Solution:
    """The largest micro-batch ``b`` that fits (``s`` and anything unbound in ``fixed``)."""
    return solve(est, "b", budget, reserve=reserve, direction="max", **fixed)


def max_seq(est: Estimate, budget, *, reserve=None, **fixed) -> Solution:
    """The longest sequence ``s`` that fits (``b`` in ``fixed``), within the model's limits."""
    sol = solve(est, "s", budget, reserve=reserve, direction="max", **fixed)
    return sol


def frontier(est: Estimate, budget, over: str, values, *, solve_for: str = "b", reserve=None,
             **fixed) -> list[tuple[int, int | None]]:
    """The feasible region's edge: for each value of ``over`` (e.g. ``s``), the largest
    ``solve_for`` (e.g. ``b``) that fits, or None where nothing fits."""
    out = []
    for v in values:
        try:
            out.append((v, solve(est, solve_for, budget, reserve=reserve, **fixed, **{over: v}).value))
        except Infeasible:
            out.append((v, None))
    return out
