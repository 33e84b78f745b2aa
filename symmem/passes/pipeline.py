"""Pipeline parallelism: the plan of one pipeline stage, with the micro-batches in flight.

The layers are split over ``p`` stages (Huang et al. 2019, GPipe; Narayanan et al. 2021,
Megatron-LM's 1F1B and interleaved schedules). Rank ``r`` holds ``L / p`` layers; the first
also the embeddings, the last also the final norm, the output layer and the loss (a tied
output layer keeps its own copy of the embedding, as Megatron's ``shared_embedding`` does:
weight, gradient and optimizer states on both). A stage after the first receives the
previous stage's output (``b*s*h`` in the parameters' dtype, a leaf that requires grad)
and computes the masks and rotary tables its layers read; a stage before the last sends its
output on and frees it (Megatron's ``deallocate_pipeline_outputs``), and its backward starts
from the gradient it receives. The step runs ``m`` micro-batches (``microbatches``), as
gradient accumulation does (:mod:`symmem.passes.accumulate`).

What each schedule keeps, per rank (Megatron's ``forward_backward_pipelining_*``):

- **GPipe**: every micro-batch's forward, then every backward: ``m`` micro-batches in flight
  on every stage; no forward runs with gradients alive.
- **1F1B**: ``w = min(p - r - 1, m)`` warm-up forwards, then one forward and one backward in
  turn: ``min(p - r, m)`` micro-batches in flight on rank ``r`` (``p`` on the first where
  ``m >= p``), the steady forwards with the gradients alive.
- **Interleaved 1F1B** (``v`` virtual stages): each rank holds ``v`` chunks of ``L / (p v)``
  layers (chunk ``c`` is the model's stage ``c p + r``); ``2 (p - r - 1) + (v - 1) p`` warm-up
  chunk forwards, then one in turn: the first rank holds ``p v + p - 1`` chunks of
  activations, ``p (1 + (p - 1) / (p v))`` micro-batches' worth of its layers (Korthikanti
  et al. 2022, sec. 4.2.3). ``m`` must be a multiple of ``p``.

The plan counts one micro-batch's forward and backward through the stage (the chunks back to
back) with the others' saved tensors held beside it: ``(n - 1) * A`` bytes, ``A`` what one
micro-batch keeps for backward (the counted activations). Under the interleaved schedule
each chunk in flight counts its layers' share, ``A_layers / v``; the tensors saved outside
the layers (the embedding's, the masks') count with the first chunk (the output layer's
with the last), which is where the embedding runs (the masks are built once per chunk on
a real run: the difference is their bytes, per chunk in flight). Where every forward is a
warm-up one (GPipe, or ``m`` at most the warm-up), the later micro-batches' backwards run
with ``n - 2`` held and the gradients alive, and no forward runs with gradients.
"""
from __future__ import annotations

from dataclasses import replace

import sympy as sp

from ..counter import saved
from ..errors import ConfigError
from ..graph import Node, Repeat
from ..plan import LOOP, Alloc, Compute, Free, Key, Plan, Release
from .accumulate import SCALED_LOSS, loss_holder
from ..requirements import Requirement
from ..symbols import symbol

__all__ = ["prepare", "apply", "stage_graph", "in_flight", "active"]


def active(policy) -> bool:
    return policy.parallel.pp > 1


def prepare(graph, policy):
    """The graph of the policy's stage (``policy.stage``), or the model's without pipeline."""
    if not active(policy):
        return graph
    return stage_graph(graph, policy.parallel, policy.stage)


