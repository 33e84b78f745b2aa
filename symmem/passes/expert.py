"""Expert parallelism: the plan of one of ``e`` ranks that split a mixture of experts' experts.

transformers 5's expert parallelism (``transformers/distributed/expert_parallel.py``; what
``from_pretrained(..., distributed_config=DistributedConfig(ep_size=e))`` applies to Mixtral's
``base_model_ep_plan``): the ``grouped_gemm`` style shards the experts' 3-D weights on their
first dimension (``E / e`` experts a rank: their weights, gradients and optimizer states), and
``ep_dispatch_experts`` runs ``AllToAllEP`` in training -- each rank sends every (token, expert)
pair of its batch to the rank holding the expert (an all-to-all of the rows), runs its experts
on the rows it receives, and sends the results back (a second all-to-all), where they are put
in order, weighted and summed (:func:`symmem.models.mixtral.ep_experts`, every tensor and its
lifetime). Each rank trains its own batch: the layers outside the experts are replicated (their
gradients all-reduced by the data-parallel wrapper, not counted here).

The rows a rank receives depend on the routing (transformers' ``AllToAllEP`` is dropless: no
capacity factor caps them): ``ep_load="balanced"`` (the default; every expert gets ``b s K / E``
pairs from each rank) gives ``R = b s K``; ``"worst"`` (every pair of every rank on one rank's
experts) gives that rank ``R = e b s K``. The degree stays the symbol ``e`` (bound where it is a number);
the formulas require ``e | E``. Measured on 2 and 4 CPU processes with gloo
(``tests/test_expert_measured.py``).

Beside FSDP (``--fsdp full|grad-op``, ``dp`` the ranks, ``e | d``): transformers'
``apply_fully_sharded_data_parallelism`` with torchtitan's units makes each layer's experts
module a unit of its own, sharded over the ``d / e`` ranks holding the same experts (the
``efsdp`` mesh), and the layers and the root units over all ``d``
(:mod:`symmem.passes.shard`). Under ``MixedPrecisionPolicy`` the experts' pre-forward casts
the float32 routing weights to the parameters' dtype (``cast_forward_inputs``; the combine
then runs in it): ``ep_experts(cast=True)``. Measured on 2 and 4 processes.

Refused beside tensor, context or pipeline parallelism, ZeRO, FSDP's hybrid shard or
offload, for models without experts, and in inference (the policy refuses a parallel layout
there).
"""
from __future__ import annotations

from ..errors import ConfigError
from ..symbols import E, e

__all__ = ["prepare", "apply"]


def prepare(graph, policy):
    """The graph with each mixture of experts' experts run as one of ``e`` ranks runs them."""
    if not policy.parallel.splits("ep"):
        return graph
    from ..models.mixtral import EXPERTS, EXPERTS_OUT, ep_experts
    par = policy.parallel
    ep = par.ep
    if not any(n.name == EXPERTS_OUT for n in graph.nodes()):
        raise ConfigError("ep", ep, f"1 for {graph.name}: it has no mixture of experts (Mixtral's, with the default "
                          "experts_implementation grouped_mm) to split", "Leave --ep out.")
    others = [name for name, on in (("--tp", not isinstance(par.tp, int) or par.tp > 1),
                                    ("--cp", not isinstance(par.cp, int) or par.cp > 1), ("--pp", par.pp > 1)) if on]
    if others:
        raise ConfigError("ep", ep, f"1 beside {', '.join(others)} (expert parallelism with them is not "
                          "modelled yet)", "Use --ep alone, beside --dp (DDP) or beside --fsdp full|grad-op.")
    if (par.sharded and par.fsdp not in ("full", "grad-op")) or par.offload != "none":
        raise ConfigError("ep", ep, "1 with ZeRO, FSDP's hybrid shard or offload (FSDP full and grad-op shard "
                          "are modelled beside it: each layer's experts a unit sharded over the dp / ep ranks "
                          "holding the same experts)", "Use --ep beside --dp (DDP) or --fsdp full|grad-op.")
    bound = graph.bindings.get(E)
    if isinstance(ep, int) and bound is not None and int(bound) % ep:
        raise ConfigError("ep", ep, f"a divisor of the {int(bound)} experts (num_local_experts)",
                          "Each rank holds E / ep whole experts.")

    def rewrite(node, sub) -> bool:
        if node.name == EXPERTS_OUT:
            ep_experts(sub, ep, worst=par.ep_load == "worst", cast=par.fsdp is not None and policy.fsdp_mixed)
            return True
        return node.name.startswith(EXPERTS)          # the experts' other nodes: removed

    out = graph.rewritten(rewrite)
    out.require(e, E, "each expert-parallel rank holds E / e whole experts", kind="divides")
    return out


def apply(plan, graph, policy):
    if not policy.parallel.splits("ep"):
        return plan
    from dataclasses import replace
    note = (f"expert parallel over e = {policy.parallel.ep} (transformers' AllToAllEP): E / e experts a rank, the "
            f"(token, expert) rows sent to their experts and back, {policy.parallel.ep_load} routing")
    return replace(plan, notes=plan.notes + (note,))
