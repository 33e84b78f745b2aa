"""The training step as a walk over the graph: forward, backward, optimizer step.

The walk keeps the live storages in a :class:`Live` table (key -> bytes, count,
role) and records a :class:`Point` at every moment memory can peak: while each
node runs forward (its output, new saved tensors and scratch allocated, inputs
not yet freed), while each node runs backward (input and parameter gradients
allocated, saved tensors not yet released), and while the optimizer updates.

PyTorch eager semantics, in steady state (an iteration after the first, with
``zero_grad(set_to_none=True)``): parameters and optimizer state exist before
forward; a forward value is freed after its last use unless autograd saved it;
a saved tensor is released after the backward of the last node that saved it;
parameter gradients appear as backward reaches them and live until the next
``zero_grad``; the optimizer's temporaries exist only during its step.

A :class:`~symmem.graph.Repeat` of ``n`` iterations is walked once. Each
iteration leaves the same bytes behind (``D`` per iteration forward, ``Δ``
backward), so the live bytes at a point of iteration ``i`` are affine in ``i``
and their maximum over ``i`` is at the first or the last iteration: both are
candidates. This is exact: the unrolled graph gives the same maximum.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import sympy as sp

from .graph import Graph, Node, Repeat
from .policy import Policy
from .errors import ShapeError
from .rules import Footprint, TensorInfo, get_rule
from .symbols import B_g, B_m, B_o, B_w

__all__ = ["Point", "Walk", "walk", "ROLES"]

#: The roles every live byte belongs to, in display order.
ROLES = ("params", "master", "optimizer", "grads", "activations", "transient")
ZERO = sp.Integer(0)


@dataclass(frozen=True)
class Point:
    """Live memory at one moment of the step: bytes per role, and where it is."""
    phase: str            # "forward" | "backward" | "optimizer"
    node: str             # the node running (or the parameter being updated)
    parts: tuple          # ((role, bytes expr), …) in ROLES order
    iteration: str = ""   # "first" / "last" for points inside a Repeat

    @property
    def total(self) -> sp.Expr:
        return sp.Add(*(e for _, e in self.parts))

    @property
    def where(self) -> str:
        it = f" ({self.iteration} iteration)" if self.iteration else ""
        return f"{self.phase} {self.node}{it}"


class Live:
    """Live storages: key -> [bytes per storage, count, role]."""

    def __init__(self):
        self.entries: dict[str, list] = {}

    def add(self, key, nbytes, role, count=sp.Integer(1)):
        if key in self.entries:
            self.entries[key][1] += count
        else:
            self.entries[key] = [sp.sympify(nbytes), sp.sympify(count), role]

    def release(self, key, count=sp.Integer(1)):
        e = self.entries.get(key)
        if e is None:
            return
        e[1] = sp.expand(e[1] - count)
        if e[1] == 0:
            del self.entries[key]

    def drop(self, key):
        self.entries.pop(key, None)

    def parts(self, extra: dict | None = None) -> tuple:
        acc = {r: ZERO for r in ROLES}
        for nbytes, count, role in self.entries.values():
            acc[role] += nbytes * count
        for role, e in (extra or {}).items():
            acc[role] += e
        return tuple((r, sp.expand(acc[r])) for r in ROLES)

    def total(self) -> sp.Expr:
        return sp.expand(sum((n * c for n, c, _ in self.entries.values()), ZERO))


@dataclass
class Walk:
    """Everything the walk derives; :mod:`symmem.engine` turns it into an Estimate."""
    points: list = field(default_factory=list)
    saved_at_end_of_forward: sp.Expr = ZERO
    components: dict = field(default_factory=dict)
    graph: Graph | None = None        # the graph walked (a block may have been peeled)


# ----- preparation: tensor infos, footprints, storages, uses ---------------------------
class _DtypeChange(Exception):
    """A repeated block whose output dtype differs from its input's: iterations differ."""

    def __init__(self, rep: Repeat, got: str, out: str):
        super().__init__(rep.name)
        self.rep, self.got, self.out = rep, got, out


