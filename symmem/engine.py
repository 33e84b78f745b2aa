"""``estimate(graph, policy) -> Estimate``: named components, the timeline and the peak.

The peak is ``Max`` over the timeline's points that cannot be proven dominated by
another under the symbols' assumptions (every dimension a positive integer, every
byte price positive): a point is dropped when another point minus it, written as
a polynomial in ``x - 1`` for each dimension ``x``, has no negative coefficient.
Formulas are kept canonical with ``expand`` and ``collect`` (never ``simplify``).
"""
from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from math import comb
from functools import cached_property

import sympy as sp

from .dtypes import format_bytes
from .errors import ConfigError
from .graph import Graph
from .policy import Policy
from .schedule import ROLES, Point, Walk, walk
from .symbols import DIMENSIONS, L, b, s, symbol

__all__ = ["estimate", "Estimate", "Evaluation", "canonical", "provably_nonneg"]

COMPONENTS = ("params", "grads", "master", "optimizer", "activations")


def canonical(expr) -> sp.Expr:
    """Expanded, then collected on L, b, s (in that order): the form symmem prints."""
    return sp.collect(sp.expand(expr), [L, b, s])


def provably_nonneg(expr) -> bool:
    """True when ``expr >= 0`` follows from the assumptions (dimensions >= 1, bytes > 0)."""
    e = sp.expand(expr)
    if e == 0:
        return True
    num, den = sp.fraction(sp.together(e))
    gens = sorted(num.free_symbols | den.free_symbols, key=str)
    cn, cd = _shifted_coeffs(num, gens), _shifted_coeffs(den, gens)
    return cn is not None and cd is not None and all(c >= 0 for c in cn.values()) \
        and all(c >= 0 for c in cd.values())


def _shifted_coeffs(e, gens) -> dict | None:
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


def _dominates(cj: dict, ci: dict) -> bool:
    """Does the polynomial with coefficients cj minus the one with ci have none negative?"""
    return all(cj.get(m, 0) - c >= 0 for m, c in ci.items()) and \
        all(c >= 0 for m, c in cj.items() if m not in ci)


def _prune(points: list[Point]) -> list[Point]:
    """Drop points that another point provably dominates (of equal ones, keep the first)."""
    totals = [sp.expand(p.total) for p in points]
    gens = sorted(set().union(*(t.free_symbols for t in totals)), key=str)
    coeffs = [_shifted_coeffs(t, gens) for t in totals]
    keep = []
    for i, ci in enumerate(coeffs):
        if ci is None:
            keep.append(i)
            continue
        dominated = False
        for j, cj in enumerate(coeffs):
            if j == i or cj is None or not _dominates(cj, ci):
                continue
            if j < i or not _dominates(ci, cj):   # strictly larger, or an earlier equal
                dominated = True
                break
        if not dominated:
            keep.append(i)
    return [points[i] for i in keep]


# ----- display helpers (Jupyter): HTML tables and MathML -----------------------------
def _esc(x) -> str:
    import html
    return html.escape(str(x))


def _mathml(expr) -> str:
    """``expr`` as inline presentation MathML, with symmem's printer (as the reports)."""
    from .render import mathml   # render imports this module
    return mathml(expr, display=False)


