"""Quantized frozen weights (``--quantize int8|int4``): every linear layer but the output head
becomes bitsandbytes' layer, as transformers' ``replace_with_bnb_linear`` makes it for
``BitsAndBytesConfig(load_in_8bit=True)`` or ``(load_in_4bit=True, bnb_4bit_quant_type="nf4",
bnb_4bit_use_double_quant=True)`` (:class:`~symmem.policy.quantize.Quantization`).

:func:`prepare` rewrites each such ``linear`` node into ``linear_int8`` / ``linear_int4``
(:mod:`symmem.rules.quantized`) under the same name: its weight an (out, in) ``Param`` with
``dtype`` the format (a GPT-2 ``Conv1D``'s (in, out) weight is transposed, as transformers
does when it quantizes one), frozen; its bias as it was. A node that is one of the graph's
outputs (the language-model head, whose weight transformers keeps unquantized with the
weights tied to it: ``get_keys_to_not_convert``) stays, and so do those
``policy.quantize_skip`` names: a module (every linear layer whose module name ends with it,
as transformers' ``llm_int8_skip_modules``) or a layer range (``first:N``, ``last:N``: the
repeated block is split there, :meth:`~symmem.graph.Graph.split_layers`, and that part's
layers stay whole). The LoRA pass then wraps the quantized layers as peft's ``lora.bnb``
layers do.
"""
from __future__ import annotations

from dataclasses import replace

import sympy as sp

from ..errors import ConfigError
from ..graph import Graph
from ..policy.quantize import INT4_BLOCK
from .lora import module_of

__all__ = ["prepare", "apply"]


def _kept_layers(graph: Graph, ranges) -> tuple[Graph, tuple]:
    """The graph with its repeated block split where ``first:N`` ends and ``last:N`` begins
    (at N and at L - N, L staying a symbol), and the name prefixes of the parts whose layers
    stay unquantized."""
    if not ranges:
        return graph, ()
    reps = graph.repeats()
    if len(reps) != 1:
        raise ConfigError("quantize_skip", ",".join(ranges), "first:N or last:N of a model with one repeated block",
                          f"{graph.name!r} has {len(reps)}: name the modules to keep instead.")
    rep = reps[0]
    n = sp.sympify(rep.count)
    bound = sp.sympify(n.xreplace(graph.bindings))
    if not bound.is_Integer:
        raise ConfigError("quantize_skip", ",".join(ranges), "first:N or last:N of a block whose layer count "
                          f"is bound, not {n}", "Bind the layer count, or name the modules to keep.")

    def at(x):              # a layer index at this model's count
        return int(sp.sympify(sp.sympify(x).xreplace(graph.bindings)))

    spans = []
    for item in ranges:
        kind, k = item.split(":")
        if int(k) > bound:
            raise ConfigError("quantize_skip", item, f"at most the {bound} layers of block {rep.name!r}")
        spans.append((sp.Integer(0), sp.Integer(int(k))) if kind == "first" else (sp.expand(n - int(k)), n))
    cuts = {}
    for x in (x for span in spans for x in span):
        if 0 < at(x) < bound:
            cuts.setdefault(at(x), x)
    cuts = [cuts[v] for v in sorted(cuts)]
    bounds = [sp.Integer(0)] + cuts + [n]
    parts = list(zip(bounds, bounds[1:]))
    kept = [(a, z) for a, z in parts if any(at(lo) <= at(a) and at(z) <= at(hi) for lo, hi in spans)]
    if len(kept) == len(parts):                 # every layer stays whole
        return graph, (rep.name + "/",)
    return graph.split_layers(rep.name, cuts), tuple(Graph.part_name(rep.name, a, z, n) + "/" for a, z in kept)


def prepare(graph: Graph, policy) -> Graph:
    q = policy.quant
    if q.op is None:
        return graph
    skip = policy.quantize_skip or ()
    modules = [t for t in skip if ":" not in t]
    linear = {module_of(n) for g in graph.graphs() for n in g.items if getattr(n, "op", None) == "linear"}
    for m in modules:
        if not any(x == m or x.endswith("." + m) for x in linear):
            raise ConfigError("quantize_skip", m, f"a linear layer of {graph.name!r}: one of "
                              f"{', '.join(sorted(linear))}", "Name a module to keep, e.g. c_proj.")
    graph, kept = _kept_layers(graph, [t for t in skip if ":" in t])
    heads = set(graph.outputs)

    def rewrite(node, sub: Graph) -> bool:
        if node.op != "linear" or node.name in heads or (kept and node.name.startswith(kept)):
            return False
        if any(module_of(node) == m or module_of(node).endswith("." + m) for m in modules):
            return False
        w = node.params[0]
        shape = tuple(reversed(w.shape)) if node.attr("conv1d") else w.shape
        weight = replace(w, shape=shape, trainable=False, dtype=q.name)
        attrs = tuple((k, v) for k, v in node.attrs if k != "conv1d")
        if q.name == "int4":
            attrs += (("block", INT4_BLOCK),)
        sub.items.append(replace(node, op=q.op, params=(weight,) + node.params[1:], attrs=attrs))
        sub._params[w.name] = weight
        return True

    return graph.rewritten(rewrite)


def apply(plan, graph, policy):
    """Nothing to rewrite in the plan: :func:`prepare` did it in the graph."""
    return plan