def _prepare(graph: Graph, policy: Policy) -> tuple[Graph, "_Prepared"]:
    """Prepare the walk; a block whose first iteration changes its input's dtype is peeled
    (its first iteration written out) once; a block that still differs is refused."""
    try:
        return graph, _Prepared(graph, policy)
    except _DtypeChange as first:
        peeled = graph.peeled(first.rep.name)
        try:
            return peeled, _Prepared(peeled, policy)
        except _DtypeChange as e:
            raise ShapeError(e.rep.name, f"{e.out} out of the block",
                             f"the dtype it receives ({e.got}) under this policy, even after its "
                             "first iteration, so that iterations are alike. Unroll the graph "
                             "(graph.unrolled()) to estimate it as it is") from None


class _Prepared:
    """Every node's footprint under a policy, its output's tensor info and storage, and who
    saves each storage. ``strict``: refuse a block whose output dtype differs from its
    input's (the walk needs iterations alike; a listing does not)."""

    def __init__(self, graph: Graph, policy: Policy, strict: bool = True):
        self.ctx, self.strict = policy.ctx(), strict
        self.nodes: dict[str, Node] = {}
        self.info: dict[str, TensorInfo] = {}
        self.fp: dict[str, Footprint] = {}
        self.storage: dict[str, str] = {}     # value -> storage key
        self.saved_by: dict[str, list] = {}   # storage key -> nodes that save it
        self._prepare(graph.items)

    def _prepare(self, items):
        for item in items:
            if isinstance(item, Repeat):
                self._prepare(item.body.items)
                x, y = self.info[item.carried], self.info[item.output]
                if self.strict and not self.ctx.same(x.dtype, y.dtype):
                    raise _DtypeChange(item, self._dtype_name(x.dtype), self._dtype_name(y.dtype))
                self.info[item.name] = self.info[item.output]
                self.storage[item.name] = self.storage[item.output]
                continue
            ins = [self.info[i] for i in item.inputs]
            fp = get_rule(item.op)(item, ins, self.ctx)
            if item.params and not fp.out.requires_grad:
                fp = replace(fp, out=replace(fp.out, requires_grad=True))
            self.fp[item.name] = fp
            self.nodes[item.name] = item
            self.info[item.name] = fp.out
            self.storage[item.name] = (self.storage[item.inputs[fp.alias]] if fp.alias is not None
                                       else item.name)
            for sv in fp.saved:
                self.saved_by.setdefault(self.saved_key(item, sv), []).append(item.name)

    def _dtype_name(self, d) -> str:
        return self.ctx.act_name if d == self.ctx.act else d.name

    def saved_key(self, node: Node, sv) -> str:
        if sv.ref.startswith("in"):
            return self.storage[node.inputs[int(sv.ref[2:])]]
        if sv.ref == "out":
            return self.storage[node.name]
        if sv.ref.startswith("cast:"):
            return sv.ref
        return f"{node.name}:{sv.label}"


def _uses(items) -> dict:
    """value -> index of the last item (in ``items``) that reads it."""
    last = {}
    for idx, item in enumerate(items):
        reads = (item.carried,) + item.externals if isinstance(item, Repeat) else item.inputs
        for v in reads:
            last[v] = idx
    return last


# ----- the walk -------------------------------------------------------------------------
def walk(graph: Graph, policy: Policy) -> Walk:
    """Walk one steady-state training step of ``graph`` under ``policy``."""
    graph, prep = _prepare(graph, policy)
    w = Walk(graph=graph)
    live = Live()
    _model_states(graph, policy, live, w)
    saved_keys = set(prep.saved_by)
    loss = graph.items[-1].name
    outputs = {loss, *graph.outputs}
    _forward(graph.items, prep, live, w, saved_keys, outputs, keep=set())
    for v in graph.outputs:           # the training loop keeps only the loss
        if prep.storage[v] not in saved_keys:
            live.release(prep.storage[v])
    w.saved_at_end_of_forward = sp.expand(sum(
        (n * c for n, c, r in live.entries.values() if r == "activations"), ZERO))
    grads: dict[str, str] = {}
    live.add(f"g:{loss}", prep.info[loss].nbytes, "transient")
    grads[loss] = f"g:{loss}"
    refs = {f"g:{loss}": 1}           # gradient storage -> values whose gradient it still is
    _backward(graph.items, prep, live, w, grads, refs, set(), policy)
    _optimizer(graph, policy, live, w)
    return w