def _html_table(header, rows, right=()) -> str:
    """An HTML table; cells are already HTML (escape user strings first). Columns whose
    index is in ``right`` are right-aligned (numbers); no header row when ``header`` is empty."""
    def cell(tag, i, c):
        style = ' style="text-align:right"' if i in right else ' style="text-align:left"'
        return f"<{tag}{style}>{c}</{tag}>"
    head = "".join(cell("th", i, _esc(h)) for i, h in enumerate(header or ()))
    head = f"<thead><tr>{head}</tr></thead>" if head else ""
    body = "".join("<tr>" + "".join(cell("td", i, c) for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table>{head}<tbody>{body}</tbody></table>"


def _values_text(values: dict) -> str:
    return ", ".join(f"{k} = {v}" for k, v in values.items())


@dataclass(frozen=True)
class Evaluation:
    """Exact bytes at one configuration: components, the peak, and where it is."""
    values: dict
    bytes: dict            # component -> int (params, grads, master, optimizer, activations, peak)
    peak_point: Point
    peak_parts: dict       # role -> int at the peak

    @property
    def peak(self) -> int:
        return self.bytes["peak"]

    def table(self) -> str:
        rows = [f"{'component':<24}{'bytes':>20}{'':>14}{'% of peak':>11}"]
        for role in ROLES:
            v = self.peak_parts[role]
            if v:
                rows.append(f"{'at peak/' + role:<24}{v:>20,}{format_bytes(v):>14}{100 * v / self.peak:>10.1f}%")
        rows.append(f"{'peak':<24}{self.peak:>20,}{format_bytes(self.peak):>14}{100.0:>10.1f}%")
        rows.append(f"peak during {self.peak_point.where}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()

    def _repr_latex_(self) -> str:
        from .symbols import latex_names
        names = latex_names()
        at = ", ".join(f"{names.get(symbol(k) if isinstance(k, str) else k, k)} = {v}"
                       for k, v in self.values.items())
        num, unit = format_bytes(self.peak).split()
        exact = f"{self.peak:,}".replace(",", "{,}")
        return (f"$\\mathrm{{peak}}({at}) = {exact}\\ \\mathrm{{bytes}} "
                f"\\approx {num.replace(',', '{,}')}\\ \\mathrm{{{unit}}}$")

    def _repr_html_(self) -> str:
        rows = [[_esc(r), f"{v:,}", f"{v / 2**30:,.2f}", f"{100 * v / self.peak:.1f}%"]
                for r, v in self.peak_parts.items() if v]
        rows.append(["<b>peak</b>", f"<b>{self.peak:,}</b>", f"<b>{self.peak / 2**30:,.2f}</b>",
                     "<b>100.0%</b>"])
        return (f"<div><p><b>peak</b> at {_esc(_values_text(self.values))}: {self.peak:,} bytes "
                f"({_esc(format_bytes(self.peak))}), during {_esc(self.peak_point.where)}</p>"
                + _html_table(["role", "bytes", "GiB", "% of peak"], rows, right=(1, 2, 3)) + "</div>")

    def _repr_pretty_(self, p, cycle) -> None:
        p.text("Evaluation(...)" if cycle else self.table())


class Estimate:
    """The memory of one training step of ``graph`` under ``policy``, as formulas."""

    def __init__(self, graph: Graph, policy: Policy, w: Walk):
        # the graph walked: a repeated block whose first iteration differs is peeled
        self.graph, self.policy, self._walk = w.graph or graph, policy, w
        comps = dict(w.components)
        comps["activations"] = w.saved_at_end_of_forward
        self.components = {k: canonical(v) for k, v in comps.items()}
        self.points = _prune(w.points)
        self.bindings = {**{symbol(k) if isinstance(k, str) else k: sp.sympify(v)
                            for k, v in graph.bindings.items()}, **policy.bindings()}

    @cached_property
    def peak(self) -> sp.Expr:
        """The peak live bytes: Max over the non-dominated points, each canonical."""
        return sp.Max(*(canonical(p.total) for p in self.points), evaluate=False)

    @cached_property
    def totals(self) -> list[sp.Expr]:
        """Each kept point's live bytes, expanded (the arguments of ``peak``, uncollected)."""
        return [sp.expand(p.total) for p in self.points]

    @property
    def timeline(self) -> list[Point]:
        """Every point of the step, in order (before pruning)."""
        return list(self._walk.points)

    def formula(self, component: str = "peak") -> sp.Expr:
        if component == "peak":
            return self.peak
        if component not in self.components:
            raise ConfigError("component", component, f"one of peak, {', '.join(self.components)}")
        return self.components[component]

    def evaluator(self, *names: str, component: str = "peak"):
        """A vectorised function of the named symbols (every other symbol takes the model's
        and the policy's bindings): ``f(b=array, s=array) -> array`` of bytes.

        The peak is the elementwise maximum of the compiled candidates (``numpy``). Byte
        counts below 2**53 are exact in float64; integer inputs keep them integers."""
        import numpy as np
        syms = [symbol(n) for n in names]
        fixed = {k: v for k, v in self.bindings.items() if k not in syms}
        exprs = (self.totals if component == "peak"
                 else [self.formula(component)])
        fns = []
        for e in exprs:
            e = e.xreplace(fixed)
            extra = e.free_symbols - set(syms)
            if extra:
                missing = sorted(str(x) for x in extra)
                raise ConfigError("symbols", missing, "bound by the model or named as arguments",
                                  f"Add them: evaluator({', '.join(repr(n) for n in names + tuple(missing))}).")
            fns.append(sp.lambdify(syms, e, "numpy"))

        def f(**arrays):
            args = [np.asarray(arrays[n]) for n in names]
            return np.maximum.reduce([np.broadcast_to(fn(*args), np.broadcast(*args).shape)
                                      for fn in fns])
        return f

    def _subs(self, values: dict) -> dict:
        subs = dict(self.bindings)
        for k, v in values.items():
            sym = symbol(k) if isinstance(k, str) else k
            if not isinstance(v, (int, sp.Integer, sp.Rational)) or isinstance(v, bool) or v <= 0:
                raise ConfigError(str(sym), v, "a positive integer")
            subs[sym] = sp.Integer(v) if isinstance(v, int) else v
        self.check(subs)
        return subs

    def check(self, subs: dict) -> None:
        """Raise ConfigError when values break one of the model's requirements (s <= s_max)."""
        for lhs, rhs, reason in self.graph.requirements:
            lv, rv = lhs.xreplace(subs), rhs.xreplace(subs)
            if lv.is_number and rv.is_number and lv > rv:
                if lhs.is_number:
                    raise ConfigError(str(rhs), int(rv), f"at least {lhs}: {reason}")
                raise ConfigError(str(lhs), int(lv), f"at most {rhs} = {rv}: {reason}")

    def at(self, **values) -> Evaluation:
        """Exact integer bytes at ``values`` (e.g. ``b=8, s=1024``), over the model's bindings."""
        subs = self._subs(values)
        comps = {k: self._exact(v, subs, k) for k, v in self.components.items()}
        totals = [t.xreplace(subs) for t in self.totals]
        for t, p in zip(totals, self.points):
            if not t.is_number:
                missing = sorted(str(x) for x in t.free_symbols)
                raise ConfigError("values", missing, "a value for every symbol",
                                  f"Pass them, e.g. .at({missing[0]}=...).")
        i = max(range(len(totals)), key=lambda j: totals[j])
        p = self.points[i]
        comps["peak"] = int(sp.ceiling(totals[i]))
        parts = {r: self._exact(e, subs, r) for r, e in p.parts}
        return Evaluation(dict(values), comps, p, parts)

    @staticmethod
    def _exact(expr, subs, name) -> int:
        """Whole bytes; a fractional count (int4 packs two elements a byte) rounds up."""
        v = sp.sympify(expr).xreplace(subs)
        if not v.is_number:
            missing = sorted(str(x) for x in v.free_symbols)
            raise ConfigError("values", missing, f"a value for every symbol of {name}",
                              f"Pass them, e.g. .at({missing[0]}=...).")
        return int(sp.ceiling(v))

    def __repr__(self) -> str:
        return f"Estimate({self.graph.name}, {self.policy.describe()})\npeak = {self.peak}"

    def _repr_latex_(self) -> str:
        from .render import latex   # symmem's printer: grouped by L, b, s; parses back
        return "$" + latex(self.peak) + "$"

    def _repr_html_(self) -> str:
        rows = [[_esc(k), _mathml(v)] for k, v in self.components.items()]
        n = len(self.points)
        rows.append(["<b>peak</b>", f"the largest of {n} candidate{'s' * (n != 1)} (below)"])
        binds = ", ".join(f"{k} = {v}" for k, v in self.bindings.items())
        where = "".join(f"<li>{_esc(p.where)}</li>" for p in self.points)
        return (f"<div><p><b>{_esc(self.graph.name)}</b>: {_esc(self.policy.describe())}</p>"
                f"<p>bindings: {_esc(binds)}</p>"
                + _html_table(["component", "bytes"], rows)
                + f"<details><summary>peak: {n} candidate moment{'s' * (n != 1)} of the step "
                f"(phase, node)</summary><ol>{where}</ol></details></div>")

    def _repr_pretty_(self, p, cycle) -> None:
        if cycle:
            p.text(f"Estimate({self.graph.name})")
            return
        lines = [f"Estimate: {self.graph.name}", f"policy: {self.policy.describe()}"]
        lines += [f"  {k} = {v}" for k, v in self.components.items()]
        n = len(self.points)
        lines.append(f"  peak = Max of {n} candidate{'s' * (n != 1)} (.peak, .points)")
        p.text("\n".join(lines))


def estimate(graph: Graph, policy: Policy | None = None) -> Estimate:
    """Derive the symbolic memory of one training step of ``graph`` under ``policy``."""
    policy = policy or Policy()
    return Estimate(graph, policy, walk(graph, policy))
