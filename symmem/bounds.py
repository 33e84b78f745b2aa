"""What can be proven about byte formulas from the symbols' assumptions alone.

Every dimension (``b``, ``s``, ``h``, ``L``, ...) is an integer >= 1 and every byte price
is > 0. A polynomial is then provably >= 0 when, written in ``x - 1`` for each dimension
``x`` (and in the prices as they are), it has no negative coefficient: each monomial is a
product of non-negative factors. That one test decides which candidates of the peak can
be dropped (another is at least as large everywhere) and which moments of a repeated
block can be left out.
"""
from __future__ import annotations

import functools
from fractions import Fraction
from itertools import chain
from math import comb, gcd

import sympy as sp
from sympy.core import basic as _basic

from .symbols import DIMENSIONS

_DIMENSIONS = frozenset(DIMENSIONS)     # looked up by hash, not compared one by one

__all__ = ["provably_nonneg", "monomials", "shifted_coeffs", "dominates", "prune", "samples",
           "terms", "substitute", "terms_nonneg", "terms_samples", "covers", "product", "total", "sum_of",
           "merged_terms", "prune_terms", "sort_key", "from_terms", "times_terms", "sampler"]


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
    return _terms(e, gens, laurent=False)


def _terms(e, gens, laurent: bool) -> dict | None:
    """:func:`monomials`, negative integer exponents allowed when ``laurent`` (``h/a``: the
    exponents (1, -1); a Laurent polynomial, exact at any point where every symbol is >= 1).

    Walks the sum's terms and each term's factors (``Add.make_args``, ``Mul.make_args``):
    what ``as_coefficients_dict`` and ``as_powers_dict`` return for a sum of monomials, at a
    fraction of their cost. A factor that is neither a symbol of ``gens`` nor one raised to an
    integer power (a ceiling, a sum left unexpanded) gives None."""
    index = {g: i for i, g in enumerate(gens)}
    out: dict = {}
    for term in sp.Add.make_args(sp.sympify(e)):
        c, rest = term.as_coeff_Mul()
        if not c.is_Rational:
            return None
        exps = [0] * len(gens)
        if rest is not sp.S.One:
            for factor in sp.Mul.make_args(rest):
                if factor.is_Pow:
                    base, ex = factor.args
                    if not ex.is_Integer or (ex < 0 and not laurent):
                        return None
                    ex = int(ex)
                elif factor.is_Number:       # a second number: not a canonical product
                    return None
                else:
                    base, ex = factor, 1
                if base not in index:
                    return None
                exps[index[base]] += ex
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
    shifted = tuple(i for i, g in enumerate(gens) if g in _DIMENSIONS)
    out: dict = {}
    for mono, c in poly.items():
        for m, v in _expansion(mono, shifted):
            out[m] = out.get(m, 0) + c * v
    return out


@functools.lru_cache(maxsize=1 << 16)
def _expansion(mono: tuple, shifted: tuple) -> tuple:
    """``mono`` in (x - 1) for the variables at ``shifted``: x^e = ((x - 1) + 1)^e = sum_j
    C(e, j) (x - 1)^j, each ((exponents), binomial product). Kept: the points of a step share
    most of their monomials."""
    terms = [(mono, 1)]
    for i in shifted:
        if mono[i]:
            terms = [(m[:i] + (j,) + m[i + 1:], v * comb(m[i], j)) for m, v in terms for j in range(m[i] + 1)]
    return tuple(terms)


def dominates(cj: dict, ci: dict) -> bool:
    """Does the polynomial with coefficients cj minus the one with ci have none negative?"""
    return all(cj.get(m, 0) >= c for m, c in ci.items()) and \
        all(c >= 0 for m, c in cj.items() if m not in ci)


_POINTS = (lambda n: [2] * n, lambda n: [3 + 2 * i for i in range(n)], lambda n: [1] * n,
           lambda n: [1000 - 7 * i for i in range(n)], lambda n: [1 + (i % 2) * 50 for i in range(n)],
           lambda n: [51 - (i % 2) * 50 for i in range(n)])


def _value(poly: dict, point) -> Fraction:
    """The exact value of a (Laurent) polynomial of :func:`_terms` at integer ``point``."""
    total = 0
    for mono, c in poly.items():
        for x, e in zip(point, mono):
            if e > 0:
                c = c * x ** e
            elif e < 0:
                c = Fraction(c, x ** -e)
        total += c
    return total