def in_flight(schedule: str, p: int, v: int, m: int, r: int) -> tuple[tuple, bool]:
    """(micro-batches in flight on rank ``r`` per chunk at its peak, whether a forward runs
    after the first backward), as Megatron's schedules order them: ``w`` warm-up forwards,
    then ``m - w`` times a forward and a backward (the first of those forwards still before
    any backward), then ``w`` backwards."""
    if schedule == "gpipe":
        return (m,), False
    if schedule == "1f1b":
        warm = min(p - r - 1, m)
        return (min(warm + 1, m),), m - warm >= 2
    total = m * v
    warm = min(2 * (p - r - 1) + (v - 1) * p, total)
    n, steady = min(warm + 1, total), total - warm >= 2
    counts = [0] * v
    for k in range(n):                        # forward k runs chunk (k mod p v) // p
        counts[(k % (p * v)) // p] += 1
    return tuple(counts), steady


def stage_graph(graph, par, r: int):
    """Rank ``r``'s part of ``graph``: ``L / p`` of the layers of its one repeated block, the
    nodes before the block on the first stage (the input the block carries received
    elsewhere), the nodes after it on the last."""
    p = par.pp
    blocks = graph.repeats()
    if len(blocks) != 1:
        raise ConfigError("pp", p, f"1 for {graph.name}: stages are cut from one repeated block of layers "
                          f"and it has {len(blocks)}", "Leave --pp out (a model of more or fewer blocks: an "
                          "encoder-decoder, a ResNet's stages, Mixtral's loop over its layers' router logits, is "
                          "not split into pipeline stages yet).")
    rep = blocks[0]
    i = graph.items.index(rep)
    if rep.layer_attrs:
        raise ConfigError("pp", p, f"1 for {graph.name}: its layers differ by range "
                          f"({', '.join(sorted({k for _, _, at in rep.layer_attrs for k, _ in at}))}), "
                          "which stages would cut", "Leave --pp out.")
    layers = p * par.virtual_stages
    count = sp.sympify(rep.count)
    n = sp.sympify(count.xreplace({symbol(k) if isinstance(k, str) else k: v for k, v in graph.bindings.items()}))
    if n.is_Integer and (n < layers or n % layers):
        what = "pipeline stages" if par.virtual_stages == 1 else "pipeline stages times virtual stages"
        fits = [d for d in range(1, p + 1) if n % (d * par.virtual_stages) == 0]
        raise ConfigError("pp", p, f"a divisor of the {n} layers of {graph.name} ({what}: {layers})",
                          "Each chunk of a stage holds the same whole number of layers; "
                          + (f"take --pp {fits[-1]}." if fits else "take --virtual-stages dividing the layers."))
    first, last = r == 0, r == p - 1
    block = replace(rep, count=sp.expand(count / p))
    items = list(graph.items[:i]) if first else _received(graph.items[:i], rep, middle=not last)
    items.append(block)
    if last:
        items += graph.items[i + 1:]
    items = _live(items, {n.name for n in graph.items[i + 1:]} if last else set())
    g = graph._copy(items)
    kept = {x for item in items for x in _names(item)}
    used = {q.name for item in items for q in _params(item)}
    g._params = {k: v for k, v in graph._params.items() if k in used}
    g.outputs = tuple(o for o in graph.outputs if o in kept) if last else (rep.name,)
    # what the model's code keeps until a node after the block: until the block returns where
    # that node is on a later stage
    g.locals = tuple((v, u if u in kept else rep.name) for v, u in graph.locals if v in kept)
    if not count.is_number:
        g.requirements = g.requirements + (Requirement(sp.Integer(layers), count,
                                                       f"{layers} pipeline chunks hold the same number of layers",
                                                       "divides"),)
    return g


def _received(pre: list, rep: Repeat, middle: bool) -> list:
    """The nodes before the block on a later stage: what the block carries in becomes an
    input received from the previous stage; a middle stage gets no batch (Megatron loads it
    on the first and the last), its masks and positions take the sizes only."""
    out = []
    for item in pre:
        if isinstance(item, Node) and item.name in rep.carried:
            item = Node(item.name, "input", (), attrs=(("dtype", "param"), ("received", True),
                                                       ("requires_grad", True), ("shape", item.shape)),
                        shape=item.shape)
        elif middle and isinstance(item, Node) and item.op == "input" and not item.attr("buffer"):
            item = replace(item, attrs=tuple(sorted({**dict(item.attrs), "dtype": "shape"}.items())))
        out.append(item)
    return out


def _live(items: list, after: set) -> list:
    """``items`` without the nodes before the block that nothing kept reads (``after``: the
    names of the nodes after it, kept; the model's buffers stay: every stage's copy of the
    model has them)."""
    needed = set()
    for item in items:
        if isinstance(item, Repeat):
            needed |= set(item.externals) | set(item.carried)
        elif item.name in after:
            needed |= set(item.inputs)
    out = []
    for item in reversed(items):
        if (isinstance(item, Node) and item.name not in after and item.name not in needed
                and not (item.op == "input" and item.attr("buffer"))):
            continue
        if isinstance(item, Node):
            needed |= set(item.inputs)
        out.append(item)
    return out[::-1]


def _names(item) -> tuple:
    return (item.name,) + tuple(item.names) if isinstance(item, Repeat) else (item.name,)


def _params(item):
    if isinstance(item, Repeat):
        return [q for sub in item.body.items for q in _params(sub)]
    return list(item.params)


def apply(plan: Plan, graph, policy) -> Plan:
    """The micro-batches in flight beside the one the plan runs; a stage before the last
    frees its output once sent."""
    if not active(policy):
        return plan
    par, r = policy.parallel, policy.stage
    p, v, m = par.pp, par.virtual_stages, par.microbatches
    counts, steady = in_flight(par.schedule, p, v, m, r)
    if r != p - 1:
        plan = _frees_output(plan)
    if r != 0:
        plan = _received_per_micro_batch(plan, graph)
    if r == p - 1 and plan.later:
        plan = _loss_dropped(plan)
    a_all, a_out = saved(plan)             # what the stage's own step keeps sizes what it holds
    a_layers = sp.expand(a_all - a_out)
    chunk_out = v - 1 if r == p - 1 and r != 0 else 0
    # the last stage's losses in flight too, each referenced until its backward
    loss = next((e.out_bytes + sum(n for _, n in e.new) for e in plan.forward
                 if isinstance(e, Compute) and e.node == SCALED_LOSS), 0)
    a_out = a_out + (loss if r == p - 1 else 0)
    a_all = a_all + (loss if r == p - 1 else 0)
    held = sp.expand(sum(((c - 1) * a_layers / v for c in counts), sp.Integer(0))
                     + (counts[chunk_out] - 1) * a_out)
    n = sum(counts)
    later_held = held if steady else sp.expand(held - a_all)
    forward = _holding(plan.forward, held, start=True)
    backward = _holding(plan.backward, held, start=False)
    later = tuple(replace(mb, forward=_holding(mb.forward, later_held, True), warmup=not steady,
                          backward=_holding(mb.backward, later_held, False)) for mb in plan.later)
    where = "first" if r == 0 else "last" if r == p - 1 else "middle"
    chunks = f" in {v} chunks" if v > 1 else ""
    note = (f"pipeline stage {r} of {p} ({where}; {par.schedule}, {m} micro-batch{'es' * (m != 1)}): "
            f"{graph.repeats()[0].count} layers{chunks}; {n}{f'/{v}' if v > 1 else ''} "
            f"micro-batch{'es' * (n != 1 or v > 1)} in flight"
            + ("" if steady else ", every forward before the first backward"))
    return replace(plan, forward=forward, backward=backward, later=later, notes=plan.notes + (note,))


_HELD = Key("value", "micro-batches in flight")


def _holding(events: tuple, held, start: bool) -> tuple:
    """``events`` with the other micro-batches' saved tensors alive through them."""
    if held == 0:
        return events
    if start:
        return (Alloc(_HELD, held, "activations"),) + tuple(events)
    return tuple(events) + (Free(_HELD, held, "activations"),)


def _received_per_micro_batch(plan: Plan, graph) -> Plan:
    """What a later stage receives is a micro-batch's own: made when its forward starts (the
    receive), let go of when its backward has sent the gradient back, none in the optimizer
    step (lowering allocates an input for the whole step)."""
    names = {n.name for n in graph.items if isinstance(n, Node) and n.attr("received")}
    allocs = [e for e in plan.states if isinstance(e, Alloc) and e.key.name in names]
    if not allocs:
        return plan
    frees = tuple(Free(e.key, e.nbytes, e.role) for e in allocs)
    return replace(plan, states=tuple(e for e in plan.states if e not in allocs),
                   forward=tuple(allocs) + plan.forward, backward=plan.backward + frees,
                   later=tuple(replace(mb, forward=tuple(allocs) + mb.forward, backward=mb.backward + frees)
                               for mb in plan.later))


def _loss_dropped(plan: Plan) -> Plan:
    """The last stage lets go of a micro-batch's loss once its backward has run (Megatron pops
    it from its outputs), not when the next micro-batch's replaces it."""
    labels = ["1"] + [mb.label for mb in plan.later]
    return replace(plan, backward=plan.backward + (Release(loss_holder(labels[0])),),
                   later=tuple(replace(mb, backward=mb.backward + (Release(loss_holder(mb.label)),))
                               for mb in plan.later))


def _frees_output(plan: Plan) -> Plan:
    """A stage before the last keeps no reference to its output once sent: the loop's hold
    on the plan's last value (a loss elsewhere) goes."""
    def drop(e):
        if isinstance(e, Compute) and any(h.holder == LOOP for h in e.holds):
            return replace(e, holds=tuple(h for h in e.holds if h.holder != LOOP))
        return e
    return replace(plan, forward=tuple(drop(e) for e in plan.forward),
                   later=tuple(replace(mb, forward=tuple(drop(e) for e in mb.forward)) for mb in plan.later))
