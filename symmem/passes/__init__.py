"""Passes: one technique each, rewriting the plan of a training step.

A pass is a module with two functions:

- ``prepare(graph, policy) -> Graph``: the graph the technique needs (recomputing K
  layers at a time groups them into one iteration; most passes return the graph as is);
- ``apply(plan, graph, policy) -> Plan``: the plan rewritten (and a line in ``plan.notes``).

:data:`PASSES` runs them in order; :func:`symmem.engine.estimate` calls :func:`prepare`
before lowering and :func:`run` after it. Later techniques (sharding, offload, pipeline
schedules, inference) are further modules here.
"""
from __future__ import annotations

from . import (accumulate, attention, context, expert, fp8, inference, keep_fp32, lora, pipeline, quantize, recompute,
               regions, shard, tensor)

__all__ = ["PASSES", "prepare", "run", "inference", "regions", "keep_fp32", "attention", "fp8", "quantize", "lora",
           "recompute", "accumulate", "expert", "context", "tensor", "shard", "pipeline"]

#: The passes, in the order they rewrite a graph and a plan: inference's step graph first (its
#: cache nodes and shapes are what the attention kernel then sees), the layer ranges (the
#: repeated block split once where any of them begins or ends), expert parallelism (a mixture
#: of experts' dispatch to E / e experts and back, in the graph), then the modules kept in
#: float32, the attention kernel (chosen in each node's dtype; recomputation sees the
#: kernel's operators), FP8 and quantized layers before the adapters that wrap them; context
#: parallelism (every activation of s / c positions, ring attention at the fused kernels) before
#: tensor parallelism (the layers split over t ranks, their parameters first) before sharding (data
#: parallelism, ZeRO, FSDP, offload) over the whole step of one rank; the pipeline last: its
#: stage is cut from the graph the others rewrote, and the micro-batches it holds in flight
#: are what that stage's step, every other pass applied, keeps for backward.
PASSES = (inference, regions, expert, keep_fp32, attention, fp8, quantize, lora, recompute, accumulate, context,
          tensor, shard, pipeline)


def prepare(graph, policy):
    """The graph after every pass's ``prepare``."""
    for p in PASSES:
        graph = p.prepare(graph, policy)
    return graph


def run(plan, graph, policy):
    """The plan after every pass's ``apply``."""
    for p in PASSES:
        plan = p.apply(plan, graph, policy)
    return plan