def samples(exprs) -> list[tuple]:
    """Each expression's exact value at a few points where every symbol is >= 1: a cheap
    first test (an expression larger somewhere cannot be dominated there). A (Laurent)
    polynomial is evaluated from its terms with exact integers and fractions; anything else
    by substitution."""
    exprs = [sp.sympify(e) for e in exprs]
    gens = sorted(set().union(*(e.free_symbols for e in exprs)), key=str)
    points = [f(len(gens)) for f in _POINTS]
    out = []
    for e in exprs:
        poly = _terms(e, gens, laurent=True)
        if poly is None:
            poly = _terms(sp.expand(e), gens, laurent=True)
        if poly is None:
            out.append(tuple(e.xreplace(dict(zip(gens, map(sp.Integer, p)))) for p in points))
        else:
            out.append(tuple(_value(poly, p) for p in points))
    return out


def prune(exprs: list) -> list[int]:
    """Indices of the expressions no other provably dominates (of equal ones, the first).
    An expression can only be dominated by one at least as large at every sample point, so
    the coefficients are worked out only for those pairs. Only polynomials are compared: one
    that is not (a ratio such as ``h/a``, a ceiling) is kept and dominates none, so its
    sample values are never needed."""
    totals = [sp.sympify(e) for e in exprs]
    gens = sorted(set().union(*(t.free_symbols for t in totals)), key=str)
    polys = [_polynomial(t, gens) for t in totals]
    monos = list(dict.fromkeys(m for q in polys if q is not None for m in q))
    column = {m: k for k, m in enumerate(monos)}
    return _prune([None if q is None else ([column[m] for m in q], list(q.values())) for q in polys], monos, gens)


def prune_terms(ds: list) -> list[int] | None:
    """:func:`prune` of the sums whose :func:`terms` are ``ds`` (None where one is None).
    Each ceiling of a positive argument (a tiled kernel's ``ceiling(s/128)``) is a variable
    of its own, at least 1 as every symbol is: a sum that dominates another for every value
    of them does at the ceilings' values too. A negative exponent (``h/a``) is cleared by
    multiplying every sum by the same positive monomial, which keeps which dominates which.
    A sum with another atom is kept and dominates none, as :func:`prune` does. Each distinct
    product is read once (the sums of a step share most of theirs)."""
    if any(d is None for d in ds):
        return None
    keys = dict.fromkeys(chain.from_iterable(ds))
    bases = {base for key in keys for base, _ in key}
    gens = sorted((x for x in bases if x.is_Symbol or _at_least_one(x)), key=str)
    index = {g: i for i, g in enumerate(gens)}
    low = [0] * len(gens)
    for key in keys:
        for base, ex in key:
            i = index.get(base)
            if i is not None and ex < low[i]:
                low[i] = ex
    monos, column = [], {}          # each product's monomial (exponents of gens), its column
    for key in keys:
        e = [-x for x in low]
        for base, ex in key:
            i = index.get(base)
            if i is None:           # another atom: not a polynomial in gens
                break
            e[i] += ex
        else:
            column[key] = len(monos)
            monos.append(tuple(e))
    rows = []
    for d in ds:
        try:
            rows.append(([column[key] for key in d], list(d.values())))
        except KeyError:            # a product with another atom
            rows.append(None)
    return _prune(rows, monos, gens)


def _at_least_one(atom) -> bool:
    """Is ``atom`` a ceiling of a positive argument (so at least 1)?"""
    return isinstance(atom, sp.ceiling) and bool(atom.args[0].is_positive)


def _prune(rows: list, monos: list, gens) -> list[int]:
    """The pruning of polynomials given as ``rows``: each (columns, coefficients) over the
    monomials ``monos`` (exponents of ``gens``), or None (not a polynomial: kept, dominates
    none). As arrays where they are exact (:func:`_prune_matrix`), else pair by pair."""
    keep = _prune_matrix(rows, monos, gens)
    if keep is not None:
        return keep
    polys = [None if r is None else {monos[k]: c for k, c in zip(*r)} for r in rows]
    points = [f(len(gens)) for f in _POINTS]
    values = [tuple(_value(q, p) for p in points) if q is not None else None for q in polys]
    coeffs: dict = {}

    def coeff(i):
        if i not in coeffs:
            coeffs[i] = shifted_coeffs(polys[i], gens)
        return coeffs[i]

    comparable = [j for j, q in enumerate(polys) if q is not None]
    keep = []
    for i in range(len(polys)):
        dominated = False
        if polys[i] is not None:
            for j in comparable:
                if j == i or any(x < y for x, y in zip(values[j], values[i])):
                    continue
                ci, cj = coeff(i), coeff(j)
                if not dominates(cj, ci):
                    continue
                if j < i or not dominates(ci, cj):   # strictly larger, or an earlier equal
                    dominated = True
                    break
        if not dominated:
            keep.append(i)
    return keep


