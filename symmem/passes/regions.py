"""Regions a policy names: nodes by module, and a repeated block split at layer ranges.

Three parts of a policy name ranges of the model's repeated block (its layers):
``recompute`` (``last:N``: every layer but the last N; ``layers(a:z)``), ``quantize_skip``
and ``keep_fp32`` (``first:N``, ``last:N``: :mod:`symmem.policy.regions`). :func:`prepare`
splits the block once, before any other pass, at every point where one of them begins or
ends (:meth:`~symmem.graph.Graph.split_layers`; ``L`` may stay a symbol: the parts' order is
then a requirement), and marks each part with what holds for its layers:

- ``checkpoint=True`` on the part (:meth:`~symmem.graph.Graph.annotate_layers`), the layers
  the recompute pass checkpoints;
- ``unquantized=True`` on its nodes, left in the model's dtype by the quantize pass;
- ``fp32=True`` on its nodes, run with autocast off (:mod:`symmem.passes.keep_fp32`).

A block may have its layer 0 written out before it (T5: each stack's first block, which
computes the position bias; its nodes carry ``first_layer_of=<block>``, :func:`first_layer`):
``recompute``'s ranges then count that layer as layer 0 and the block's iterations as layers
1 to count, and mark its nodes ``checkpoint=True`` where the range holds it.

Splitting once lets the ranges combine (the first layer kept out of 4 bits while every
layer but the last two is recomputed). :func:`in_module` is how a module name selects nodes.
"""
from __future__ import annotations

import re
from dataclasses import replace

import sympy as sp

from ..errors import ConfigError
from ..graph import Graph

__all__ = ["prepare", "apply", "in_module", "module_names", "mark", "first_layer"]

#: the node attribute each region field sets on the layers it names
ATTRS = {"quantize_skip": "unquantized", "keep_fp32": "fp32"}


def _path(name: str) -> list[str]:
    """A node's module path: ``h[:1]/attn.c_attn`` -> ``[h, attn, c_attn]`` (a part's layer
    range dropped)."""
    return [p for p in re.split(r"[/.]", re.sub(r"\[[^\]]*\]", "", name)) if p]


def in_module(node, module: str) -> bool:
    """Is ``node`` in ``module``: do the dotted names of ``module`` occur in a row in the
    node's path (``attn`` and ``attn.c_attn`` hold ``h/attn.c_attn``; ``c_attn`` too)?"""
    want, have = module.split("."), _path(node.name)
    return any(have[i:i + len(want)] == want for i in range(len(have) - len(want) + 1))


def module_names(graph: Graph, ops=None) -> tuple[str, ...]:
    """The modules of the graph's nodes that hold parameters (of ``ops`` only, if given):
    ``attn.c_attn``, ``ln_f``. A region can also name a module around them (``attn``)."""
    return tuple(sorted({n.name.rsplit("/", 1)[-1] for g in graph.graphs() for n in g.items
                         if hasattr(n, "op") and n.params and (ops is None or n.op in ops)}))


def mark(graph: Graph, chosen, **attrs) -> Graph:
    """The graph with ``attrs`` added to every node ``chosen(node)`` accepts."""
    def rewrite(node, sub: Graph) -> bool:
        if not chosen(node):
            return False
        sub.items.append(replace(node, attrs=tuple(sorted({**dict(node.attrs), **attrs}.items()))))
        return True
    return graph.rewritten(rewrite)


def first_layer(graph: Graph, block: str) -> bool:
    """Is layer 0 of ``block`` written out before it (nodes with ``first_layer_of=block``)?"""
    return any(n.attr("first_layer_of") == block for n in graph.items if hasattr(n, "op"))


def mark_first_layer(graph: Graph, block: str) -> Graph:
    """The graph with the written-out layer 0 of ``block`` marked ``checkpoint=True``."""
    return mark(graph, lambda node: node.attr("first_layer_of") == block, checkpoint=True)


def _ranges(policy) -> list:
    """(field, item) of every layer range the policy names."""
    out = [(f, item) for f in ATTRS for item in (getattr(policy, f) or ()) if ":" in item]
    if policy.recompute.mode in ("last", "layers"):
        out.append(("recompute", str(policy.recompute)))
    return out


