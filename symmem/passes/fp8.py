"""FP8 training with Transformer Engine (precision ``fp8``): every linear layer but the output
head becomes a ``te.Linear`` under ``te.autocast(recipe=DelayedScaling())`` on Hopper, as
Megatron-LM builds a GPT (its output layer stays in bfloat16).

:func:`prepare` rewrites each such ``linear`` node into ``linear_fp8``
(:mod:`symmem.rules.fp8`) under the same name, and adds what Transformer Engine keeps:

- per layer its scaling state (``DelayedScalingRecipeState``, transformer_engine/pytorch/
  quantization.py): for the 3 forward tensors (input, weight, output) and the 2 backward ones
  (output's and input's gradients) a float32 ``scale`` and an ``amax_history`` of
  ``amax_history_len`` rows (1024, the recipe's default; Megatron-LM sets 1):
  4 * 5 * (1024 + 1) = 20,500 bytes;
- once per device the cuBLAS workspace of its GEMMs, 32 MiB + 1024 bytes on compute
  capability 9 and later (``get_cublas_workspace_size_bytes``, cpp_extensions/gemm.py).
"""
from __future__ import annotations

from dataclasses import replace

import sympy as sp

from ..graph import Graph

__all__ = ["prepare", "apply", "AMAX_HISTORY", "META_BYTES", "WORKSPACE_BYTES"]

AMAX_HISTORY = 1024
#: a te.Linear's scaling state: (3 + 2) tensors x (scale + amax_history rows) x 4 bytes
META_BYTES = 4 * (3 + 2) * (AMAX_HISTORY + 1)
WORKSPACE_BYTES = 32 * 2**20 + 1024


def prepare(graph: Graph, policy) -> Graph:
    if not policy.prec.fp8:
        return graph
    heads = set(graph.outputs)

    def rewrite(node, sub: Graph) -> bool:
        if node.op != "linear" or node.name in heads:
            return False
        sub.buffer(f"{node.name}.fp8_meta", (sp.Integer(META_BYTES // 4),))
        sub.items.append(replace(node, op="linear_fp8", attrs=node.attrs + (("copies", 2),)))
        return True

    out = graph.rewritten(rewrite)
    out.buffer("te cublas workspace", (sp.Integer(WORKSPACE_BYTES // 4),))
    out.items.insert(0, out.items.pop())       # first: the graph's last node is its loss
    return out


def apply(plan, graph, policy):
    """Nothing to rewrite in the plan: :func:`prepare` did it in the graph."""
    return plan
