"""Footprints in place: every node's rule applied to the tensors its inputs really are.

A rule (:mod:`symmem.rules`) gives a node's footprint from its inputs' shapes and dtypes
under a policy. :func:`trace` applies the rules in forward order and records, for each node,
where its inputs come from and which storage its output is (a view shares its input's).

A repeated block is traced as three copies: its first iteration (whose input comes from
outside and may have another dtype, e.g. a float32 embedding entering blocks that autocast
runs in bfloat16), a middle one and the last; a block of a numeric count below three is
traced whole. The middle copy must turn out alike the last (the same dtypes in and out),
or the block cannot be extrapolated and is refused with a fix. A first copy that differs
is recorded as a requirement (the formulas hold from two iterations on).

A node with the attribute ``autocast=False`` is traced with autocast off: the operators of
a kernel that autocast treats as one op (SDPA's math fallback runs inside
``scaled_dot_product_attention``, which autocast casts once at its entry). A node with
``fp32=True`` (a module kept in float32, :mod:`symmem.passes.keep_fp32`) is traced with
autocast off and float32 compute (:meth:`~symmem.rules.Ctx.float32`).

This module reads the graph through its attributes only, so the graph's own displays can
use it.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import sympy as sp

from .errors import ConfigError, ShapeError
from .requirements import Requirement
from .plan import Key
from .rules import Footprint, get_rule

__all__ = ["Instance", "Trace", "trace", "COPIES"]

#: A repeated block is traced as this many copies: first, middle, last.
COPIES = 3


@dataclass(frozen=True)
class Instance:
    """One node as traced: in ``copy`` 1..3 of a repeated block ``block``, or outside (0)."""
    node: object           # the graph's Node
    copy: int
    inputs: tuple          # ((value, copy), ...): where each input comes from
    params: tuple          # (Key("param", name, copy), ...): copy 0 for a weight outside the block
    fp: Footprint
    out: Key               # the storage of the output (an input's, for a view)
    block: str = ""

    @property
    def name(self) -> str:
        return self.node.name


@dataclass
class Trace:
    """The traced graph: ``order`` holds Instances and ``("begin" | "end", Repeat, copy)``
    markers in forward order; ``info`` and ``storage`` map (value, copy) to its tensor and
    its storage; ``copies``: a block's name -> the copies traced."""
    order: list = field(default_factory=list)
    info: dict = field(default_factory=dict)
    storage: dict = field(default_factory=dict)
    copies: dict = field(default_factory=dict)
    requirements: list = field(default_factory=list)
    outer: dict = field(default_factory=dict)     # a block's output name -> (body value, last copy)

    def instances(self):
        return [i for i in self.order if isinstance(i, Instance)]


def trace(graph, policy, strict: bool = True) -> Trace:
    """Every node's footprint under ``policy``, in forward order (see the module's text).
    ``strict``: refuse a block whose iterations stay unlike (a listing need not)."""
    t = Trace()
    _Tracer(t, policy.ctx(), strict).items(graph.items, 0, None)
    return t