def _model_states(graph, policy, live: Live, w: Walk):
    params = graph.params()
    N = sp.expand(sum((p.numel * m for p, m in params), ZERO))
    tensors = sp.expand(sum((m for _, m in params), ZERO))
    opt, prec = policy.opt, policy.prec
    w.components = {"params": N * B_w, "grads": N * B_g,
                    "master": N * B_m if prec.master else ZERO,
                    "optimizer": opt.states * N * B_o + (4 * tensors if policy.step_on_device else 0)}
    for p, m in params:
        live.add(f"param:{p.name}", p.numel * B_w, "params", m)
        if prec.master:
            live.add(f"master:{p.name}", p.numel * B_m, "master", m)
        if opt.states:
            live.add(f"state:{p.name}", opt.states * p.numel * B_o, "optimizer", m)
        if policy.step_on_device:
            live.add(f"step:{p.name}", 4, "optimizer", m)


def _forward(items, prep: _Prepared, live: Live, w: Walk, saved_keys, outputs, keep, label="",
             watch=None):
    last = _uses(items)
    holders: dict[str, int] = {}
    for v, st in prep.storage.items():
        if v in last:
            holders[st] = max(holders.get(st, -1), last[v])

    def maybe_free(value, idx):
        st = prep.storage[value]
        if st in saved_keys or value in outputs or st in keep:
            return
        if holders.get(st, -1) <= idx:
            live.release(st)               # one storage: a repeat's key may count several

    for idx, item in enumerate(items):
        if isinstance(item, Repeat):
            _forward_repeat(item, prep, live, w, saved_keys, outputs,
                            keep | {prep.storage[v] for v, i in last.items() if i > idx})
            for v in (item.carried,) + item.externals:
                if last.get(v) == idx:
                    maybe_free(v, idx)
            continue
        fp = prep.fp[item.name]
        act = "activations" if prep.storage[item.name] in saved_keys else "transient"
        if fp.alias is None:
            live.add(item.name, fp.out.nbytes, act)
        for sv in fp.saved:
            key = prep.saved_key(item, sv)
            if sv.ref == "new" or (sv.ref.startswith("cast:") and key not in live.entries):
                live.add(key, sv.nbytes, "activations")
        w.points.append(Point("forward", item.name, live.parts({"transient": fp.fwd_temp}), label))
        if watch is not None:             # is the watched storage alive at this point?
            watch[1].append(watch[0] in live.entries)
        for v in set(item.inputs):
            if last.get(v) == idx:
                maybe_free(v, idx)
        if item.name not in last:
            maybe_free(item.name, idx)


