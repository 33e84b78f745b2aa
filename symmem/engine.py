"""``estimate(graph, policy) -> Estimate``: named components, the timeline and the peak.

The peak is ``Max`` over the timeline's points that cannot be proven dominated by
another under the symbols' assumptions (every dimension a positive integer, every
byte price positive): a point is dropped when another point minus it, written as
a polynomial in ``x - 1`` for each dimension ``x``, has no negative coefficient.
Formulas are kept canonical with ``expand`` and ``collect`` (never ``simplify``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction
from functools import cached_property

import sympy as sp

from .errors import ConfigError
from .graph import Graph
from .policy import Policy
from .policy.attention import resolve
from .bounds import (_sorted, covers, merged_terms, monomials, product, provably_nonneg, prune, prune_terms, sort_key,
                     terms, terms_nonneg, terms_samples, total)
from .counter import Point, Timeline, count
from . import exact, passes
from .lowering import lower
from .plan import ROLES, Plan
from .printing import (format_bytes, html_escape, html_table, latex, mathml, tex_number,
                       tex_values, values_text)
from .symbols import TABLE, L, b, s, symbol

__all__ = ["estimate", "Estimate", "Evaluation", "Region", "CompiledEstimate", "canonical", "provably_nonneg"]

COMPONENTS = ("params", "buffers", "grads", "master", "optimizer", "activations")


def canonical(expr) -> sp.Expr:
    """Expanded, then collected on L, b, s (in that order): the form symmem prints. Each
    term goes under the power of the first of L, b, s it has, as ``sympy.collect(expr,
    [L, b, s])`` puts it (the same expression, built directly: collect costs ten times more)."""
    d = terms(expr)
    out = None if d is None else _collect(d)
    if out is None:
        # not yet a sum of products of symbols (expand it), or one holding an atom such as
        # ceiling((s + 1)/128) that expand rewrites inside; a sum of products of symbols and
        # of atoms already expanded (ceiling(s/128)) it leaves as it is
        expr = sp.expand(expr)
        d = terms(expr)
        if d is None:
            return _canonical(expr)
        out = _collect(d, check=False)
    return out


def _point_canonical(p: Point) -> sp.Expr:
    """``canonical(p.total)``, from the terms of the point's parts where they are products
    of symbols (no sum built first)."""
    d = p.terms
    out = None if d is None else _collect(d)
    return canonical(p.total) if out is None else out


_EXPANDED: dict = {}


def _expanded(key: frozenset) -> bool:
    """Are the bases of the product ``key`` symbols, or atoms (a ceiling, a Max) that expand
    leaves as they are? Then a sum of such products is already expanded (each atom asked
    once)."""
    for base, _ in key:
        if not base.is_Symbol:
            hit = _EXPANDED.get(base)
            if hit is None:
                hit = sp.expand(base) == base
                if len(_EXPANDED) < 1 << 16:
                    _EXPANDED[base] = hit
            if not hit:
                return False
    return True


def _collect(d: dict, check: bool = True) -> sp.Expr | None:
    """The canonical form of the sum of products of symbols :func:`~symmem.bounds.terms` ``d``;
    None, where ``check``, when an atom of it is not expanded (:func:`_expanded`)."""
    groups: dict = {}
    rest = []
    for key, c in d.items():
        power, term, expanded = _grouped(key, c)
        if check and not expanded:
            return None
        if power is None:
            rest.append(term)
        else:
            groups.setdefault(power, []).append(term)
    return total([_factored(power, terms) for power, terms in groups.items()] + rest)


_FACTORED: dict = {}


def _factored(power, terms: list) -> sp.Expr:
    """``power`` times the sum of ``terms`` (products of :func:`_grouped`, no two alike), as
    :func:`_collect` puts it, kept per (power, set of terms): the candidates of a step share
    most of their groups (an encoder's and a decoder's weights times ``L``), and a group
    built once is one object, so that sorting and hashing it again (``Basic.compare``'s keys,
    the cache's lookups) meets the same object instead of comparing equal trees."""
    key = (power, frozenset(terms))
    hit = _FACTORED.get(key)
    if hit is None:
        hit = _times(power, total(terms))
        if len(_FACTORED) < 1 << 16:
            _FACTORED[key] = hit
    return hit


_GROUPED: dict = {}


def _grouped(key: frozenset, c) -> tuple:
    """(``L**k``, the rest of the term, whether its atoms are expanded) for the first of L, b,
    s the term ``c * key`` holds, else (None, the term, ...): built once per term and kept, as
    the candidates of a step share most of theirs (and the same objects sort and hash at
    once)."""
    hit = _GROUPED.get((key, c))
    if hit is None:
        factors = dict(key)
        power = None
        for x in (L, b, s):
            k = factors.pop(x, 0)
            if k:
                power = x ** k
                break
        hit = (power, product(c, [base if ex == 1 else base ** ex for base, ex in factors.items()]), _expanded(key))
        if len(_GROUPED) < 1 << 16:
            _GROUPED[key, c] = hit
    return hit


def largest(args) -> sp.Expr:
    """``sympy.Max(*args, evaluate=False)``: its arguments by node count, as sympy's
    ``ordered`` puts them, each node count read once per shared subexpression (the candidates
    of a peak share most of their terms; ``ordered`` walks each whole tree); ties in
    ``Basic.compare``'s order (:func:`~symmem.bounds.sort_key`, one key per object), where
    ``ordered`` takes ``default_sort_key``, which evaluates every term's coefficient as a
    complex number (1 s of t5-small's 1.3 s)."""
    argset = frozenset(args)
    if len(argset) < 2:
        return sp.Max(*args, evaluate=False)
    groups: dict = {}
    for a in argset:
        groups.setdefault(_nodes(a), []).append(a)
    out = []
    for n in sorted(groups):
        group = groups[n]
        out.extend(sorted(group, key=sort_key) if len(group) > 1 else group)
    obj = sp.Expr.__new__(sp.Max, *out)
    obj._argset = argset
    return obj


_NODES: dict = {}


def _nodes(e) -> float:
    """sympy's ``_node_count``: 1 per node of the tree (0.5 per Float), kept per subexpression."""
    n = _NODES.get(e)
    if n is None:
        n = 0.5 if e.is_Float else 1 + sum(map(_nodes, e.args))
        if len(_NODES) < 1 << 16:
            _NODES[e] = n
    return n


def _times(power, inner) -> sp.Expr:
    """``sympy.Mul(power, inner)`` of a power of a symbol and a sum that does not hold it:
    the two in ``Mul``'s order without its flattening (and its cache of the call, which
    hashes the whole sum), or ``Mul`` itself where ``inner`` is not a sum."""
    if not inner.is_Add:
        return sp.Mul(power, inner)
    return sp.Mul._from_args(_sorted([power, inner]), True)


def _canonical(expr) -> sp.Expr:
    """:func:`canonical` of an expanded expression that is not a sum of products of powers."""
    groups: dict = {}
    rest = []
    for term in sp.Add.make_args(expr):
        powers = term.as_powers_dict()
        for x in (L, b, s):
            k = powers.get(x, 0)
            if k:
                groups.setdefault(x ** k, []).append(term / x ** k)
                break
        else:
            rest.append(term)
    return sp.Add(*(sp.Mul(key, sp.Add(*terms)) for key, terms in groups.items()), *rest)


def _prune(points: list[Point]) -> list[Point]:
    """Drop points that another point provably dominates (of equal ones, keep the first)."""
    keep = prune_terms([p.terms for p in points])
    if keep is None:
        keep = prune([p.total for p in points])
    return [points[i] for i in keep]


#: Bytes from which int64 arithmetic may have wrapped (or float64 rounded): points whose
#: float64 value reaches it are recomputed with exact integers.
EXACT_FROM = 2 ** 53


def _magnitude_bound(exprs, syms) -> list | None:
    """One compiled function bounding, at positive inputs, every intermediate value of every
    expression in ``exprs``: the polynomial whose coefficient of each monomial is the largest
    absolute coefficient any of them has (each product and partial sum int64 computes is at
    most it), a ceiling taken as its argument + 1, a floor as its argument and a Max or Min as
    the sum of its arguments. None when some expression is still not a polynomial in ``syms``:
    then the expressions themselves are evaluated in float64."""
    coeffs: dict = {}
    try:
        for e in exprs:
            e = e.replace(sp.ceiling, lambda x: x + 1).replace(sp.floor, lambda x: x)
            e = e.replace(sp.Max, lambda *xs: sp.Add(*xs)).replace(sp.Min, lambda *xs: sp.Add(*xs))
            for monom, c in sp.Poly(e, *syms).terms():
                coeffs[monom] = max(coeffs.get(monom, 0), abs(c))
    except (sp.PolynomialError, sp.GeneratorsNeeded):
        return None
    poly = sp.Add(*(c * sp.Mul(*(x ** n for x, n in zip(syms, monom))) for monom, c in coeffs.items()))
    return [sp.lambdify(syms, poly, "numpy")]


class _Monomials:
    """The candidates of a peak as one matrix: each a row of integer coefficients over the
    monomials they share (``1, b, s, b*s, a*b*s**2`` ...), so that evaluating all of them at N
    points is one float64 matrix product (BLAS) of the coefficients with the N values of each
    monomial, and the peak its column maximum. Exact where float64 holds every partial sum:
    below 2**53, checked per point with the sum of the largest absolute coefficients times the
    monomials (a bound of every partial sum); points at or past it are recomputed with Python
    integers, as :func:`_beyond_int64` does."""

    CHUNK = 4096    # points per product: the products stay in cache (and below OpenBLAS threading)

    def __init__(self, exps: list, coeffs):
        self.exps, self.coeffs = exps, coeffs
        import numpy as np
        self.bound = np.abs(coeffs).max(axis=0)

    @classmethod
    def of(cls, exprs, syms) -> "_Monomials | None":
        """None unless every expression is a polynomial in ``syms`` with integer coefficients
        (a ceiling, ``h/a`` or a half byte per element keep the per-candidate path)."""
        import numpy as np
        polys = [monomials(sp.expand(e), syms) for e in exprs]
        if any(p is None or any(c.denominator != 1 for c in p.values()) for p in polys):
            return None
        exps = sorted(set().union(*polys))
        coeffs = np.array([[float(p.get(m, 0)) for m in exps] for p in polys])
        if not np.all(np.abs(coeffs) < EXACT_FROM):
            return None
        return cls(exps, coeffs)

    def __call__(self, args, shape, exprs, syms):
        import numpy as np
        flat = [np.broadcast_to(x, shape).reshape(-1).astype(np.float64) for x in args]
        n = flat[0].size if flat else 1
        integer = all(np.issubdtype(x.dtype, np.integer) for x in args)
        out = np.empty(n, dtype=np.int64 if integer else np.float64)
        far = np.zeros(n, dtype=bool)
        for lo in range(0, n, self.CHUNK):
            hi = min(n, lo + self.CHUNK)
            mono = np.ones((len(self.exps), hi - lo))
            for row, exps in zip(mono, self.exps):
                for x, e in zip(flat, exps):
                    if e:
                        row *= x[lo:hi] ** e
            with np.errstate(invalid="ignore"):     # past int64: recomputed below
                out[lo:hi] = (self.coeffs @ mono).max(axis=0)
            if integer:
                far[lo:hi] = ~(self.bound @ mono < EXACT_FROM)
        out = out.reshape(shape)
        return _exactly_at(out, far.reshape(shape), exprs, syms, args) if integer and far.any() else out


def _grid_values(ds: list, at: dict, grid_b, grid_s):
    """The sums :func:`~symmem.bounds.terms` ``ds`` at every point of the (b, s) grid, the
    other symbols at ``at``, in float64: one matrix product of their coefficients with each
    distinct product's values (an atom such as ``ceiling(s/128)`` a numpy function of b and s)."""
    import numpy as np
    keys = {k: i for i, k in enumerate(dict.fromkeys(k for d in ds for k in d))}
    xb, xs = grid_b.reshape(-1).astype(np.float64), grid_s.reshape(-1).astype(np.float64)
    mono = np.ones((len(keys), xb.size))
    for key, i in keys.items():
        for base, ex in key:
            if base == b:
                v = xb
            elif base == s:
                v = xs
            elif base in at:
                v = float(at[base])
            else:
                v = _numeric(base.xreplace(at), xb, xs)
            mono[i] *= v ** ex
    coeffs = np.zeros((len(ds), len(keys)))
    for r, d in enumerate(ds):
        for key, c in d.items():
            coeffs[r, keys[key]] = float(c)
    return (coeffs @ mono).reshape((len(ds), *grid_b.shape))


_NUMPY = {"Add": "add", "Mul": "multiply", "Max": "maximum", "Min": "minimum"}


def _numeric(e, xb, xs):
    """``e`` (numbers, b, s, sums, products, integer powers, ceilings, floors, Max, Min) at
    the float64 points ``xb``, ``xs``: a ceiling of a tiled kernel's ``s/128`` without
    sympy's code printer (``lambdify`` where ``e`` holds anything else)."""
    import numpy as np
    if e == b:
        return xb
    if e == s:
        return xs
    if e.is_Number:
        return float(e)
    name = type(e).__name__
    if name in _NUMPY:
        return getattr(np, _NUMPY[name]).reduce([np.broadcast_to(_numeric(x, xb, xs), xb.shape) for x in e.args])
    if e.is_Pow and e.exp.is_Integer:
        return _numeric(e.base, xb, xs) ** int(e.exp)
    if isinstance(e, (sp.ceiling, sp.floor)):
        return (np.ceil if isinstance(e, sp.ceiling) else np.floor)(_numeric(e.args[0], xb, xs))
    return np.broadcast_to(sp.lambdify([b, s], e, "numpy")(xb, xs), xb.shape).astype(np.float64)


def _beyond_int64(out, fns, exprs, syms, args, shape):
    """``out`` (the int64 evaluation of ``exprs``) with each point whose bytes may not fit in 64
    bits recomputed exactly: ``fns`` evaluated in float64 (the expressions, or a bound of their
    intermediate values, :func:`_magnitude_bound`) find them (>= 2**53, where int64's
    products may have wrapped and float64 no longer holds every integer), and the exact
    maximum over ``exprs`` replaces them, as Python integers (the array becomes one of
    objects). Memory formulas stay far below 2**53 bytes (8 PiB) in practice."""
    import numpy as np
    floats = [x.astype(np.float64) for x in args]
    approx = np.maximum.reduce([np.broadcast_to(fn(*floats), shape) for fn in fns])
    far = ~(np.abs(approx) < EXACT_FROM)
    return _exactly_at(out, far, exprs, syms, args) if far.any() else out


def _exactly_at(out, far, exprs, syms, args):
    """``out`` as an array of Python ints, the points where ``far`` recomputed exactly: the
    largest of ``exprs`` there, rounded up."""
    import numpy as np
    out = np.array(out, dtype=object)
    values = [np.broadcast_to(x, far.shape) for x in args]
    for i in map(tuple, np.argwhere(far)):
        point = {x: sp.Integer(int(v[i])) for x, v in zip(syms, values)}
        out[i] = max(int(sp.ceiling(e.xreplace(point))) for e in exprs)
    return out


def _check_whole(names, arrays) -> None:
    """Every value a whole number >= 1 (integers, or floats such as 2.0), else the
    ConfigError that :meth:`Estimate.at` raises, for the first value that is not."""
    import numpy as np
    for name, x in zip(names, arrays):
        if np.issubdtype(x.dtype, np.integer):
            bad = np.flatnonzero(~(x >= 1))
        elif np.issubdtype(x.dtype, np.floating):
            bad = np.flatnonzero(~(np.isfinite(x) & (x == np.floor(x)) & (x >= 1)))
        else:                                   # strings, booleans, complex numbers, objects
            bad = [0]
        if len(bad):
            v = x.reshape(-1)[bad[0]]
            raise ConfigError(name, v.item() if hasattr(v, "item") else v, "a positive integer")


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
        """The peak by role (the roles holding bytes then), with a header over every column;
        the columns are as wide as their widest value, so huge counts never run together."""
        rows = [(role, self.peak_parts[role]) for role in ROLES if self.peak_parts[role]]
        rows.append(("peak", self.peak))
        wb = max(len("bytes"), *(len(f"{v:,}") for _, v in rows)) + 2
        ws = max(len("size"), *(len(format_bytes(v)) for _, v in rows)) + 2
        lines = [f"{'at the peak':<13}{'bytes':>{wb}}{'size':>{ws}}{'% of peak':>11}"]
        lines += [f"{role:<13}{v:>{wb},}{format_bytes(v):>{ws}}{100 * v / self.peak:>10.1f}%" for role, v in rows]
        lines.append(f"peak during {self.peak_point.where}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def _repr_latex_(self) -> str:
        num, unit = format_bytes(self.peak).split()
        return (f"$\\mathrm{{peak}}({tex_values(self.values)}) = {tex_number(self.peak)}\\ "
                f"\\mathrm{{bytes}} \\approx {num.replace(',', '{,}')}\\ \\mathrm{{{unit}}}$")

    def _repr_html_(self) -> str:
        esc = html_escape
        rows = [[esc(r), f"{v:,}", f"{v / 2**30:,.2f}", f"{100 * v / self.peak:.1f}%"]
                for r, v in self.peak_parts.items() if v]
        rows.append(["<b>peak</b>", f"<b>{self.peak:,}</b>", f"<b>{self.peak / 2**30:,.2f}</b>",
                     "<b>100.0%</b>"])
        return (f"<div><p><b>peak</b> at {esc(values_text(self.values))}: {self.peak:,} bytes "
                f"({esc(format_bytes(self.peak))}), during {esc(self.peak_point.where)}</p>"
                + html_table(["role", "bytes", "GiB", "% of peak"], rows, right=(1, 2, 3)) + "</div>")

    def _repr_pretty_(self, p, cycle) -> None:
        p.text("Evaluation(...)" if cycle else self.table())


@dataclass(frozen=True)
class Region:
    """Where one candidate of the peak binds on :meth:`Estimate.regions`' grid: its share of
    the grid's points and the ranges of b, s and b*s over them (``s`` None for a model whose
    formulas have no s: an image model's grid is b alone)."""
    point: Point
    share: float
    b: tuple            # (smallest, largest) b where it binds on the grid
    s: tuple | None
    bs: tuple           # (smallest, largest) b*s

    def __str__(self) -> str:
        if self.s is None:
            return (f"{self.point.where}: the peak at {100 * self.share:.0f}% of the grid, b from "
                    f"{self.b[0]:,} to {self.b[1]:,}")
        return (f"{self.point.where}: the peak at {100 * self.share:.0f}% of the grid, b*s from "
                f"{self.bs[0]:,} to {self.bs[1]:,} (b {self.b[0]:,}-{self.b[1]:,}, s {self.s[0]:,}-{self.s[1]:,})")


class Estimate:
    """The memory of one training step of ``graph`` under ``policy``, as formulas."""

    def __init__(self, graph: Graph, policy: Policy, plan: Plan, timeline: Timeline,
                 prepared: Graph | None = None):
        self.graph, self.policy, self.plan, self._timeline = graph, policy, plan, timeline
        #: the graph the plan was lowered from: the model's, after the passes' rewrites (the
        #: attention kernel's operators in place of each attention node)
        self.prepared = graph if prepared is None else prepared
        #: the attention kernels the step runs (``sdpa``'s choice per device made concrete)
        self.kernels = passes.attention.kernels(self.prepared)
        # the model states, the activations and, in inference, the KV cache
        self.components = {k: canonical(timeline.components[k])
                           for k in COMPONENTS + tuple(k for k in timeline.components if k not in COMPONENTS)}
        self.requirements = _distinct(timeline.requirements)
        self.points = _prune(list(timeline.points))
        self.bindings = {**{symbol(k) if isinstance(k, str) else k: sp.sympify(v)
                            for k, v in graph.bindings.items()}, **policy.bindings()}
        #: under pipeline parallelism, each stage's own estimate (rank 0 first); this one's
        #: points are all of theirs (its peak the most loaded rank's), its components the
        #: first stage's, and :meth:`at` evaluates the most loaded rank
        self.ranks: tuple = ()
        #: a stage's (key, shared memo): the stages derived alike share their step at b = 1
        self._alike: tuple = (None, {})

    def __getstate__(self) -> dict:
        """Pickled without :attr:`peak`: unpickling rebuilds ``Max(...)`` with evaluation,
        which compares every pair of candidates (minutes); it is rebuilt from :attr:`candidates`
        when asked."""
        state = dict(self.__dict__)
        for memo in ("peak", "_compiled", "_evaluators"):   # rebuilt when first asked
            state.pop(memo, None)
        return state

    def describe(self) -> str:
        """The policy in words, with the kernel ``sdpa`` picked for this model and device."""
        return self.policy.describe(self.kernels)

    @cached_property
    def at_one(self) -> "Estimate":
        """The step at b = 1, where a reshape or slice past the batch dimension is a view that
        copies at b >= 2 (eager attention's head matmuls keep all of qkv instead of copies of
        q, k and v; the shifted labels are a view of the padded ones): derived with
        ``Policy.batch_one``, or this estimate itself where nothing differs. :meth:`at`, the
        solvers and :meth:`cases` use it at b = 1."""
        if self.policy.batch_one or b not in set().union(*(t.free_symbols for t in self.totals)):
            return self
        policy = replace(self.policy, batch_one=True)
        if self.ranks:          # every stage's own
            one = _combined(self.graph, policy, [rank.at_one for rank in self.ranks])
        elif self.policy.parallel.pp > 1:      # a stage: derived once for the stages alike
            key, shared = self._alike
            if key not in shared:
                shared[key] = _derive(self.graph, policy)
            one = _stage(self.graph, policy, shared[key])
        else:
            one = estimate(self.graph, policy)
        at = {b: sp.Integer(1)}
        same = ({k: sp.expand(v.xreplace(at)) for k, v in one.components.items()}
                == {k: sp.expand(v.xreplace(at)) for k, v in self.components.items()}
                and {sp.expand(t.xreplace(at)) for t in one.totals} == {sp.expand(t.xreplace(at)) for t in self.totals})
        return self if same else one

    @cached_property
    def past_window(self) -> "Estimate":
        """The step from s = the model's sliding window on, where transformers passes SDPA
        the window's boolean mask (:func:`symmem.passes.attention.past_window`): derived
        when first asked, or this estimate itself where the window changes nothing the
        kernel keeps. :meth:`at` uses it for such s; each region's formulas carry their
        requirement on s."""
        graph = passes.attention.past_window(self.graph, self.policy)
        return self if graph is None else estimate(graph, self.policy)

    def _region(self, values: dict) -> "Estimate":
        """The estimate whose formulas hold at ``values``: :attr:`past_window` from s = the
        sliding window on, else this one."""
        window = passes.attention.window_of(self.graph)
        seq = values.get("s", values.get(s))
        if window is None or not isinstance(seq, (int, sp.Integer)) or seq < window:
            return self
        return self.past_window

    def cases(self, component: str = "peak") -> sp.Expr:
        """The formula with its case split: ``Piecewise((at b = 1, Eq(b, 1)), (the formula,
        True))`` where the step at b = 1 differs (:attr:`at_one`), else the formula."""
        general = self.formula(component)
        if self.at_one is self:
            return general
        one = self.at_one.formula(component).xreplace({b: sp.Integer(1)})
        if sp.expand(one - general.xreplace({b: sp.Integer(1)})) == 0:
            return general
        return sp.Piecewise((one, sp.Eq(b, 1)), (general, True))

    @cached_property
    def candidates(self) -> tuple[sp.Expr, ...]:
        """The non-dominated points' live bytes, each canonical, without repeats (in order):
        the arguments of :attr:`peak`."""
        return tuple(dict.fromkeys(_point_canonical(p) for p in self.points))

    @cached_property
    def peak(self) -> sp.Expr:
        """The peak live bytes: Max over the :attr:`candidates`."""
        return largest(self.candidates)

    @cached_property
    def totals(self) -> list[sp.Expr]:
        """Each kept point's live bytes, expanded (the arguments of ``peak``, uncollected): a
        point's total is built expanded from its parts' terms (:attr:`Point.total`), expanded
        again only where a part is not a sum of products."""
        return [p.total if t is not None else sp.expand(p.total) for p, t in zip(self.points, self._terms)]

    @cached_property
    def peak_symbols(self) -> frozenset:
        """The symbols the peak depends on (those of its candidates)."""
        return frozenset().union(*(t.free_symbols for t in self.totals))

    @cached_property
    def _terms(self) -> list:
        """Each kept point's total as :func:`~symmem.bounds.terms` (None where it is not a sum
        of products)."""
        return [p.terms for p in self.points]

    @property
    def timeline(self) -> list[Point]:
        """Every point of the step, in order (before pruning)."""
        return list(self._timeline.points)

    def phase_points(self) -> dict[str, list[Point]]:
        """Each phase's points that no other point of the phase dominates, phases and points
        in the timeline's order: each phase's largest moment is among them."""
        phases: dict = {}
        for p in self._timeline.points:
            phases.setdefault(p.phase, []).append(p)
        return {phase: _prune(points) for phase, points in phases.items()}

    def regions(self, b_max: int = 2**16, points: int = 65, **fixed) -> tuple["Region", ...]:
        """Which candidate of the peak binds where: the peak's candidates evaluated with the
        model's and the policy's numbers on a grid of ``points`` x ``points`` (b, s), each
        axis log-spaced from 1 to ``b_max`` and to ``s_max`` (``b_max`` where the model has
        no s_max). The candidates that are the largest somewhere on it, most points first;
        the others never bind there (:attr:`peak` keeps them all). ``fixed``: values of
        other unbound symbols (an encoder-decoder's ``s_d``). The grid is a sample, not
        a proof: between its points another candidate can lead by a few bytes. Kept per
        arguments: asked again, and from the cache on disk, they are not recomputed."""
        memo = self.__dict__.setdefault("_regions", {})
        key = (b_max, points, tuple(sorted(fixed.items())))
        if key not in memo:
            memo[key] = self._regions_on_grid(b_max, points, fixed)
        return memo[key]

    def _regions_on_grid(self, b_max: int, points: int, fixed: dict) -> tuple["Region", ...]:
        import numpy as np
        from .symbols import s_max
        top = int(self.bindings.get(s_max, b_max))
        at = {**self.bindings, **{symbol(k): sp.Integer(v) for k, v in fixed.items()}}
        by_terms = all(d is not None for d in self._terms)
        totals = None if by_terms else [t.xreplace(at) for t in self.totals]
        free = (set().union(*(base.free_symbols for d in self._terms for key in d for base, _ in key)) - set(at)
                if by_terms else set().union(*(t.free_symbols for t in totals)))
        axis = [np.unique(np.round(np.logspace(0, np.log2(n), points, base=2)).astype(np.int64)) for n in (b_max, top)]
        uses_s = s in free
        if not uses_s:        # an image model: b alone
            axis[1] = np.array([1], dtype=np.int64)
        grid_b, grid_s = np.meshgrid(*axis, indexing="ij")
        rest = sp.Add(*(free - {b, s}))
        if rest != 0:         # inference's n_g, an encoder-decoder's s_d: a value each, by keyword
            raise _unbound(rest, "the peak's candidates beside b and s (regions(..., n_g=...))")
        if by_terms:
            values = _grid_values(self._terms, at, grid_b, grid_s)
        else:
            f = [sp.lambdify([b, s], t, "numpy") for t in totals]
            values = np.array([np.broadcast_to(fn(grid_b, grid_s), grid_b.shape).astype(float) for fn in f])
        win = values.argmax(axis=0)
        out = []
        for i in np.unique(win):
            m = win == i
            bs = grid_b[m] * grid_s[m]
            out.append(Region(self.points[i], float(m.mean()), (int(grid_b[m].min()), int(grid_b[m].max())),
                              (int(grid_s[m].min()), int(grid_s[m].max())) if uses_s else None,
                              (int(bs.min()), int(bs.max()))))
        return tuple(sorted(out, key=lambda r: -r.share))

    def formula(self, component: str = "peak") -> sp.Expr:
        if component == "peak":
            return self.peak
        if component not in self.components:
            raise ConfigError("component", component, f"one of peak, {', '.join(self.components)}")
        return self.components[component]

    def evaluator(self, *names: str, component: str = "peak", check: bool = True):
        """A vectorised function of the named symbols (every other symbol takes the model's
        and the policy's bindings): ``f(b=array, s=array) -> array`` of bytes.

        The peak is the elementwise maximum of the candidates, those another dominates at
        every value >= 1 left out (:func:`symmem.bounds.prune`, with the bindings in). Where
        every candidate is a polynomial with integer coefficients (the usual case) they are
        one matrix over their shared monomials and a block of points costs one float64
        product (:class:`_Monomials`; 10^6 points of GPT-2's peak in about 40 ms), else each is
        a ``numpy`` function of its own. Integer inputs give exact integers: int64 below 2**53
        bytes, and beyond it each point recomputed with exact integers (an array of Python
        ints); float inputs give float64, exact below 2**53. The function is built once per
        (names, component, check) and kept.

        The values are checked as :meth:`at` checks them: whole numbers >= 1 (2.0 is one)
        and every requirement of the formulas (``s <= s_max``, ...); the first that fails
        raises :class:`ConfigError` with its value. ``check=False`` evaluates the formula
        anywhere, e.g. at fractional points for a finite difference."""
        memo = self.__dict__.setdefault("_evaluators", {})
        key = (names, component, check)
        if key not in memo:
            memo[key] = self._evaluator(names, component, check)
        return memo[key]

    def _evaluator(self, names: tuple, component: str, check: bool):
        import numpy as np
        syms = [symbol(n) for n in names]
        fixed = {k: v for k, v in self.bindings.items() if k not in syms}
        exprs = (self.totals if component == "peak"
                 else [self.formula(component)])
        exact = []
        for e in exprs:
            e = e.xreplace(fixed)
            extra = e.free_symbols - set(syms)
            if extra:
                missing = sorted(str(x) for x in extra)
                raise ConfigError("symbols", missing, "bound by the model or named as arguments",
                                  f"Add them: evaluator({', '.join(repr(n) for n in names + tuple(missing))}).")
            exact.append(e)
        if check and len(exact) > 1:    # values >= 1: a candidate another dominates never binds
            exact = [exact[i] for i in prune(exact)]
        matrix = _Monomials.of(exact, syms)
        fns = [] if matrix is not None else [sp.lambdify(syms, e, "numpy") for e in exact]

        checks = self._vector_checks(syms, fixed) if check else []
        bound = _magnitude_bound(exact, syms) if matrix is None else None

        def f(**arrays):
            args = [np.asarray(arrays[n]) for n in names]
            shape = np.broadcast(*args).shape
            if check:
                _check_whole(names, args)
            for req, ok in checks:
                good = np.broadcast_to(ok(*args), shape)
                if not np.all(good):        # the first failing point, as at() words it
                    i = np.unravel_index(int(np.flatnonzero(~good.reshape(-1))[0]), shape)
                    raise req.broken({**fixed, **{x: sp.Integer(int(np.broadcast_to(v, shape)[i]))
                                                  for x, v in zip(syms, args)}})
            if matrix is not None:
                out = matrix(args, shape, exact, syms)
            else:
                out = np.maximum.reduce([np.broadcast_to(fn(*args), shape) for fn in fns])
                if all(np.issubdtype(x.dtype, np.integer) for x in args):
                    out = _beyond_int64(out, bound or fns, exact, syms, args, shape)
            if "b" in names:             # b = 1: the step derived for it (derived when first asked)
                ones = np.broadcast_to(args[names.index("b")], shape) == 1
                if ones.any() and self.at_one is not self:
                    if not one:
                        one.append(self.at_one.evaluator(*names, component=component, check=False))
                    out = np.array(out)
                    out[ones] = one[0](**{n: np.broadcast_to(v, shape)[ones] for n, v in zip(names, args)})
            return out
        one: list = []
        return f

    def _vector_checks(self, syms, fixed) -> list:
        """(requirement, numpy test) for each requirement that the named symbols decide."""
        out = []
        for req in self.requirements:
            lhs, rhs = (sp.sympify(side).xreplace(fixed) for side in (req.lhs, req.rhs))
            free = lhs.free_symbols | rhs.free_symbols
            if free and free <= set(syms):
                test = sp.Eq(sp.Mod(rhs, lhs), 0) if req.kind == "divides" else sp.Le(lhs, rhs)
                out.append((req, sp.lambdify(syms, test, "numpy")))
        return out

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
        """Raise ConfigError when values break a requirement of the formulas (``s <= s_max``;
        ``L >= 2`` for a block whose first iteration differs)."""
        for req in self.requirements:
            err = req.broken(subs)
            if err is not None:
                raise err

    def at(self, **values) -> Evaluation:
        """Exact integer bytes at ``values`` (e.g. ``b=8, s=1024``), over the model's bindings
        (at b = 1, the step derived for it: :attr:`at_one`)."""
        if self.ranks:
            evs = [rank.at(**values) for rank in self.ranks]
            return max(evs, key=lambda ev: ev.peak)          # the first of the most loaded
        if self._region(values) is not self:
            return self._region(values).at(**values)
        subs = self._subs(values)
        if subs.get(b) == 1 and self.at_one is not self:
            return self.at_one.at(**values)
        known = {k: exact.number(v) for k, v in subs.items()}
        compiled = self.compiled(free={symbol(k) if isinstance(k, str) else k for k in values})
        comps = {k: self._exact(f, known, k) for k, f in compiled.components.items()}
        totals = [_value(f, known, "the peak") for f in compiled.totals]
        i = max(range(len(totals)), key=lambda j: totals[j])
        p = self.points[i]
        comps["peak"] = _ceil(totals[i])
        parts = {r: self._exact(f, known, r) for r, f in compiled.parts(i)}
        return Evaluation(dict(values), comps, p, parts)

    def compiled(self, free=()) -> "CompiledEstimate":
        """The components and the candidates of the peak read into integer terms
        (:mod:`symmem.exact`), with the model's and the policy's numbers bound but for the
        symbols in ``free`` (a value given for a bound symbol, or the symbol solved for):
        :meth:`at` and the solver evaluate them without sympy. Kept per ``free``; each part is
        read when first asked."""
        memo = self.__dict__.setdefault("_compiled", {})
        key = frozenset(free) & frozenset(self.bindings)
        if key not in memo:
            memo[key] = CompiledEstimate(self, {k: v for k, v in self.bindings.items() if k not in key})
        return memo[key]

    @staticmethod
    def _exact(f: "exact.Compiled", known: dict, name) -> int:
        """Whole bytes; a fractional count (int4 packs two elements a byte) rounds up."""
        return _ceil(_value(f, known, name))

    def __repr__(self) -> str:
        return f"Estimate({self.graph.name}, {self.describe()})\npeak = {self.peak}"

    def _repr_latex_(self) -> str:
        # symmem's printer: grouped by L, b, s; parses back
        return "$" + latex(self.peak) + "$"

    def _repr_html_(self) -> str:
        esc = html_escape
        rows = [[esc(k), mathml(v, display=False)] for k, v in self.components.items()]
        n = len(self.points)
        rows.append(["<b>peak</b>", f"the largest of {n} candidate{'s' * (n != 1)} (below)"])
        where = "".join(f"<li>{esc(p.where)}</li>" for p in self.points)
        return (f"<div><p><b>{esc(self.graph.name)}</b>: {esc(self.describe())}</p>"
                f"<p>bindings: {esc(values_text(self.bindings))}</p>"
                + html_table(["component", "bytes"], rows)
                + f"<details><summary>peak: {n} candidate moment{'s' * (n != 1)} of the step "
                f"(phase, node)</summary><ol>{where}</ol></details></div>")

    def _repr_pretty_(self, p, cycle) -> None:
        if cycle:
            p.text(f"Estimate({self.graph.name})")
            return
        lines = [f"Estimate: {self.graph.name}", f"policy: {self.describe()}"]
        lines += [f"  {k} = {v}" for k, v in self.components.items()]
        n = len(self.points)
        lines.append(f"  peak = Max of {n} candidate{'s' * (n != 1)} (.peak, .points)")
        p.text("\n".join(lines))


def estimate(graph: Graph, policy: Policy | None = None) -> Estimate:
    """Derive the symbolic memory of one training step of ``graph`` (a Graph, or a preset's
    name such as ``"gpt2"``) under ``policy``: lower it to a plan, let the policy's passes
    rewrite the plan, count it."""
    if isinstance(graph, str):           # a preset's name or Hugging Face id: what a newcomer types
        from .models import preset
        graph = preset(graph)
    if not isinstance(graph, Graph):
        raise ConfigError("graph", type(graph).__name__, "a Graph, or a preset's name",
                          "Build one with sm.models.preset('gpt2') or sm.models.from_hf_config(path).")
    policy = Policy() if policy is None else policy
    if not isinstance(policy, Policy):
        raise ConfigError("policy", policy, "a Policy", "E.g. sm.Policy(precision='bf16-mixed', optimizer='adamw').")
    # the model's own attention kernel, else transformers' default: outputs name the one used
    policy = replace(policy, attention=resolve(policy.attention, graph.attention))
    if policy.mode == "inference":
        return _inference(graph, policy)
    if policy.parallel.pp > 1:
        return _pipeline(graph, policy)
    plan, timeline, prepared = _derive(graph, policy)
    return Estimate(graph, policy, plan, timeline, prepared)


def _derive(graph: Graph, policy: Policy):
    """(plan, timeline, prepared graph) of ``graph`` under ``policy``."""
    prepared = passes.prepare(graph, policy)
    plan = passes.run(lower(prepared, policy), prepared, policy)
    timeline = count(plan)
    own = {symbol(k) if isinstance(k, str) else k: sp.sympify(v) for k, v in graph.bindings.items()}
    extra = [r for r in timeline.requirements if r not in prepared.requirements]
    if any(r.broken(own) for r in extra):
        # The model's own layer count is below what the formulas in L hold for (a block whose
        # first or last iteration differs, with one iteration): derive it with the counts bound.
        prepared = prepared.with_bound_counts()
        plan = passes.run(lower(prepared, policy), prepared, policy)
        timeline = count(plan)
    return plan, timeline, prepared


def _inference(graph: Graph, policy: Policy) -> Estimate:
    """Generation's memory (:mod:`symmem.passes.inference`): the prefill's points and the
    decoding step's, each phase named after its step; the components are the model's
    (nothing trained) and the KV cache after the decoding step (s + n_g positions)."""
    points, requirements, steps = [], [], []
    for step in passes.inference.STEPS:
        plan, timeline, prepared = _derive(graph, replace(policy, step=step))
        points += [replace(p, phase=step) for p in timeline.points]
        requirements += list(timeline.requirements)
        steps.append((plan, timeline, prepared))
    (plan, first, prepared), (decode, _, decode_graph) = steps
    components = {**first.components, "activations": sp.Integer(0),
                  "cache": passes.inference.cache_bytes(decode, decode_graph)}
    return Estimate(graph, policy, plan, Timeline(tuple(points), components, tuple(requirements)), prepared)


def _pipeline(graph: Graph, policy: Policy) -> Estimate:
    """Every pipeline stage's step (:mod:`symmem.passes.pipeline`), each an estimate of its
    own, and one over them all: its points every stage's, named by stage, so that its peak
    is the most loaded rank's; its components the first stage's. Stages that hold the same
    (a middle one's layers, the same micro-batches in flight) are derived once."""
    par, ranks, memo, alike = policy.parallel, [], {}, {}
    for r in range(par.pp):
        key = (r == 0, r == par.pp - 1,
               passes.pipeline.in_flight(par.schedule, par.pp, par.virtual_stages, par.microbatches, r))
        if key not in memo:
            memo[key] = _derive(graph, replace(policy, stage=r))
        ranks.append(_stage(graph, replace(policy, stage=r), memo[key]))
        ranks[-1]._alike = (key, alike)
    return _combined(graph, policy, ranks)


def _combined(graph: Graph, policy: Policy, ranks: list) -> Estimate:
    """The estimate over the stages ``ranks``: their points (:func:`_across_stages`), the
    first stage's components."""
    first = ranks[0]
    requirements = tuple(r for rank in ranks for r in rank._timeline.requirements)
    est = Estimate(graph, policy, first.plan, Timeline(tuple(_across_stages(ranks)), first._timeline.components,
                                                       requirements), first.prepared)
    est.ranks = tuple(ranks)
    return est


def _across_stages(ranks) -> list:
    """Every stage's points but those the same moment of another stage provably exceeds (of
    equal ones, the first stage's): a middle stage runs the first's layers with fewer
    micro-batches in flight and no embedding."""
    def key(p):
        return p.phase, p.node, p.iteration, p.micro
    every = [p for rank in ranks for p in rank.points]
    sums = {id(p): p.terms for p in every}
    if any(t is None for t in sums.values()):
        return every
    values = dict(zip(map(id, every), terms_samples([sums[id(p)] for p in every])))
    same: dict = {}
    for rank in ranks:
        for p in rank.points:
            same.setdefault(key(p), []).append(p)

    def exceeds(q, p) -> bool:
        if not covers(values[id(q)], values[id(p)]):
            return False          # smaller somewhere: not provably larger
        tq, tp = sums[id(q)], sums[id(p)]
        diff = dict(tq)
        for k, v in tp.items():
            diff[k] = diff.get(k, 0) - v
        return terms_nonneg({k: v for k, v in diff.items() if v != 0})

    out = []
    for r, rank in enumerate(ranks):
        for p in rank.points:
            others = [q for q in same[key(p)] if q.rank != p.rank]
            if not any(exceeds(q, p) and (int(q.rank) < r or not exceeds(p, q)) for q in others):
                out.append(p)
    return out


def _stage(graph: Graph, policy: Policy, derived) -> Estimate:
    """The estimate of the pipeline stage ``policy.stage`` from its (plan, timeline, prepared
    graph), its points named by the stage."""
    plan, timeline, prepared = derived
    timeline = replace(timeline, points=tuple(replace(p, rank=str(policy.stage)) for p in timeline.points))
    return Estimate(graph, policy, plan, timeline, prepared)


class CompiledEstimate:
    """:meth:`Estimate.compiled`: an estimate's formulas with ``bindings`` in, as
    :class:`symmem.exact.Compiled` functions, each group read when first asked."""

    def __init__(self, est: Estimate, bindings: dict):
        self.est, self.bindings, self._parts = est, bindings, {}

    @cached_property
    def components(self) -> dict:
        return {k: exact.compile(v, self.bindings) for k, v in self.est.components.items()}

    @cached_property
    def totals(self) -> list:
        """The candidates of the peak, in the order of :attr:`Estimate.points`."""
        out = []
        for i, p in enumerate(self.est.points):
            d = p.terms
            out.append(exact.compile(self.est.totals[i], self.bindings) if d is None
                       else exact.compile_terms(d, self.bindings))
        return out

    def polynomials(self, x, known: dict) -> list:
        """Each candidate as a polynomial in ``x`` with every other symbol at ``known``: its
        coefficients, lowest degree first (ints or Fractions), or None where it is not one
        (:meth:`symmem.exact.Compiled.polynomial`, the same numbers). The candidates share
        most of their products of the other symbols: each is evaluated once per call."""
        plan = self._plans.get(x)
        if plan is None:
            monos: dict = {}
            terms = []
            for f in self.totals:
                p = f._in(x)
                terms.append(None if p is None else tuple(
                    (deg, c, monos.setdefault(tuple((f.gens[j], e) for j, e in others), len(monos)))
                    for deg, c, others in p))
            plan = self._plans[x] = (tuple(monos), terms)
        monos, terms = plan
        values = []
        for mono in monos:
            num, den = 1, 1
            for g, e in mono:
                if e > 0:
                    num *= known[g] ** e
                else:
                    den *= known[g] ** -e
            values.append(num if den == 1 else Fraction(num, den))
        out = []
        for p in terms:
            if p is None:
                out.append(None)
                continue
            coeffs: dict = {}
            for deg, c, m in p:
                coeffs[deg] = coeffs.get(deg, 0) + c * values[m]
            top = max(coeffs, default=0)
            out.append([coeffs.get(k, 0) for k in range(top + 1)])
        return out

    @cached_property
    def _plans(self) -> dict:
        return {}

    @cached_property
    def gens(self) -> frozenset:
        """The symbols left free in the candidates."""
        return frozenset().union(*(f.gens for f in self.totals))

    def parts(self, i: int) -> list:
        """The roles' bytes of candidate ``i``: [(role, function), ...]."""
        if i not in self._parts:
            self._parts[i] = [(r, exact.compile(e, self.bindings)) for r, e in self.est.points[i].parts]
        return self._parts[i]


def _value(f: "exact.Compiled", known: dict, what: str):
    """``f`` at ``known``: a ConfigError naming the symbols that have no value."""
    if not all(g in known for g in f.gens):
        raise _unbound(f.expr.xreplace({k: sp.sympify(v) for k, v in known.items()}), what)
    v = f(known)
    if isinstance(v, sp.Basic) and not v.is_number:
        raise _unbound(v, what)
    return v


def _ceil(v) -> int:
    """The whole bytes of an exact count (an int, a Fraction or a sympy number), rounded up."""
    return -(-v // 1) if isinstance(v, (int, Fraction)) else int(sp.ceiling(v))


def _unbound(expr, what: str) -> ConfigError:
    """The error for symbols of ``expr`` that have no value, each named with its meaning."""
    missing = sorted(str(x) for x in expr.free_symbols)
    meanings = "; ".join(f"{m}: {TABLE[m].meaning}" if m in TABLE else m for m in missing)
    fix = f"Pass them, e.g. .at({missing[0]}=...)."
    if "r" in missing:
        fix += " The LoRA rank stays a symbol under lora='r' (--lora r, for `symmem formula`); give a number " \
               "(lora=8, --lora 8) to evaluate."
    if "d" in missing:
        fix += " The data-parallel degree stays a symbol under dp='d' (--dp d); give a number (dp=8, --dp 8) " \
               "to evaluate, or solve for it (symmem solve --for d --min)."
    return ConfigError("values", missing, f"a value for every symbol of {what} ({meanings})", fix)


def _distinct(requirements) -> tuple:
    """Requirements without repeats; of two lower bounds on the same symbol, the larger."""
    out = {}
    for r in requirements:
        key = (r.rhs, r.kind) if r.lhs.is_number and r.kind == "at most" else r
        if key not in out or (r.lhs.is_number and r.lhs > out[key].lhs):
            out[key] = r
    return tuple(out.values())