def _prune_matrix(rows: list, monos: list, gens) -> list[int] | None:
    """:func:`_prune` with every pair's :func:`dominates` decided at once, as arrays: the
    shifted coefficients of the polynomials, over the union of their monomials (a missing
    one 0), times the common denominator of the fractions among them, so that j dominates i
    where row j >= row i in every column. The same decisions: the samples only skip pairs
    that cannot dominate (a polynomial with no negative shifted coefficient is >= 0 at every
    sample point), and whether i is dominated (by a j that dominates it and is earlier, or
    that it does not dominate back) does not depend on the order of the j.

    The shift is linear: the table is the coefficients (a row per polynomial, a column per
    monomial of the rows compared) times each monomial's expansion in ``x - 1``
    (:func:`_expansion`), one float64 matrix product (:func:`_product`), exact where no sum
    can reach 2^53 (bounded first, with Python's integers); which row is >= which is read off
    it by :func:`_dominance`. None when a sum could reach 2^53: the pairs are then compared
    one by one, exactly."""
    import numpy as np
    from math import lcm
    comparable = [i for i, r in enumerate(rows) if r is not None]
    if len(comparable) < 2:
        return None
    lengths = [len(rows[i][0]) for i in comparable]
    cols = list(chain.from_iterable(rows[i][0] for i in comparable))
    vals = list(chain.from_iterable(rows[i][1] for i in comparable))
    fractions = [v.denominator for v in vals if type(v) is not int]
    if fractions:       # whole coefficients: the table in integers
        den = lcm(*fractions)
        vals = [int(v * den) for v in vals]
    used = np.unique(np.array(cols, dtype=np.int64))     # the monomials of the rows compared
    place = np.zeros(len(monos), dtype=np.int64)
    place[used] = np.arange(len(used))
    shifted = tuple(i for i, g in enumerate(gens) if g in _DIMENSIONS)
    columns: dict = {}
    e_rows, e_cols, e_vals, e_sums = [], [], [], {}
    for k, m in enumerate(monos[i] for i in used):
        for mono, v in _expansion(m, shifted):
            j = columns.setdefault(mono, len(columns))
            e_rows.append(k)
            e_cols.append(j)
            e_vals.append(v)
            e_sums[j] = e_sums.get(j, 0) + v         # binomials: all positive
    if max(map(abs, vals), default=0) * max(e_sums.values(), default=0) >= 1 << 53:
        return None
    a = np.zeros((len(comparable), len(used)))
    a[np.repeat(np.arange(len(comparable)), lengths), place[cols]] = vals
    e = np.zeros((len(used), len(columns)))
    e[e_rows, e_cols] = e_vals
    dom = _dominance(_product(a, e))
    mutual = dom & dom.T                  # equal: of them, the first is kept
    beaten = (dom & ~mutual).any(axis=0) | np.triu(mutual, 1).any(axis=0)
    dominated = {comparable[i] for i in np.flatnonzero(beaten)}
    return [i for i in range(len(rows)) if i not in dominated]




#: OpenBLAS multiplies with one thread up to this many multiply-adds (``m * n * k``,
#: ``GEMM_MULTITHREAD_THRESHOLD`` times 65536): past it, its threads cost milliseconds to start
#: and join where a table of the candidates takes a fraction of one to compute
_ONE_THREAD = 1 << 18