def _forward_repeat(rep: Repeat, prep, live: Live, w: Walk, saved_keys, outputs, keep):
    """Walk the body once (the first iteration) and derive the last from it.

    Iteration i >= 1 reads the previous iteration's output, which stays alive when autograd
    saved it ("kept"); the first reads the outer value x, which may be freed or kept
    independently. When both are kept or both freed, every iteration leaves the same bytes
    D and the last iteration is the first plus (n-1) D. When x is freed but later inputs are
    kept, each later iteration leaves D + |x| and holds |x| less at the points where the
    first still held x; that is exact too. (In the converse case, x kept by the outer graph
    while later inputs are freed, the last iteration is bounded by the first plus (n-1) D.)"""
    n = rep.count
    before = set(live.entries)
    start = live.parts()
    first = len(w.points)
    carried_st, out_st = prep.storage[rep.carried], prep.storage[rep.output]
    x_entry = list(live.entries.get(carried_st, (0, 0, "transient")))
    x_live: list[bool] = []
    _forward(rep.body.items, prep, live, w, saved_keys, outputs,
             keep | {prep.storage[e] for e in rep.externals}, label="first",
             watch=(carried_st, x_live))
    # Later iterations keep their input when the body saves it, either as its own output
    # (relu saves its result) or as the next iteration's input (layer_norm saves it).
    body = {node.name for node in rep.body.items}
    steady_kept = any(saver in body for saver in prep.saved_by.get(out_st, []) + prep.saved_by.get(carried_st, []))
    x_kept = carried_st in live.entries
    adjust = []
    if steady_kept and not x_kept:
        x_bytes, x_role = sp.expand(x_entry[0] * x_entry[1]), x_entry[2]
        per_iter = {x_role: x_bytes}
        adjust = [{x_role: -x_bytes} if alive else {} for alive in x_live]
    else:
        per_iter = {}
    _add_last_iteration(w, first, start, live.parts(), n, extra=per_iter, adjust=adjust)
    for key in set(live.entries) - before - {out_st}:
        live.entries[key][1] = live.entries[key][1] * n
    if steady_kept and out_st in live.entries:     # the outputs of all but the last iteration,
        live.add(_kept(rep), live.entries[out_st][0], "activations", n - 1)   # saved by the next


def _kept(rep: Repeat) -> str:
    """The key of a repeat's outputs that later iterations saved."""
    return f"{rep.name}:kept outputs"


def _add_last_iteration(w: Walk, first: int, start: tuple, end: tuple, n, labels=("first", "last"),
                        extra: dict | None = None, adjust: list | None = None):
    """Points of the walked iteration are at hand; those of the other end of the repeat
    add (n-1) x the bytes one iteration leaves behind, role by role (``extra``: what later
    iterations leave beyond the walked one; ``adjust``: a per-point correction)."""
    delta = {r: sp.expand(e - s + (extra or {}).get(r, 0)) for (r, e), (_, s) in zip(end, start)}
    body = w.points[first:]
    del w.points[first:]
    for j, p in enumerate(body):
        w.points.append(p)
        fix = adjust[j] if adjust else {}
        last = tuple((r, sp.expand(e + (n - 1) * delta[r] + fix.get(r, 0))) for r, e in p.parts)
        w.points.append(Point(p.phase, p.node, last, labels[1]))


def _backward(items, prep: _Prepared, live: Live, w: Walk, grads: dict, refs: dict, seen: set,
              policy, label="", remap=None):
    remap = remap or {}

    def hand(value, key):
        grads[value] = key
        refs[key] = refs.get(key, 0) + 1

    for item in reversed(items):
        if isinstance(item, Repeat):
            _backward_repeat(item, prep, live, w, grads, refs, seen, policy)
            continue
        g = grads.get(item.name)
        if g is None:
            continue                      # no gradient reaches this value
        fp = prep.fp[item.name]
        extra, news = sp.Integer(0), []
        for i, (v, mode) in enumerate(zip(item.inputs, fp.grads)):
            if mode is None or not prep.info[v].requires_grad:
                continue
            if v in grads:                # a second consumer: accumulated into the first
                extra += prep.info[v].nbytes if mode == "new" else 0
            elif mode == "pass":
                hand(v, g)
            else:                         # "new", or "slice" arriving first
                news.append((i, v))

        def allocate(late: bool):
            """The input and parameter gradients this node produces (late: those made by
            cast-back nodes after it)."""
            for i, v in news:
                if (i in fp.late_inputs) == late:
                    live.add(f"g:{v}", prep.info[v].nbytes, "transient")
                    hand(v, f"g:{v}")
            tied = sp.Integer(0)
            for p in item.params if fp.late_params == late else ():
                if p.name in seen:        # a tied weight: a second gradient, added in below
                    tied += p.numel * B_g
                else:
                    seen.add(p.name)
                    live.add(f"grad:{p.name}", p.numel * B_g, "grads")
            return tied

        tied = allocate(late=False)
        w.points.append(Point("backward", item.name,
                              live.parts({"transient": fp.bwd_temp + extra + tied}), label))
        refs[g] -= 1                      # the output's gradient has been used
        del grads[item.name]
        if refs[g] == 0:
            live.drop(g)
        for sv in fp.saved:               # autograd releases saved tensors after the node runs
            key = prep.saved_key(item, sv)
            if prep.saved_by[key][0] == item.name:
                live.release(remap.get(key, key))
        if fp.late_inputs or fp.late_params:
            tied += allocate(late=True)
            w.points.append(Point("backward", f"{item.name} (cast back)",
                                  live.parts({"transient": fp.bwd_temp + tied}), label))
        if tied != 0:                     # the engine sums the two gradients out of place
            w.points.append(Point("backward", f"{item.name} (tied gradient sum)",
                                  live.parts({"transient": 2 * tied}), label))


