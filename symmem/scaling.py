"""How memory grows: degrees, leading terms, elasticities, regimes and sweeps.

Every function reads an :class:`~symmem.engine.Estimate` (or one of its formulas) and
answers one question about growth:

- ``leading_term(M, x)`` and ``order(M, x)``: ``M ~ c * x**d`` as ``x -> oo``;
- ``elasticity(M, x, at)``: ``d ln M / d ln x``, the percent change of ``M`` per percent
  change of ``x`` at one configuration;
- ``dominant`` and ``regimes``: which role holds the most bytes at the peak, and where
  that changes as ``x`` grows (model states at small ``b``, activations at large ``b``);
- ``parameter_count`` and ``bytes_per_parameter``: ``N`` and ``M / N`` (16 for mixed
  precision Adam as ``h -> oo``, the ZeRO figure);
- ``sweep``: the compiled peak and components over a grid.

Formulas are expanded and collected, never ``simplify``-ed; with integer values every
number is exact. A kernel's padding (``32*ceiling(s/32)`` rows of the mem-efficient
attention's log-sum-exp) is read as its argument for degrees, leading terms and
elasticities: it differs from ``s`` by less than 32, so it grows as ``s`` does.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import sympy as sp

from .engine import Estimate, _prune, canonical
from .errors import ConfigError, UnknownName
from .graph import Graph
from .counter import Point
from .symbols import DIMENSIONS, symbol

__all__ = ["leading_term", "order", "orders", "elasticity", "dominant", "regimes", "Regime",
           "parameter_count", "bytes_per_parameter", "sweep", "MODEL_STATES", "GIB"]

#: The roles that make up the model states (ZeRO's term, with the buffers): what exists whatever the batch.
MODEL_STATES = ("params", "buffers", "master", "optimizer", "grads")
#: Bytes in a GiB.
GIB = 2**30


# --------------------------------------------------------------------------- helpers

def _sym(x) -> sp.Symbol:
    """A symbol from its name (``"b"``) or itself; unknown names raise UnknownName."""
    if isinstance(x, sp.Symbol):
        return x
    if isinstance(x, str):
        return symbol(x)
    raise ConfigError("symbol", x, "a symbol name such as 'b' or a symbol from symmem.symbols")


def _expr(obj) -> sp.Expr:
    """An Estimate stands for its peak; anything else is sympified."""
    if isinstance(obj, Estimate):
        return obj.peak
    return sp.sympify(obj)


def _candidates(expr) -> tuple:
    """The arguments of a ``Max``; an expression that is not a Max is its own candidate."""
    return tuple(expr.args) if isinstance(expr, sp.Max) else (expr,)


def _number(name: str, v, allow_float: bool):
    """A positive value as a sympy number (Integer / Rational, or Float if allowed)."""
    ok = (int, sp.Integer, sp.Rational) + ((float, sp.Float) if allow_float else ())
    if isinstance(v, bool) or not isinstance(v, ok) or not v > 0:
        raise ConfigError(name, v, "a positive number" if allow_float else "a positive integer")
    return sp.Integer(v) if isinstance(v, int) else sp.sympify(v)


def _point(est: Estimate | None, at: dict | None, allow_float: bool = True) -> dict:
    """Symbol -> value: the estimate's bindings overridden by ``at``; the model's
    requirements (``s <= s_max``) are checked as ``Estimate.at`` checks them."""
    subs = dict(est.bindings) if est is not None else {}
    for k, v in (at or {}).items():
        sym = _sym(k)
        subs[sym] = _number(sym.name, v, allow_float)
    if est is not None:
        est.check(subs)
    return subs


def _value(expr, subs: dict, what: str):
    v = sp.sympify(expr).xreplace(subs)
    if not v.is_number:
        missing = sorted(str(x) for x in v.free_symbols)
        raise ConfigError("at", missing, f"a value for every symbol of {what}",
                          f"Pass them, e.g. at={{'{missing[0]}': ...}}.")
    return v


def _names(at: dict | None) -> dict:
    """``at`` keyed by symbol names, as ``Estimate.at`` takes them."""
    return {(_sym(k).name): v for k, v in (at or {}).items()}


# --------------------------------------------------------------------------- degrees

def _poly_leading(e: sp.Expr, x: sp.Symbol) -> tuple[int, sp.Expr]:
    """(degree, leading coefficient) of a polynomial in ``x`` with symbolic coefficients."""
    if e == 0:
        return 0, sp.Integer(0)
    p = sp.Poly(e, x)
    return p.degree(), p.LC()


def _smooth(e: sp.Expr) -> sp.Expr:
    """``e`` with every ``ceiling(u)`` read as ``u`` (a padding: the same growth)."""
    return e.replace(sp.ceiling, lambda u: u) if e.has(sp.ceiling) else e


def _leading(expr, x: sp.Symbol) -> tuple[int, sp.Expr]:
    """(degree d, coefficient c) with ``expr ~ c * x**d`` as ``x -> oo``, for one
    candidate: a polynomial in x, or a ratio of two (degree of the numerator minus that of
    the denominator; coefficient the ratio of their leading coefficients)."""
    e = sp.expand(_smooth(sp.sympify(expr)))
    if x not in e.free_symbols:
        return 0, e
    if e.is_polynomial(x):
        return _poly_leading(e, x)
    num, den = sp.fraction(sp.cancel(sp.together(e)))
    if not (num.is_polynomial(x) and den.is_polynomial(x)):
        raise ConfigError("expression", expr, f"a polynomial in {x} or a ratio of two")
    (dn, cn), (dd, cd) = _poly_leading(sp.expand(num), x), _poly_leading(sp.expand(den), x)
    return dn - dd, sp.cancel(cn / cd)


def _tidy(c: sp.Expr) -> sp.Expr:
    return canonical(c) if c.is_polynomial() else c


def leading_term(expr, x) -> sp.Expr:
    """The term of highest degree in ``x``: ``c * x**d`` where ``expr = c * x**d + O(x**(d-1))``
    with ``c`` free of ``x`` (a polynomial in the other symbols, collected on L, b, s).

    For a ``Max`` of candidates (``est.peak``; an Estimate stands for its peak), the
    candidates of highest degree ``d`` decide the growth: the result is ``Max`` of their
    leading terms, without duplicates and without those provably below another (every
    dimension >= 1, every byte price > 0), or the single term when one remains. A ratio of
    polynomials gives the ratio of their leading terms (``x**(dn - dd)``)."""
    x = _sym(x)
    terms = [_leading(c, x) for c in _candidates(_expr(expr))]
    d = max(deg for deg, _ in terms)
    out = []
    for deg, c in terms:
        t = _tidy(c) * x**d if deg == d else None
        if t is not None and t not in out:
            out.append(t)
    if len(out) > 1:
        kept = _prune([Point("", "", (("activations", t),)) for t in out])
        out = [p.parts[0][1] for p in kept]
    return out[0] if len(out) == 1 else sp.Max(*out, evaluate=False)


def order(expr, x) -> int:
    """The degree ``d`` of ``expr`` in ``x`` (``expr = O(x**d)``); for a ``Max`` the largest
    degree of its candidates; an expression free of ``x`` (0 included) has order 0."""
    x = _sym(x)
    return max(_leading(c, x)[0] for c in _candidates(_expr(expr)))


def orders(expr) -> dict:
    """``{x: order(expr, x)}`` for every dimension symbol (b, s, h, a, L, V, f, k, s_max,
    in that order) that appears in ``expr``."""
    e = _expr(expr)
    free = e.free_symbols
    return {x: order(e, x) for x in DIMENSIONS if x in free}


# --------------------------------------------------------------------------- elasticity

def elasticity(obj, x, at: dict | None = None, *, component: str = "peak"):
    """``E = d ln M / d ln x = x * (dM/dx) / M`` at one point: M grows by about E percent when
    x grows by one percent (E = d for ``M = c * x**d``; ``b * P + Q`` with P, Q free of b gives
    ``b*P / (b*P + Q)``, which tends to 1).

    ``obj`` is an Estimate (its ``component``, the peak by default; the point is the model's
    and the policy's bindings overridden by ``at``) or a formula (``at`` gives every value).
    For a Max (the peak) the elasticity is that of the candidate that is the maximum at the
    point; where several tie, the one that grows fastest (the right derivative: the
    candidate that is the peak just above ``x``).

    With integer (or Rational) values the result is an exact sympy Rational, else a float."""
    x = _sym(x)
    est = obj if isinstance(obj, Estimate) else None
    if est is not None:
        expr = est.peak if component == "peak" else est.formula(component)
    else:
        expr = sp.sympify(obj)
    subs = _point(est, at, allow_float=True)
    cands = _candidates(expr)
    values = [_value(c, subs, "the formula") for c in cands]
    top = max(values)
    best = None
    for c, v in zip(cands, values):
        if v == top:
            e = _elasticity_of(c, x, subs, v)
            best = e if best is None or e > best else best
    return best


def _elasticity_of(expr, x, subs, value):
    if value == 0:
        raise ConfigError("M", 0, "a nonzero value at the point (ln M is undefined at 0)")
    deriv = _value(sp.diff(sp.expand(_smooth(sp.sympify(expr))), x), subs, "the formula")
    e = subs.get(x, x) * deriv / value
    e = _value(e, subs, "the formula")
    return e if e.is_Rational else float(e)


# --------------------------------------------------------------------------- regimes

def _group(parts: dict, grouped: bool) -> dict:
    if not grouped:
        return dict(parts)
    out = {"model_states": sum(parts.get(r, 0) for r in MODEL_STATES)}
    out.update({r: v for r, v in parts.items() if r not in MODEL_STATES})
    return out


def dominant(est: Estimate, at: dict, *, grouped: bool = False) -> str:
    """The role (params, master, optimizer, grads, activations, transient) that holds the most
    bytes at the peak at ``at`` (exact, from ``est.at``); ties go to the first in that order.
    ``grouped=True`` adds up params, master, optimizer and grads as ``"model_states"``."""
    return _dominant(est, at, grouped)[0]


def _dominant(est: Estimate, at: dict, grouped: bool) -> tuple[str, int, int]:
    ev = est.at(**_names(at))
    parts = _group(ev.peak_parts, grouped)
    role = max(parts, key=lambda r: parts[r])     # max keeps the first of equals
    return role, parts[role], ev.peak


class Regime(NamedTuple):
    """At ``value`` of the swept symbol, ``role`` holds ``share`` (0..1) of the peak."""
    value: int
    role: str
    share: float


def regimes(est: Estimate, x, values, at: dict | None = None, *,
            grouped: bool = False) -> list[Regime]:
    """For each value of ``x`` (the other symbols at ``at`` and the bindings): the dominant
    role at the peak and its share, ``bytes(role) / peak``. A change of role between two
    values is a crossover: e.g. for ``b`` at fixed ``s`` the optimizer states (or, grouped,
    the model states, which do not depend on b) hold most at small b and the activations
    (``∝ b``) at large b."""
    x = _sym(x)
    values = list(values)
    if not values:
        raise ConfigError(x.name, values, "a non-empty list of values")
    out = []
    for v in values:
        role, nbytes, peak = _dominant(est, {**_names(at), x.name: v}, grouped)
        out.append(Regime(v, role, nbytes / peak))
    return out


# --------------------------------------------------------------------------- per parameter

def parameter_count(graph: Graph | Estimate) -> sp.Expr:
    """The trainable elements N (tied weights once) as a formula in h, L, V, …, expanded and
    collected on L (GPT-2: ``L*(12*h**2 + 13*h) + V*h + h*s_max + 2*h``)."""
    if isinstance(graph, Estimate):
        graph = graph.graph
    return canonical(graph.param_count())


def bytes_per_parameter(est: Estimate, component: str = "model_states", *, limit=None,
                        priced: bool = False) -> sp.Expr:
    """Bytes of ``component`` per trainable parameter, ``M / N``.

    ``component``: one of ``est.components`` or ``"model_states"`` (params + grads + master +
    optimizer, ZeRO's model states: ``N*(B_w + B_g + B_m + 2*B_o)`` for mixed-precision Adam).

    ``limit=h`` (a symbol or its name): the limit as that dimension grows, taken exactly as
    the ratio of the leading coefficients of M and N in it (0 or oo when the degrees differ).
    Per-tensor extras (Adam's 4-byte step counters where they are on the device) vanish in the
    limit: fp32 AdamW 4 + 4 + 2*4 = 16, mixed-precision Adam 2 + 2 + 4 + 2*4 = 16 (ZeRO),
    fp32 SGD 4 + 4 = 8.

    ``priced=True`` binds the byte symbols to the policy's prices (dimensions stay symbols)."""
    if component == "model_states":
        m = sum((est.components[c] for c in MODEL_STATES), sp.Integer(0))
    elif component in est.components:
        m = est.components[component]
    else:
        raise UnknownName("component", component, ("model_states",) + tuple(est.components))
    n = parameter_count(est.graph)
    if priced:
        m = m.xreplace(est.policy.bindings())
    m = sp.expand(m)
    if limit is None:
        r = sp.cancel(m / n)
        return _tidy(r) if r.is_polynomial() else r
    x = _sym(limit)
    if m == 0:
        return sp.Integer(0)
    (dm, cm), (dn, cn) = _leading(m, x), _leading(n, x)
    if dm != dn:
        return sp.Integer(0) if dm < dn else sp.oo
    return _tidy(sp.cancel(cm / cn))


# --------------------------------------------------------------------------- sweeps

def sweep(est: Estimate, **grid):
    """The peak and every component over the cartesian product of ``grid`` (e.g.
    ``sweep(est, b=[1, 2, 4, 8], s=[512, 1024, 2048])``; the last name varies fastest; a single
    integer stands for a list of one), from the compiled formulas (``est.evaluator``);
    symbols not in the grid take the model's and the policy's bindings.

    Columns: the grid symbols, ``params``, ``grads``, ``master``, ``optimizer``,
    ``activations``, ``peak`` (exact integer bytes, as ``est.at``; fractional byte counts
    round up) and ``peak_gib`` (peak / 2**30). One row per grid point: a pandas DataFrame
    when pandas is installed, else a dict of numpy arrays."""
    if not grid:
        raise ConfigError("grid", {}, "at least one symbol with a list of values",
                          "E.g. sweep(est, b=[1, 2, 4], s=[512, 1024]).")
    names, axes = [], []
    for name, vals in grid.items():
        sym = symbol(name)                                  # UnknownName for a typo
        vals = [vals] if isinstance(vals, (int, np.integer)) else list(vals)
        if not vals:
            raise ConfigError(name, vals, "a non-empty list of values")
        for v in vals:
            if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)) or v <= 0:
                raise ConfigError(name, v, "a positive integer")
        names.append(sym.name)
        axes.append(np.asarray(vals, dtype=np.int64))
    mesh = [m.ravel() for m in np.meshgrid(*axes, indexing="ij")]
    point = dict(zip(names, mesh))

    bound = {k for k in est.bindings} | {symbol(n) for n in names}
    exprs = [est.peak, *est.components.values()]
    missing = sorted({str(x) for e in exprs for x in e.free_symbols} - {str(x) for x in bound})
    if missing:
        raise ConfigError("grid", sorted(names), f"values for every symbol the model does not bind "
                          f"(missing: {', '.join(missing)})",
                          f"Add them, e.g. sweep(est, {', '.join(f'{n}=[...]' for n in names + missing)}).")
    # est.evaluator checks every point against the model's requirements (s <= s_max, a | h)
    columns = {n: point[n] for n in names}
    for c in est.components:
        columns[c] = _whole(est.evaluator(*names, component=c)(**point), c)
    columns["peak"] = _whole(est.evaluator(*names)(**point), "peak")
    columns["peak_gib"] = columns["peak"] / GIB
    try:
        import pandas as pd
    except ImportError:
        return columns
    return pd.DataFrame(columns)


def _whole(values, name) -> np.ndarray:
    """Whole bytes as int64 (fractional counts round up, as Estimate.at), refusing values
    that do not fit int64 exactly."""
    v = np.asarray(values)
    if v.dtype.kind == "f":
        v = np.ceil(v)
    if v.size and float(np.max(np.abs(v.astype(np.float64)))) >= 2.0**62:
        raise ConfigError(name, float(np.max(v)), "bytes below 2**62 (int64 arithmetic)",
                          "Sweep smaller values.")
    return v.astype(np.int64)
