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
``policy.quantize_skip`` names: a module (every linear layer in it, as transformers matches
``llm_int8_skip_modules``: :func:`~symmem.passes.regions.in_module`) or a layer range
(``first:N``, ``last:N``: :mod:`symmem.passes.regions` has split the repeated block there and
marked that part's nodes ``unquantized``). The LoRA pass then wraps the quantized layers as peft's ``lora.bnb``
layers do.
"""
from __future__ import annotations

from dataclasses import replace

import sympy as sp

from ..errors import ConfigError
from ..graph import Graph
from ..policy.quantize import INT4_BLOCK
from .regions import in_module, module_names

__all__ = ["prepare", "apply"]


def prepare(graph: Graph, policy) -> Graph:
    q = policy.quant
    if q.op is None:
        return graph
    modules = [t for t in policy.quantize_skip or () if ":" not in t]
    for m in modules:
        if not any(in_module(n, m) for g in graph.graphs() for n in g.items if getattr(n, "op", None) == "linear"):
            raise ConfigError("quantize_skip", m, f"a linear layer of {graph.name!r}: one of "
                              f"{', '.join(module_names(graph, ('linear',)))}", "Name a module to keep, e.g. c_proj.")
    heads = set(graph.outputs)

    def rewrite(node, sub: Graph) -> bool:
        if node.op != "linear" or node.name in heads or node.attr("unquantized"):
            return False
        if any(in_module(node, m) for m in modules):
            return False
        w = node.params[0]
        shape = tuple(reversed(w.shape)) if node.attr("conv1d") else w.shape
        weight = replace(w, shape=shape, trainable=False, dtype=q.name)
        attrs = tuple((k, v) for k, v in node.attrs if k != "conv1d")
        if q.name == "int4":
            attrs += (("block", INT4_BLOCK),)
        sub.items.append(replace(node, op=q.op, params=(weight,) + node.params[1:], attrs=attrs))
        sub._params[w.name] = weight
        widths.append(shape[1])
        return True

    widths = []
    out = graph.rewritten(rewrite)
    if q.name == "int8" and policy.device == "cuda":
        for width in dict.fromkeys(w for w in widths if not (sp.sympify(w) / 4).is_integer):
            out.require(4, width, "LLM.int8()'s cuBLASLt int8 product takes a multiple of 4 input features "
                                  "(bitsandbytes multiplies in float32 otherwise)", kind="divides")
    return out


def apply(plan, graph, policy):
    """Nothing to rewrite in the plan: :func:`prepare` did it in the graph."""
    return plan
