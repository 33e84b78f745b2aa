"""The counter: runs a plan and records what is live at every moment that can be the peak.

Two steps.

**Liveness.** A :class:`~symmem.plan.Compute` names what it reads and who holds what; the
counter works out when each storage it allocates is freed: after its last reader has run
and its last holder has let go (the :class:`~symmem.plan.Release` of every holder), as
Python's reference counting does. A storage held by autograd (or by a checkpoint) is an
activation; one nobody holds is transient. Storages of explicit :class:`~symmem.plan.Alloc`
events are freed by their :class:`~symmem.plan.Free` only.

**Counting.** Live bytes are summed per role and in all (as dictionaries of terms,
:class:`_Sum`); a mark records a :class:`Point` with its total's terms, each role's
expression built when its parts are first read. A repeated block appears as its
copies (first iteration, a middle one, last iteration; backward runs them in reverse).
Copies whose events are the same byte for byte are one *segment*: a segment of ``m``
iterations is run once, and since each of its iterations leaves the same bytes ``D`` behind,
the live bytes at a moment of its ``i``-th iteration are affine in ``i``: their maximum is
at its first or its last iteration, the points of the run plus ``(m - 1) D``. The result is
exact for every count at which each segment has at least one iteration; where a segment can
have none (a block whose first iteration differs, at ``count = 1``), its points must be
provably below another point there, or ``count`` gets a lower bound (a requirement, checked
where formulas are evaluated).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import sympy as sp

from .bounds import (covers, from_terms, merged_terms, provably_nonneg, sampler, samples, substitute, sum_of,
                     terms, terms_nonneg, times_terms)
from .requirements import Requirement
from .plan import (AUTOGRAD, CHECKPOINT, ROLES, Alloc, Begin, Compute, End, Free, Mark, Plan,
                   Release, flat)

__all__ = ["Point", "Timeline", "count", "saved", "resolve"]

ZERO = sp.Integer(0)
ONE = sp.Integer(1)
INF = float("inf")


class _Pending:
    """A point's parts as the counter's sums of each role (:class:`_Sum`), their expressions
    not built yet."""
    __slots__ = ("sums",)

    def __init__(self, sums: dict):
        self.sums = sums

    def build(self) -> tuple:
        """((role, bytes expr), ...) in ROLES order: :attr:`Point.parts`."""
        return tuple((r, self.sums[r].expr()) for r in ROLES)


class _Parts:
    """:attr:`Point.parts`, built when first read where the counter gave them as sums
    (:class:`_Pending`): the peak needs each point's total only, as terms
    (:attr:`Point.terms`), and most points are pruned, so that building every role's sympy sum
    at every point (a third of T5's counting) is left to those who read them."""

    def __get__(self, obj, owner=None):
        """The point's parts, built (and kept) if they were pending."""
        if obj is None:
            raise AttributeError("parts")       # no default: a point is made with its parts
        parts = obj.__dict__["_parts"]
        if isinstance(parts, _Pending):
            parts = obj.__dict__["_parts"] = parts.build()
        return parts

    def __set__(self, obj, value) -> None:
        """Kept as given (a tuple, or :class:`_Pending`): the dataclass's ``__init__`` sets it."""
        obj.__dict__["_parts"] = value


@dataclass(frozen=True)
class Point:
    """Live memory at one moment of the step: bytes per role, and where it is."""
    phase: str            # "forward" | "backward" | "optimizer"
    node: str             # the node running (or the parameter being updated)
    parts: tuple = _Parts()   # ((role, bytes expr), ...) in ROLES order
    iteration: str = ""   # "first", "second", "second to last", "last" inside a repeated block
    micro: str = ""       # the micro-batch, under gradient accumulation
    rank: str = ""        # the pipeline stage, under pipeline parallelism
    # the total as :func:`~symmem.bounds.terms`, where the counter had them (None: read from the parts)
    summed: dict | None = field(default=None, compare=False, repr=False)

    @property
    def terms(self) -> dict | None:
        """The total as :func:`~symmem.bounds.terms` (None where a part is not a sum of
        products): the counter's own, else read off the parts."""
        return self.summed if self.summed is not None else merged_terms([e for _, e in self.parts])

    @cached_property
    def total(self) -> sp.Expr:
        """The live bytes of every role, summed (``Add`` of the parts, built from their terms:
        :func:`~symmem.bounds.sum_of`); kept, not pickled."""
        return sum_of([e for _, e in self.parts])

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("total", None)
        state["_parts"] = self.parts        # built, if the counter left them pending
        return state

    @property
    def where(self) -> str:
        it = f" ({self.iteration} iteration)" if self.iteration else ""
        mb = f" (micro-batch {self.micro})" if self.micro else ""
        stage = f"stage {self.rank}: " if self.rank else ""
        return f"{stage}{self.phase} {self.node}{it}{mb}"


@dataclass(frozen=True)
class Timeline:
    """What the counter derives from a plan: every point in order, the components (the
    model states from the plan; ``activations``: bytes held for backward when forward
    ends) and the requirements for the formulas to hold."""
    points: tuple
    components: dict
    requirements: tuple = ()


def count(plan: Plan) -> Timeline:
    """Run ``plan``: the timeline of points, the components and the requirements."""
    ops = resolve(plan)
    walk = _Walk()
    walk.run(ops)
    comps = dict(plan.components)
    comps["activations"] = walk.saved_at_end_of_forward
    return Timeline(tuple(walk.points), comps, tuple(plan.requirements) + tuple(walk.requirements))


def saved(plan: Plan) -> tuple[sp.Expr, sp.Expr]:
    """(the bytes held for backward when the first micro-batch's forward ends, those of them
    saved outside every repeated block): :func:`count`'s ``activations`` and ``outside``
    without the points (a pass that sizes what a step keeps asks this)."""
    ops = resolve(plan)
    end = next(i for i, op in enumerate(ops) if op[0] == "end of forward")
    walk = _Saved()
    walk.run(ops[:end + 1])
    return walk.saved_at_end_of_forward, sp.expand(walk.outside_at_end_of_forward)


# ----- liveness -----------------------------------------------------------------------------
def _activation_holder(holder: str) -> bool:
    return holder.startswith(AUTOGRAD) or holder.startswith(CHECKPOINT)


@dataclass
class _Storage:
    nbytes: sp.Expr
    role: str
    count: sp.Expr
    created: int
    explicit: bool                 # from an Alloc: freed by its Free only
    last_read: int = -1
    holds: dict = field(default_factory=dict)    # holder -> position of the hold
    origin: tuple | None = None    # (block, copy, count) of the block copy that made it
    brief: bool = False            # gone before its op's largest moment if nobody holds it


def resolve(plan: Plan) -> list:
    """The plan's events with every storage's allocation and free made explicit, as op
    tuples in order: ("alloc", bytes, role, count, saved), ("free", bytes, role, count),
    ("mark", phase, node, extra, copy, micro-batch), ("begin", block, copy, count), ("end", block, copy).
    ``saved`` is the bytes counted as held for backward when forward ends."""
    seq = [(ph, e, mb) for _, ph, mb, events in plan.sections() for e in flat(events)]
    end_of_forward = len(plan.states) + sum(1 for _ in flat(plan.forward)) - 1   # the first micro-batch's
    current: dict = {}            # key -> index of its storage now
    storages: list[_Storage] = []
    releases: dict = {}           # holder -> [positions]
    inside, context = None, []    # the block copy each position is in
    copies = {}                   # block -> the copies lowered
    for pos, (_, e, _) in enumerate(seq):
        if isinstance(e, Begin):
            inside = (e.block, e.copy, e.count)
            copies[e.block] = max(copies.get(e.block, 0), e.copy)
        elif isinstance(e, End):
            inside = None
        context.append(inside)
        if isinstance(e, Compute):
            for key in e.reads:
                if key in current:
                    storages[current[key]].last_read = pos
            made = ([(e.out, e.out_bytes)] if e.out is not None else []) + list(e.new)
            for key, nbytes in made:
                current[key] = len(storages)
                storages.append(_Storage(nbytes, e.role, ONE, pos, False, pos, origin=inside,
                                         brief=key in e.brief))
            for key, holder in e.holds:
                if key in current:
                    storages[current[key]].holds.setdefault(holder, pos)
        elif isinstance(e, Alloc):
            current[e.key] = len(storages)
            storages.append(_Storage(e.nbytes, e.role, e.count, pos, True))
        elif isinstance(e, Release):
            releases.setdefault(e.holder, []).append(pos)

    def released(holder, since):
        return next((p for p in releases.get(holder, ()) if p >= since), INF)

    frees: dict = {}              # position -> [storage index]
    allocs: dict = {}             # storage index -> (role, saved bytes)
    for i, st in enumerate(storages):
        ends = {h: released(h, p) for h, p in st.holds.items()}
        role = st.role
        if not st.explicit and any(_activation_holder(h) for h in st.holds):
            role = "activations"
        end = max([st.last_read, *ends.values()])
        # what autograd keeps at the end of forward; the model's own tensors (a frozen weight a
        # linear layer keeps) are counted as what they are, not again
        saved = st.role not in ("params", "buffers") and st.created <= end_of_forward < end and any(
            _activation_holder(h) and p <= end_of_forward < ends[h] for h, p in st.holds.items())
        # an allocation of activations (other micro-batches' saved tensors, alive through
        # forward and backward: a pipeline's in flight) is held for backward too
        saved = saved or (st.explicit and st.role == "activations" and st.created <= end_of_forward)
        allocs[i] = (role, st.nbytes * st.count if saved else ZERO)
        if st.brief and not st.holds and end == st.created:
            allocs[i] = None               # made and freed inside its op, before the mark
        elif not st.explicit and end != INF:
            frees.setdefault(end, []).append(i)

    ops = []
    index = {}                    # position of an Alloc -> storage index
    for i, st in enumerate(storages):
        index.setdefault(st.created, []).append(i)
    for pos, (ph, e, mb) in enumerate(seq):
        if isinstance(e, Compute):
            for i in index.get(pos, ()):
                if allocs[i] is None:
                    continue
                role, saved = allocs[i]
                ops.append(("alloc", storages[i].nbytes, role, storages[i].count, saved))
            if ph is not None:
                ops.append(("mark", ph, e.node, (("transient", e.temp),), e.copy, mb))
        elif isinstance(e, Alloc):
            (i,) = index[pos]
            role, saved = allocs[i]
            ops.append(("alloc", e.nbytes, role, e.count, saved))
        elif isinstance(e, Free):
            ops.append(("free", e.nbytes, e.role, ONE))
        elif isinstance(e, Mark) and ph is not None:
            ops.append(("mark", e.phase, e.node, e.extra, e.copy, mb))
        elif isinstance(e, Begin):
            ops.append(("begin", e.block, e.copy, e.count))
        elif isinstance(e, End):
            ops.append(("end", e.block, e.copy))
        for i in frees.get(pos, ()):
            st = storages[i]
            times = _iterations(st.origin, context[pos], copies)
            ops.append(("free", st.nbytes, allocs[i][0], _times(st.count, times)))
        if pos == end_of_forward:
            ops.append(("end of forward",))
    return ops


def _times(x, y: sp.Expr) -> sp.Expr:
    """``x * y`` (``y`` a sympy number or expression), without sympy's call where either is 1
    (most storages' counts)."""
    if y is ONE and isinstance(x, sp.Basic):
        return x
    return y if x is ONE else x * y


def _iterations(origin, here, copies) -> sp.Expr:
    """How many storages one free of a storage made in ``origin`` (a block copy) stands for
    when it happens ``here``: inside the same block, one per iteration (the counting
    extrapolates the copy); outside it, the middle copy stands for ``count - 2`` iterations."""
    if origin is None or copies.get(origin[0], 0) < 3 or origin[1] != 2:
        return ONE
    if here is not None and here[0] == origin[0]:
        return ONE
    if here is not None:
        raise NotImplementedError(f"a storage of the middle iterations of block {origin[0]!r} freed "
                                  f"inside block {here[0]!r}")
    return sp.expand(sp.sympify(origin[2]) - 2)


# ----- counting -------------------------------------------------------------------------------
_LABELS = {"1": "first", "2": "second", "n-1": "second to last", "n": "last"}


class _Sum:
    """Bytes being added up: the products of symbols as :func:`~symmem.bounds.terms`, added
    with Python's numbers (linear in the additions, where a growing sympy ``Add`` is flattened
    again at each one: quadratic in a model written out layer by layer, as ResNet is), and
    any other part (none in the models so far) as a sympy sum. :meth:`expr` is the expanded
    sum, the same expression ``sp.expand`` gives, built once per change."""
    __slots__ = ("d", "rest", "_expr")

    def __init__(self, d: dict | None = None, rest: sp.Expr = ZERO):
        self.d = {} if d is None else d
        self.rest = rest
        self._expr = None

    @classmethod
    def of(cls, e) -> "_Sum":
        """The sum of one expression."""
        d = _terms_of(e)
        return cls(dict(d)) if d is not None else cls({}, e)

    def copy(self) -> "_Sum":
        out = _Sum(dict(self.d), self.rest)
        out._expr = self._expr
        return out

    def add(self, e, sign: int = 1) -> None:
        """Add (``sign`` 1) or subtract (-1) the expression ``e``."""
        d = _terms_of(e)
        if d is None:
            self.rest = self.rest + e if sign > 0 else self.rest - e
        else:
            _merge(self.d, d, sign)
        self._expr = None

    def expr(self) -> sp.Expr:
        if self._expr is None:
            base = from_terms(self.d)
            self._expr = base if self.rest is ZERO else sp.expand(base + self.rest)
        return self._expr

    def minus(self, other: "_Sum") -> "_Sum":
        d = dict(self.d)
        _merge(d, other.d, -1)
        return _Sum(d, self.rest - other.rest if (self.rest is not ZERO or other.rest is not ZERO) else ZERO)

    def affine(self, k, delta: "_Sum") -> "_Sum":
        """``self + k * delta`` for a count ``k`` (a number or an expression in the symbols)."""
        kd = _terms_of(k)
        if kd is None or delta.rest is not ZERO or self.rest is not ZERO:
            return _Sum.of(sp.expand(self.expr() + k * delta.expr()))
        d = dict(self.d)
        _merge(d, times_terms(kd, delta.d), 1)
        return _Sum(d)


def _last_run(p: Point, sums: dict, k, delta: dict, changed: list, label: str) -> Point:
    """The point ``p`` of a segment's first run, ``sums`` its roles' bytes (:class:`_Sum`), at
    the segment's last run: each role's bytes plus ``k`` times the role's change per
    iteration ``delta`` (``"total"``: the change of their sum). A role that does not change
    (``changed`` lists those that do) keeps its sum and its expression as they are; the total
    is the first run's plus ``k`` times the change of the total."""
    sums = dict(sums)
    for r in changed:
        sums[r] = sums[r].affine(k, delta[r])
    kd = _terms_of(k)
    if p.summed is not None and kd is not None and all(delta[r].rest is ZERO for r in changed):
        summed = dict(p.summed)          # every role a sum of products, and so are their changes
        _merge(summed, times_terms(kd, delta["total"].d), 1)
    else:
        summed = _summed(sums)
    return Point(p.phase, p.node, _Pending(sums), label, p.micro, summed=summed)


def _plus(d: dict | None, e) -> dict | None:
    """The terms ``d`` plus the expression ``e`` (a new dictionary; None where either is not a
    sum of products)."""
    de = _terms_of(e)
    if d is None or de is None:
        return None
    d = dict(d)
    _merge(d, de, 1)
    return d


def _summed(sums: dict) -> dict | None:
    """The terms of the sum of the roles' :class:`_Sum` ``sums`` (None where one has a part
    that is not a sum of products): a point's total, as :func:`~symmem.bounds.merged_terms`
    reads it off the parts."""
    out: dict = {}
    for s in sums.values():
        if s.rest is not ZERO:
            return None
        _merge(out, s.d, 1)
    return out


_TERMS_OF: dict = {}


def _terms_of(e) -> dict | None:
    """:func:`~symmem.bounds.terms` of ``e`` expanded (None: not a sum of products); kept
    per expression, as a step's allocations repeat their sizes."""
    if not isinstance(e, sp.Basic):
        e = sp.sympify(e)
    hit = _TERMS_OF.get(e, False)
    if hit is False:
        hit = terms(e) if e.is_Add or e.is_Mul or e.is_Symbol or e.is_Number else None
        if hit is None or any(not base.is_Symbol for key in hit for base, _ in key):
            hit = terms(sp.expand(e))       # a ceiling or a Max expanded inside, as expand does
        if len(_TERMS_OF) < 1 << 16:
            _TERMS_OF[e] = hit
    return hit


def _merge(d: dict, other: dict, sign: int) -> None:
    """``d += sign * other``, in place, terms of 0 dropped."""
    for key, c in other.items():
        v = d.get(key, 0) + (c if sign > 0 else -c)
        if v:
            d[key] = v
        else:
            d.pop(key, None)


class _Walk:
    def __init__(self):
        self.live = {r: _Sum() for r in ROLES}
        self.frozen: dict = {}     # role -> a copy of its live sum, while the sum stays as it is
        self.total = _Sum()        # the sum of every role's live bytes
        self.frozen_total = None   # its terms while they stay as they are (None: not taken)
        self.saved = _Sum()
        self.points: list[Point] = []
        self.requirements: list = []
        self.saved_at_end_of_forward = ZERO

    def run(self, ops):
        i = 0
        while i < len(ops):
            op = ops[i]
            if op[0] == "begin":
                copies, i = self._occurrence(ops, i)
                self._block(op[1], op[3], copies)
                continue
            self._apply(op, "")
            i += 1

    def _apply(self, op, label, out=None):
        kind = op[0]
        if kind == "alloc":
            _, nbytes, role, cnt, saved = op
            self._add(role, _allocation(nbytes, cnt), 1)
            if saved is not ZERO:
                self.saved.add(saved)
        elif kind == "free":
            _, nbytes, role, cnt = op
            self._add(role, _allocation(nbytes, cnt), -1)
        elif kind == "mark":
            _, phase, node, extra, _, micro = op
            acc = {r: self._frozen(r) for r in ROLES}
            summed = self._summed()
            for role, e in extra:
                if e is not ZERO and e != 0:
                    acc[role] = acc[role].copy()
                    acc[role].add(e)
                    summed = _plus(summed, e)
            point = Point(phase, node, _Pending(acc), label, micro, summed=summed)
            if out is None:
                self.points.append(point)
            else:                # a segment's point, with its roles' sums
                out.append((point, acc))
        elif kind == "end of forward":
            self.saved_at_end_of_forward = self.saved.expr()

    def _add(self, role: str, e, sign: int) -> None:
        """Add (``sign`` 1) or take away (-1) the bytes ``e`` of ``role``, and from the total."""
        self.live[role].add(e, sign)
        self.total.add(e, sign)
        self.frozen.pop(role, None)
        self.frozen_total = None

    def _summed(self) -> dict | None:
        """The terms of the live bytes of every role (None where a role has a part that is not
        a sum of products): one dictionary per change, shared by the points until then."""
        if self.frozen_total is None:
            plain = all(self.live[r].rest is ZERO for r in ROLES)
            self.frozen_total = (dict(self.total.d) if plain else None,)
        return self.frozen_total[0]

    def _frozen(self, role: str) -> "_Sum":
        """A copy of the role's live sum that nothing changes: one per change of the role, shared
        by the points until then (and so is its expression, built once when asked)."""
        snap = self.frozen.get(role)
        if snap is None:
            snap = self.frozen[role] = self.live[role].copy()
        return snap

    @staticmethod
    def _occurrence(ops, i):
        """The copies of one block from ops[i] on: [(copy, ops), ...] in execution order."""
        block = ops[i][1]
        copies = []
        while i < len(ops) and ops[i][0] == "begin" and ops[i][1] == block:
            copy, body = ops[i][2], []
            i += 1
            while not (ops[i][0] == "end" and ops[i][1] == block):
                body.append(ops[i])
                i += 1
            copies.append((copy, body))
            i += 1
        return copies, i

    def _block(self, block: str, n, copies):
        n = sp.sympify(n)
        if len(copies) < 3:       # a numeric count below three: every iteration written out
            for copy, body in copies:
                for op in body:
                    self._apply(op, "first" if copy == 1 else "last")
            return
        forward = copies[0][0] == 1
        # iterations in execution order: forward 1, 2..n-1, n; backward n, n-1..2, 1
        ranges = [("1", "1"), ("2", "n-1"), ("n", "n")] if forward else [("n", "n"), ("n-1", "2"), ("1", "1")]
        mults = [sp.Integer(1), n - 2, sp.Integer(1)]
        segs = []     # [signature, body, multiplicity, (first label, last label), fixed copies]
        for (copy, body), (a, z), m in zip(copies, ranges, mults):
            sig = _signature(body)
            if segs and segs[-1][0] == sig:
                segs[-1][2] += m
                segs[-1][3] = (segs[-1][3][0], z)
            else:
                segs.append([sig, body, m, (a, z)])
        walked = []
        for sig, body, m, (a, z) in segs:
            walked.append(self._segment(body, sp.expand(m), _LABELS[a], _LABELS[z]))
        self._check_small_counts(block, n, walked)

    def _segment(self, body, m, first_label, last_label):
        start = {r: self.live[r].copy() for r in ROLES}
        start_total = self.total.copy()
        start_saved = self.saved.copy()
        pts: list = []           # (point, its roles' sums)
        for op in body:
            self._apply(op, first_label, pts)
        delta = {r: self.live[r].minus(start[r]) for r in ROLES}
        d_total = self.total.minus(start_total)
        d_saved = self.saved.minus(start_saved)
        if m == 1:
            cands = [(p, "first run") for p, _ in pts]
        else:
            grows, shrinks = _grows_shrinks(list(delta.values()))
            changed = [r for r in ROLES if delta[r].d or delta[r].rest is not ZERO]
            cands = []
            for p, sums in pts:  # the first run's point, then the last run's, node by node
                if not grows:    # the first run can be the larger
                    cands.append((p, "first run"))
                if not shrinks or grows:
                    cands.append((_last_run(p, sums, m - 1, {**delta, "total": d_total}, changed, last_label),
                                  "last run"))
        self.points.extend(p for p, _ in cands)
        self.live = {r: start[r].affine(m, delta[r]) for r in ROLES}
        self.total = start_total.affine(m, d_total)
        self.frozen, self.frozen_total = {}, None
        self.saved = start_saved.affine(m, d_saved)
        return m, cands

    def _check_small_counts(self, block, n, walked):
        """A segment of ``n - c`` iterations has none at ``n <= c``: its points must then be
        below a point of another segment of the block, or ``n >= c + 1`` is required."""
        if n.is_number:       # a numeric count of three or more: every segment has an iteration
            return
        worst = 0
        for m, cands in walked:
            c = sp.expand(n - m)
            if not (c.is_Integer and c >= 1):
                continue
            if not self._harmless(n, int(c), m, cands, walked):
                worst = max(worst, int(c))
        if worst and not any(r[1] == n and r[0] >= worst + 1 for r in self.requirements):
            self.requirements.append(Requirement(
                sp.Integer(worst + 1), n, f"the block {block!r} treats its first or last iteration differently, "
                                          f"so its formulas hold from {worst + 1} iterations on"))

    @staticmethod
    def _harmless(n, c, m, cands, walked) -> bool:
        """At each count k <= c: is every point of the segment (which has no iteration then)
        at most some point of the block's other segments (the same node first)? The count is
        a symbol or an expression in one (``L - N``, ``L/K``).

        Where the count is linear in the symbol (``L``, ``L - 1``, ``L/4``: a pipeline stage's)
        and every point a sum of products (:func:`~symmem.bounds.terms`), the points are
        substituted, sampled and compared as dictionaries of terms: the same exact numbers as
        sympy's, without building an expression per point and count."""
        if len(n.free_symbols) != 1:
            return False
        (x,) = n.free_symbols
        slope, shift = sp.expand(n).coeff(x, 1), sp.expand(n).coeff(x, 0)
        mine = [p for p, _ in cands]
        if slope.is_Rational and slope > 0 and shift.is_Rational and sp.expand(n - slope * x - shift) == 0:
            every = {id(p): p.terms for _, cs in walked for p, _ in cs}
            if all(d is not None for d in every.values()):
                found = _harmless_terms(x, slope, shift, c, walked, mine, every)
                if found is not None:
                    return found
        for k in range(1, c + 1):
            roots = sp.solve(sp.Eq(n, k), x)
            if len(roots) != 1:
                return False
            at = {x: roots[0]}
            real = [p for mm, cs in walked if sp.sympify(mm).xreplace(at) >= 1 for p, _ in cs]
            exprs = [sp.expand(p.total.xreplace(at)) for p in real + mine]
            value = dict(zip(map(id, real + mine), exprs))
            sample = dict(zip(map(id, real + mine), samples(exprs)))
            for p in mine:
                same = [q for q in real if q.phase == p.phase and q.node == p.node]
                others = [q for q in real if q.phase == p.phase and q.node != p.node]
                tries = [q for q in same + others if all(x >= y for x, y in zip(sample[id(q)], sample[id(p)]))]
                if not any(provably_nonneg(value[id(q)] - value[id(p)]) for q in tries):
                    return False
        return True


class _Saved(_Walk):
    """A walk that keeps the bytes saved for backward only, and of them those saved outside
    every block (an op applied with no iteration label): no points, no checks."""

    def __init__(self):
        super().__init__()
        self.outside = self.outside_at_end_of_forward = ZERO

    def _apply(self, op, label, out=None):
        if op[0] == "alloc" and not label:
            self.outside += op[4]
        elif op[0] == "end of forward":
            self.outside_at_end_of_forward = self.outside
        if op[0] != "mark":
            super()._apply(op, label, out)

    def _segment(self, body, m, first_label, last_label):
        start = self.saved.copy()
        for op in body:
            self._apply(op, first_label)
        self.saved = start.affine(m, self.saved.minus(start))
        return m, []

    def _check_small_counts(self, block, n, walked):
        return


def _harmless_terms(x, slope, shift, c: int, walked, mine, every: dict) -> bool | None:
    """:meth:`_Walk._harmless` for a count ``slope * x + shift``, each point's total given as
    :func:`~symmem.bounds.terms` in ``every`` (by ``id``). The count is ``k`` at ``x = (k -
    shift) / slope``: below 1, the count cannot be so small (False: required); not whole,
    ``x`` (a whole number) never makes it ``k``. None when an atom of a point (a ceiling)
    holds ``x``: no shortcut then.

    The points are sampled with ``x`` at its value, each when a comparison first needs it,
    and a pair's difference substituted only where the samples allow it to be >= 0: the
    first point that bounds one of the segment's (most often the same node's) ends its
    search, where substituting and sampling every point first cost most of T5's check."""
    for k in range(1, c + 1):
        root = (k - shift) / slope
        if root < 1:
            return False
        if not root.is_Integer:
            continue
        at = {x: root}
        real = [p for mm, cs in walked if sp.sympify(mm).xreplace(at) >= 1 for p, _ in cs]
        keys = set().union(*(every[id(p)].keys() for p in real + mine))
        if any(_holds(key, x) for key in keys):     # an atom holds the count: no shortcut
            return None
        bases = {base for key in keys for base, _ in key}
        sample = _memo(sampler(sorted(set().union(*(base.free_symbols for base in bases)) - {x}, key=str),
                               {x: int(root)}), every)
        for p in mine:
            same = [q for q in real if q.phase == p.phase and q.node == p.node]
            others = [q for q in real if q.phase == p.phase and q.node != p.node]
            if not any(covers(sample(q), sample(p))
                       and terms_nonneg(substitute(_minus(every[id(q)], every[id(p)]), x, int(root)))
                       for q in same + others):
                return False
    return True


def _holds(key: frozenset, x) -> bool:
    """Does an atom of the product ``key`` (a ceiling) hold the symbol ``x``?"""
    return any(not base.is_Symbol and x in base.free_symbols for base, _ in key)


def _memo(sample, every: dict):
    """``sample`` of a point's terms (``every``, by ``id``), computed once per point."""
    done: dict = {}

    def of(p) -> tuple:
        hit = done.get(id(p))
        if hit is None:
            hit = done[id(p)] = sample(every[id(p)])
        return hit
    return of


def _grows_shrinks(parts: list) -> tuple[bool, bool]:
    """Is the sum of ``parts`` (one iteration's change of each role, :class:`_Sum`) provably
    >= 0, and provably <= 0? Decided on their terms where every part is a sum of products
    (no sympy sum built, no ``together`` of a ratio such as ``h/a``), else by
    :func:`~symmem.bounds.provably_nonneg`: the same answers."""
    if any(p.rest is not ZERO for p in parts):
        total = sp.Add(*(p.expr() for p in parts))
        return provably_nonneg(total), provably_nonneg(-total)
    d: dict = {}
    for p in parts:
        _merge(d, p.d, 1)
    return terms_nonneg(d), terms_nonneg({key: -c for key, c in d.items()})


_ALLOCATIONS: dict = {}


def _allocation(nbytes, cnt):
    """``nbytes * cnt``, built once per pair (a step frees and allocates the same sizes)."""
    if cnt == 1:
        return nbytes
    hit = _ALLOCATIONS.get((nbytes, cnt))
    if hit is None:
        hit = nbytes * cnt
        if len(_ALLOCATIONS) < 1 << 16:
            _ALLOCATIONS[nbytes, cnt] = hit
    return hit


def _minus(a: dict, b: dict) -> dict:
    out = dict(a)
    for key, v in b.items():
        out[key] = out.get(key, 0) - v
    return {k: v for k, v in out.items() if v != 0}


def _signature(body) -> tuple:
    """A copy's events byte for byte, without the names of its storages."""
    return tuple(op[:4] + op[5:] if op[0] == "mark" else op for op in body)