def _backward_repeat(rep: Repeat, prep: _Prepared, live: Live, w: Walk, grads, refs, seen, policy):
    n = rep.count
    grads[rep.output] = grads.pop(rep.name)
    carried_st = prep.storage[rep.carried]
    body_keys = set()
    for node in rep.body.items:
        if isinstance(node, Node):
            body_keys.add(node.name)
            body_keys.update(prep.saved_key(node, sv) for sv in prep.fp[node.name].saved
                             if sv.ref == "new" or sv.ref.startswith("cast:"))
    body_params = {p for p in rep.body._params}
    start = live.parts()
    first = len(w.points)
    _backward(rep.body.items, prep, live, w, grads, refs, seen, policy, label="last",
              remap={carried_st: _kept(rep)})
    _add_last_iteration(w, first, start, live.parts(), n, labels=("last", "first"))
    for key in body_keys | {_kept(rep)}:
        live.drop(key)
    if carried_st in prep.saved_by and prep.saved_by[carried_st][0] in body_keys:
        live.drop(carried_st)
    for name in body_params:
        if f"grad:{name}" in live.entries:
            live.entries[f"grad:{name}"][1] *= n


def _param_order(items, seen=None) -> list:
    """Parameters in the order the optimizer meets them; a repeated body's twice."""
    seen = set() if seen is None else seen
    out = []
    for item in items:
        if isinstance(item, Repeat):
            body = _param_order(item.body.items, set(seen))
            seen.update(p.name for p in body)
            out += body + body
        else:
            for p in item.params:
                if p.name not in seen:
                    seen.add(p.name)
                    out.append(p)
    return out


def _optimizer(graph: Graph, policy: Policy, live: Live, w: Walk):
    """The step's points. With a master copy, the gradients are first cast to the master
    dtype (one copy of all of them, held through the step) and the optimizer updates the
    master weights; their new values are then copied into the weights in place."""
    opt, impl = policy.opt, policy.impl
    if policy.prec.master:
        live.add("master grads", graph.param_count() * B_m, "transient")
    if impl == "for-loop" and opt.largest_temps:
        # Adam's loop keeps ``denom`` of the previous parameter while it computes this one's
        # sqrt and quotient: 2 x this parameter + 1 x the previous one, in parameter order
        # (the order of first use, as modules register them; a repeated block's order
        # repeats, so its last parameter precedes its first).
        seen = {}
        order = _param_order(graph.items)
        for prev, cur in zip([None] + order[:-1], order):
            temp = (opt.largest_temps * cur.numel + (opt.largest_temps - 1) * (prev.numel if prev else 0)) * B_o
            seen.setdefault(sp.expand(temp), cur.name)
        for temp, name in seen.items():
            w.points.append(Point("optimizer", name, live.parts({"transient": temp})))
    elif impl == "foreach" and opt.all_temps:
        temp = opt.all_temps * graph.param_count() * B_o
        w.points.append(Point("optimizer", "all parameters", live.parts({"transient": temp})))
    else:
        w.points.append(Point("optimizer", "all parameters", live.parts()))
