"""Modules kept in float32 under autocast (``keep_fp32``): the seed's "fp32 for key layers".

A mixed-precision run can leave chosen modules out of autocast, as a model does by running
them under ``torch.autocast(device, enabled=False)`` (the output head and the loss of many
training scripts, the first and last layers where activations are largest in range). Their
operators then run in their inputs' dtypes: float32 weights, and float32 inputs where the
residual stream is float32 (GPT-2's is: its embeddings and residual sums are), so no weight
is cast and nothing is saved in half precision there.

:func:`prepare` marks the nodes of each named module (:func:`~symmem.passes.regions.in_module`)
``fp32=True``; layer ranges (``first:N``, ``last:N``) :mod:`symmem.passes.regions` has marked.
Tracing a marked node (:mod:`symmem.footprints`) and choosing its attention kernel
(:mod:`symmem.passes.attention`) use :meth:`~symmem.rules.Ctx.float32`: autocast off, float32
compute. The policy refuses ``keep_fp32`` without autocast (a pure-precision model has no
float32 weights to keep, and a module cast whole to float32 needs casts its code lacks).
"""
from __future__ import annotations

from ..errors import ConfigError
from ..graph import Graph
from .regions import in_module, mark, module_names

__all__ = ["prepare", "apply"]


def prepare(graph: Graph, policy) -> Graph:
    modules = [t for t in policy.keep_fp32 or () if ":" not in t]
    nodes = [n for g in graph.graphs() for n in g.items if hasattr(n, "op")]
    for m in modules:
        if not any(in_module(n, m) for n in nodes):
            names = module_names(graph)
            around = sorted({x.rsplit(".", 1)[0] for x in names if "." in x} | {r.name for r in graph.repeats()})
            raise ConfigError("keep_fp32", m, f"a module of {graph.name!r}: one of {', '.join(names)}, or one "
                              f"around them ({', '.join(around)})", "Name a module to keep in float32, e.g. "
                              f"{(graph.outputs or names)[-1].rsplit('/', 1)[-1]}.")
    if not modules:
        return graph
    return mark(graph, lambda node: any(in_module(node, m) for m in modules), fp32=True)


def apply(plan, graph, policy):
    """Nothing to rewrite in the plan: :func:`prepare` did it in the graph."""
    return plan