class _Tracer:
    def __init__(self, t: Trace, ctx, strict: bool):
        self.t, self.ctx, self.strict = t, ctx, strict

    def where(self, value: str, copy: int, rep):
        """Where ``value``, read by a node of ``copy`` of ``rep``, is defined."""
        if rep is not None and value in rep.body._shapes:
            return value, copy
        return self.t.outer.get(value, (value, 0))

    def items(self, items, copy: int, rep):
        for item in items:
            if hasattr(item, "body"):
                self.repeat(item)
            else:
                self.node(item, copy, rep)

    def repeat(self, rep):
        t = self.t
        n = sp.sympify(rep.count)
        copies = int(n) if n.is_Integer and n < COPIES else COPIES
        dtypes = []
        t.copies[rep.name] = copies
        for c in range(1, copies + 1):
            t.order.append(("begin", rep, c))
            self.items(rep.body.items, c, rep)
            t.order.append(("end", rep, c))
            dtypes.append([(t.info[self.carried(rep, c, i)].dtype, t.info[(o, c)].dtype)
                           for i, o in enumerate(rep.output)])
        for name, o in zip(rep.names, rep.output):
            t.outer[name] = (o, copies)
        if copies < COPIES or not self.strict:
            return
        for (x1, y1), (x2, y2) in zip(*dtypes[:2]):
            if not self.ctx.same(x2, y2):
                raise ShapeError(rep.name, f"{self.dtype_name(y2)} out of the block",
                                 f"the dtype it receives ({self.dtype_name(x2)}) under this policy, even "
                                 "after its first iteration, so that iterations are alike. Unroll the graph "
                                 "(graph.unrolled()) to estimate it as it is")
            if not self.ctx.same(x1, y1):
                t.requirements.append(Requirement(
                    sp.Integer(2), rep.count, f"the block {rep.name!r} treats its first iteration differently "
                                              "(its input's dtype changes)"))
                break

    def dtype_name(self, d) -> str:
        return self.ctx.act_name if d == self.ctx.act else d.name

    def carried(self, rep, copy: int, i: int):
        """Where the ``i``-th carried value of ``copy`` of ``rep`` comes from."""
        if copy == 1:
            return self.t.outer.get(rep.carried[i], (rep.carried[i], 0))
        return rep.output[i], copy - 1

    def recorded(self, node, copy: int, rep):
        """Where a ``recorded`` node's value is: the same copy of the block it names, whose
        iterations this block's match one to one (the same count, traced as as many copies)."""
        block, value = node.attr("block"), node.attr("value")
        if rep is None or self.t.copies.get(block) != self.t.copies[rep.name] \
                or (value, copy) not in self.t.info:
            raise ConfigError("recorded value", value, f"a value of the block of layers {block!r}, traced "
                              f"before, whose iterations the loop {rep.name if rep else ''!r} walks one to one",
                              "Keep the block of layers whole: splitting or regrouping its layers (recompute "
                              "last:N, layers(...), every:K; pipeline stages) is not modelled with a loop "
                              "over them.")
        return value, copy

    def node(self, node, copy: int, rep):
        t = self.t
        if node.op == "carry" and rep is not None:
            inputs = (self.carried(rep, copy, node.attr("index", 0)),)
        elif node.op == "recorded":
            inputs = (self.recorded(node, copy, rep),)
        else:
            inputs = tuple(self.where(v, copy, rep) for v in node.inputs)
        ctx = self.ctx.float32() if node.attr("fp32") else self.ctx
        ctx = ctx if node.attr("autocast", True) else replace(ctx, autocast=False)
        fp = get_rule(node.op)(node, [t.info[i] for i in inputs], ctx)
        grad = not ctx.no_grad and (any(t.info[i].requires_grad for i in inputs)
                                    or any(p.trainable for p in node.params))
        if node.op in ("input", "carry"):
            pass
        elif grad and not fp.out.requires_grad and node.params:
            fp = replace(fp, out=replace(fp.out, requires_grad=True))
        elif not grad:    # autograd records nothing: what the op would save is made and dropped
            # (under torch.no_grad a Python number is never wrapped into a tensor to be saved)
            made = sum((sv.nbytes for sv in fp.saved if sv.ref == "new" and not sv.brief
                        and (sv.hooked or not ctx.no_grad)), sp.Integer(0))
            fp = replace(fp, out=replace(fp.out, requires_grad=False), saved=(), fwd_temp=fp.fwd_temp + made,
                         bwd_temp=sp.Integer(0), cast_back=(), reduced_params=())
        own = rep.body._params if rep is not None else {}
        params = tuple(Key("param", p.name, copy if p.name in own else 0) for p in node.params)
        out = t.storage[inputs[fp.alias]] if fp.alias is not None else Key("value", node.name, copy)
        t.info[(node.name, copy)] = fp.out
        t.storage[(node.name, copy)] = out
        t.order.append(Instance(node, copy, inputs, params, fp, out, rep.name if rep else ""))