def _product(a, e):
    """``a @ e``, in blocks of rows each below OpenBLAS's threading (:data:`_ONE_THREAD`), as
    :class:`symmem.engine._Monomials` evaluates: the same numbers (each entry is one row
    times one column), without the threads' start (25 times the product on a shared machine)."""
    import numpy as np
    rows = max(1, _ONE_THREAD // max(1, a.shape[1] * e.shape[1]))
    if a.shape[0] <= rows:
        return a @ e
    return np.concatenate([a[i:i + rows] @ e for i in range(0, a.shape[0], rows)])


def _dominance(table):
    """``dom[j, i]``: is row ``j`` of ``table`` >= row ``i`` in every column? Whether one row
    is >= another in a column depends only on the order of the column's values: each column
    is read as the ranks of its distinct values, constant columns (no row larger) and
    columns of the same ranks as another (the same comparisons) left out. Then, column by
    column, each row's set of rows at least as large there is a bit set (the rows of rank >=
    its own: one per distinct value, gathered), and ``dom[:, i]`` is the AND of row ``i``'s
    sets over the columns: n^2 / 8 bytes per column where comparing every pair's entries
    costs n^2 per column (most of T5's pruning, 611 rows of 202 columns of which 67 are
    distinct orders)."""
    import numpy as np
    n = table.shape[0]
    order = np.argsort(table, axis=0, kind="stable")
    ordered = np.take_along_axis(table, order, axis=0)
    rising = np.concatenate([np.zeros((1, table.shape[1]), dtype=np.int64),
                             (np.diff(ordered, axis=0) != 0).cumsum(axis=0)])
    ranks = np.empty_like(rising)
    np.put_along_axis(ranks, order, rising, axis=0)
    every = np.packbits(np.ones(n, dtype=bool))
    sets = np.broadcast_to(every, (n, every.size)).copy()  # sets[i]: rows >= row i in every column so far
    seen = set()
    for col in ranks.T[rising[-1] > 0]:                # a constant column: no row is larger there
        if (key := col.tobytes()) in seen:             # the same order again: the same comparisons
            continue
        seen.add(key)
        at_least = np.packbits(col[None, :] >= np.arange(col.max() + 1)[:, None], axis=1)
        sets &= at_least[col]
    return np.unpackbits(sets, axis=1, count=n).T.astype(bool)

# ----- sums of products, as dictionaries ----------------------------------------------------
# The counter compares many points, each an expanded sum of products of symbols (and, with a
# tiled attention kernel, of ceilings). Kept as {frozenset of (base, exponent): coefficient},
# they are substituted, subtracted and sampled with Python's integers, giving what sympy's
# xreplace, expand and subtraction of the same expressions give (exact arithmetic both).

@functools.lru_cache(maxsize=1 << 16)
def terms(e) -> dict | None:
    """An expanded sum ``e`` as {frozenset((base, exponent), ...): coefficient}, a base a
    symbol or an atom such as ``ceiling(s/128)``, each exponent a (possibly negative)
    integer, each coefficient an int or Fraction; None when a coefficient is not rational, an
    exponent not an integer or a factor a sum (not expanded). Kept per expression (the
    points of a step share most of their parts): the dictionary returned is not to be
    changed."""
    out: dict = {}
    for term in sp.Add.make_args(e):
        if term.is_Mul:                   # canonical: the number first, if any
            args = term.args
            c, factors = (args[0], args[1:]) if args[0].is_Number else (sp.S.One, args)
        elif term.is_Number:
            c, factors = term, ()
        else:
            c, factors = sp.S.One, (term,)
        if not c.is_Rational:
            return None
        key = []
        for factor in factors:
            base, ex = factor.args if factor.is_Pow else (factor, sp.S.One)
            if not ex.is_Integer or base.is_Number or base.is_Add or base.is_Mul or base.is_Pow:
                return None
            key.append((base, int(ex)))
        key = frozenset(key)
        out[key] = out.get(key, 0) + (int(c.p) if c.q == 1 else Fraction(int(c.p), int(c.q)))
    return {k: v for k, v in out.items() if v != 0}


def substitute(d: dict, x, value: int) -> dict | None:
    """:func:`terms` ``d`` with the symbol ``x`` set to the integer ``value`` (None when an atom
    holds ``x``: the caller substitutes the expression instead)."""
    out: dict = {}
    for key, c in d.items():
        split = _SPLITS.get((key, x))
        if split is None:
            split = _split(key, x)
        if split is False:
            return None
        rest, ex = split
        if ex:
            c = c * value ** ex if ex > 0 else Fraction(c, value ** -ex)
        out[rest] = out.get(rest, 0) + c
    return {k: v for k, v in out.items() if v != 0}


_SPLITS: dict = {}


def _split(key: frozenset, x):
    """(``key`` without ``x``, the exponent of ``x`` in it), or False when an atom of it (a
    ceiling) holds ``x``; kept per key, as the points of a step share most of theirs."""
    ex, rest = 0, []
    for base, e in key:
        if base is x or (base.is_Symbol and base == x):
            ex = e
        elif not base.is_Symbol and x in base.free_symbols:
            ex = False
            break
        else:
            rest.append((base, e))
    split = False if ex is False else (frozenset(rest), ex)
    if len(_SPLITS) < 1 << 16:
        _SPLITS[key, x] = split
    return split


def _name(symbol) -> str:
    """A symbol's name: what ``str`` prints for it, without the printer."""
    return symbol.name


def _symbols(d: dict) -> set:
    return set().union(*(base.free_symbols for key in d for base, _ in key))


def from_terms(d: dict) -> sp.Expr:
    """The sympy expression of :func:`terms` ``d`` (the same canonical sum sympy builds), each
    product built once and kept (the sums of a step share most of theirs)."""
    out = []
    for key, c in d.items():
        p = _PRODUCTS.get((key, c))
        if p is None:
            p = product(c, [base if ex == 1 else base ** ex for base, ex in key])
            if len(_PRODUCTS) < 1 << 16:
                _PRODUCTS[key, c] = p
        out.append(p)
    return total(out)


_PRODUCTS: dict = {}


def times_terms(a: dict, b: dict) -> dict:
    """The :func:`terms` of the product of the sums ``a`` and ``b`` stand for."""
    out: dict = {}
    for ka, ca in a.items():
        for kb, cb in b.items():
            key = _KEY_PRODUCTS.get((ka, kb))
            if key is None:
                exps = dict(kb)
                for base, ex in ka:
                    exps[base] = exps.get(base, 0) + ex
                key = frozenset((base, ex) for base, ex in exps.items() if ex)
                if len(_KEY_PRODUCTS) < 1 << 16:
                    _KEY_PRODUCTS[ka, kb] = key
            out[key] = out.get(key, 0) + ca * cb
    return {k: v for k, v in out.items() if v != 0}


_KEY_PRODUCTS: dict = {}


_KEYS: dict = {}


def sort_key(e) -> tuple:
    """A key that orders sympy objects as ``Basic.compare`` does (the order ``Add`` and ``Mul``
    keep their arguments in: ``_addsort``, ``_mulsort``), computed once per object: the class
    (its place in ``ordering_of_classes``, else its name, as ``_cmp_name``), then the length
    of the hashable content, then its items (objects by their keys, other values as they
    are). Python compares the tuples in ``compare``'s order, without its calls per pair."""
    key = _KEYS.get(e)
    if key is None:
        name = type(e).__name__
        try:
            rank = (_basic.ordering_of_classes.index(name), "")
        except ValueError:
            rank = (len(_basic.ordering_of_classes) + 1, name)
        content = e._hashable_content()
        items = []
        for x in content:
            if isinstance(x, sp.Basic):
                items.append(sort_key(x))
            elif isinstance(x, frozenset):
                raise TypeError("sort_key: a frozenset in the hashable content")
            else:
                items.append(x)
        key = (rank, len(content), tuple(items))
        if len(_KEYS) < 1 << 16:
            _KEYS[e] = key
    return key


def _sorted(args: list) -> list:
    try:
        return sorted(args, key=sort_key)
    except TypeError:                     # content sort_key does not mirror: sympy's own order
        from sympy.core.basic import _args_sortkey
        return sorted(args, key=_args_sortkey)


def product(c, factors: list) -> sp.Expr:
    """``sympy.Mul(c, *factors)`` for a rational ``c`` (int or Fraction) and factors that are
    symbols, atoms or their integer powers, no two of the same base: the arguments put in
    the order ``Mul`` puts them (the number first, the rest by ``Basic.compare``) without
    its general flattening, which costs most when formulas are built term by term."""
    if c == 0:
        return sp.S.Zero
    coeff = sp.Integer(c) if isinstance(c, int) else sp.Rational(c.numerator, c.denominator)
    args = _sorted(factors)
    if coeff is not sp.S.One:
        args.insert(0, coeff)
    return sp.Mul._from_args(args, True)


def total(products: list) -> sp.Expr:
    """``sympy.Add(*products)`` for products of :func:`product` with no two alike (no two of
    the same factors): the number first, the rest by ``Basic.compare``, as ``Add`` orders
    them, without its general flattening."""
    numbers = [p for p in products if p.is_Number]
    if len(numbers) > 1:
        return sp.Add(*products)
    args = _sorted([p for p in products if not p.is_Number])
    if numbers and numbers[0] is not sp.S.Zero:
        args.insert(0, numbers[0])
    return sp.Add._from_args(args, True)


def terms_nonneg(d: dict) -> bool:
    """:func:`provably_nonneg` of the sum :func:`terms` ``d`` stands for. A term with an atom
    (a ceiling) cannot be proven so: False, as :func:`provably_nonneg` finds; a polynomial is
    decided here; a ratio (negative exponents) by :func:`provably_nonneg` itself."""
    if any(not base.is_Symbol for key in d for base, _ in key):
        return False
    low: dict = {}
    for key in d:
        for base, ex in key:
            if ex < 0:
                low[base] = min(low.get(base, 0), ex)
    if low:     # a Laurent polynomial: times the monomial that clears its denominators (> 0)
        d = {frozenset({**{sym: -ex for sym, ex in low.items()},
                        **{base: ex - low.get(base, 0) for base, ex in key}}.items()): c for key, c in d.items()}
        d = {frozenset((base, ex) for base, ex in key if ex): c for key, c in d.items()}
    gens = sorted(_symbols(d), key=_name)   # by name (str prints each: ten times slower)
    index = {g: i for i, g in enumerate(gens)}
    poly = {}
    for key, c in d.items():
        exps = [0] * len(gens)
        for base, ex in key:
            exps[index[base]] = ex
        poly[tuple(exps)] = c
    if all(c >= 0 for c in poly.values()):       # every monomial is positive
        return True
    scale = 1          # whole coefficients (times a positive number): integers add faster than fractions
    for c in poly.values():
        if isinstance(c, Fraction):
            scale = scale * c.denominator // gcd(scale, c.denominator)
    if scale != 1:
        poly = {m: int(c * scale) for m, c in poly.items()}
    return all(c >= 0 for c in shifted_coeffs(poly, gens).values())


def terms_samples(ds: list) -> list[tuple]:
    """The values of the sums :func:`terms` ``ds`` stand for at :func:`samples`' points (over
    the sorted union of their symbols), in floating point: a filter for :func:`covers`, never
    a proof (that is :func:`terms_nonneg`'s, exact)."""
    bases = {base for d in ds for key in d for base, _ in key}
    sample = sampler(sorted(set().union(*(base.free_symbols for base in bases)), key=str))
    return [sample(d) for d in ds]


def sampler(gens: list, fixed: dict | None = None):
    """A function giving the values of a sum :func:`terms` ``d`` at :func:`samples`' points
    over ``gens`` (each symbol of ``fixed``, {symbol: int}, at its value there), in floating
    point, as :func:`terms_samples` does; each product's values are computed once and kept,
    so that sums sampled one by one, as a search needs them, cost what sampling them all
    together does."""
    points = [{**dict(zip(gens, f(len(gens)))), **(fixed or {})} for f in _POINTS]
    atoms: dict = {}

    def value(base, point, i) -> float:
        if base.is_Symbol:
            return float(point[base])
        if (base, i) not in atoms:
            atoms[base, i] = float(base.xreplace({g: sp.Integer(v) for g, v in point.items()}))
        return atoms[base, i]

    monos: dict = {}              # key -> the product's value at each point

    def mono(key) -> list:
        if key not in monos:
            vs = []
            for i, point in enumerate(points):
                v = 1.0
                for base, ex in key:
                    v *= value(base, point, i) ** ex
                vs.append(v)
            monos[key] = vs
        return monos[key]

    def sample(d: dict) -> tuple:
        sums = [0.0] * len(points)
        for key, c in d.items():
            c = float(c)
            for i, v in enumerate(mono(key)):
                sums[i] += c * v
        return tuple(sums)
    return sample


def covers(xs: tuple, ys: tuple) -> bool:
    """Can the sum sampled as ``xs`` be at least the one sampled as ``ys`` (:func:`terms_samples`)?
    False only where it is clearly smaller at some point: a tolerance far above the floats'
    rounding keeps every pair that is equal or larger (the exact proof decides)."""
    return all(x >= y - 1e-9 * (abs(x) + abs(y)) for x, y in zip(xs, ys))


def merged_terms(parts) -> dict | None:
    """The :func:`terms` of the sum of ``parts`` (each an expanded sum), their like terms
    merged as ``Add`` merges them; None when a part is not a sum of products."""
    merged: dict = {}
    for part in parts:
        d = terms(part)
        if d is None:
            return None
        for key, c in d.items():
            merged[key] = merged.get(key, 0) + c
    return {k: v for k, v in merged.items() if v != 0}


def sum_of(parts) -> sp.Expr:
    """``sympy.Add(*parts)`` of expanded sums, built from :func:`merged_terms` with
    :func:`product` and :func:`total` (the same expression, a fraction of the cost)."""
    merged = merged_terms(parts)
    return sp.Add(*parts) if merged is None else from_terms(merged)