def _span(field: str, item: str, policy, n, bound, block: str, bindings: dict):
    """(start, stop) of the layers ``item`` of ``field`` names in a block of ``n`` layers
    (``bound``: ``n`` at the model's bindings, a number or an expression); None where it
    names no layer apart. (For a block with a written-out layer 0, ``n`` and ``bound`` count it.)"""
    numeric = bound.is_number
    if field == "recompute":
        spec = policy.recompute
        if spec.mode == "last":
            if numeric and spec.k > bound:
                raise ConfigError("recompute", item, f"last:N with N at most the {bound} layers of block "
                                  f"{block!r}", "Keep fewer layers, or use recompute=none.")
            return None if numeric and spec.k == bound else (sp.Integer(0), sp.expand(n - spec.k))
        start, stop = sp.Integer(spec.span[0]), sp.sympify(n if spec.span[1] is None else spec.span[1])
        if numeric and (sp.sympify(stop.xreplace(bindings)) > bound or start >= bound):
            raise ConfigError("recompute", item, f"layers within the {bound} layers of block {block!r}")
        return start, stop
    kind, k = item.split(":")
    if numeric and int(k) > bound:
        raise ConfigError(field, item, f"at most the {bound} layers of block {block!r}")
    return (sp.Integer(0), sp.Integer(int(k))) if kind == "first" else (sp.expand(n - int(k)), n)


def check_full_only(graph: Graph, policy) -> None:
    """A graph whose ``checkpointing`` is a string is modelled checkpointed with every layer
    checkpointed (``recompute="full"``) only, the string saying why (Qwen2's mixed layers,
    each checkpoint binding its layer's own mask: layer ranges and groups of layers are not
    measured)."""
    spec = policy.recompute
    if isinstance(graph.checkpointing, str) and spec.mode not in ("none", "nodes", "full"):
        raise ConfigError("recompute", str(spec), f"full or none for {graph.name!r}: {graph.checkpointing}",
                          "Use --recompute full (every layer checkpointed, as transformers' gradient "
                          "checkpointing does), or leave it out.")


def prepare(graph: Graph, policy) -> Graph:
    check_full_only(graph, policy)
    ranges = _ranges(policy)
    reps = graph.layer_blocks()
    named = [(f, i) for f, i in ranges if f != "recompute"]
    if named and len(reps) != 1:
        raise ConfigError(named[0][0], named[0][1], "a layer range of a model with one repeated block",
                          f"{graph.name!r} has {len(reps)}: name modules instead.")
    for rep in reps:        # recompute's ranges hold in each block
        graph = _split(graph, rep, ranges, policy)
    return graph


def _split(graph: Graph, rep, ranges, policy) -> Graph:
    """The graph with block ``rep`` split where ``ranges`` begin and end, each part marked."""
    n = sp.sympify(rep.count)
    bound = sp.sympify(n.xreplace(graph.bindings))

    def at(x):
        """A layer index as a number to order by: at this model's count, or at a count far
        above any range (a symbolic count: the parts' order becomes a requirement)."""
        v = sp.sympify(sp.sympify(x).xreplace(graph.bindings))
        return v if v.is_number else v.xreplace({sym: 10 ** 9 for sym in v.free_symbols})

    if first_layer(graph, rep.name):       # layer 0 written out: the ranges count it, the block is 1..n
        spans, rep_graph = [], graph
        for f, item in ranges:
            if f != "recompute":
                raise ConfigError(f, item, f"a layer range of a block without a written-out first layer "
                                  f"({rep.name!r} has one)", "Name modules instead.")
            s_ = _span(f, item, policy, sp.expand(n + 1), bound + 1, rep.name, graph.bindings)
            if s_ is None:
                continue
            if at(s_[0]) == 0:
                graph = mark_first_layer(graph, rep.name)
            lo, hi = (sp.Integer(max(int(s_[0]) - 1, 0)), sp.expand(s_[1] - 1))
            if at(lo) < at(hi):
                spans.append((f, (lo, hi)))
            elif not (hi - lo).is_number:      # layer 0 alone: the formulas hold while no other is in range
                graph = graph.rewritten(lambda node, sub: False) if graph is rep_graph else graph
                graph.require(hi, lo, f"{item} checkpoints layer 0 of block {rep.name!r} alone")
    else:
        spans = [(f, s) for f, item in ranges
                 if (s := _span(f, item, policy, n, bound, rep.name, graph.bindings)) is not None]
    if not spans:
        return graph
    top = at(n)
    cuts = {}
    for x in (x for _, span in spans for x in span):
        if 0 < at(x) < top:
            cuts.setdefault(at(x), x)
    cuts = [cuts[v] for v in sorted(cuts)]
    g = graph.split_layers(rep.name, cuts) if cuts else graph.rewritten(lambda node, sub: False)   # a copy
    bounds = [sp.Integer(0)] + cuts + [n]
    for a, z in zip(bounds, bounds[1:]):
        part = Graph.part_name(rep.name, a, z, n) if cuts else rep.name
        fields = {f for f, (lo, hi) in spans if at(lo) <= at(a) and at(z) <= at(hi)}
        if "recompute" in fields:
            g.annotate_layers(part, 0, None, checkpoint=True)
        attrs = {ATTRS[f]: True for f in fields if f in ATTRS}
        if attrs:
            g = mark(g, lambda node, p=part + "/": node.name.startswith(p), **attrs)
    return g


def apply(plan, graph, policy):
    """Nothing to rewrite in the plan: :func:`prepare` did it in the graph."""
    return plan
