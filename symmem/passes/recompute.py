"""Activation recomputation: ``torch.utils.checkpoint`` as a rewrite of the plan.

A checkpointed *region* is a run of consecutive nodes (a layer, K layers, an attention
core). What PyTorch does, measured (``tests/test_recompute_measured.py``):

- **forward**: the region runs without autograd keeping what its operators save (the
  checkpoint's saved-tensor hooks keep placeholders), so its values die at their last use;
  the checkpoint keeps the region's inputs instead (every tensor argument, the masks too)
  until the region's backward is over. A layer's keyword arguments (values whose node has
  ``layer_kwarg=True``: Llama's position ids, rotary tables and mask, which transformers'
  ``GradientCheckpointingLayer`` binds with ``functools.partial``) are kept as long, read by
  the layer or not (``layer_kwarg="read"``: a mask each layer is given its own of, Qwen2's
  full or sliding one, kept by the layers that read it), but not through the hooks: they are
  not counted as saved. Python
  numbers saved as 0-dim tensors bypass the hooks and stay (non-reentrant only: the
  reentrant variant runs the region under ``no_grad``).
- **backward**: when backward first needs one of the region's saved tensors (the region's
  last node to have a backward), the region runs again and everything its operators save
  is made again; the recomputed tensors are released node by node as backward proceeds,
  exactly as forward's would have been. The non-reentrant checkpoint stops recomputing as
  soon as the last saved tensor is made again (early stop: an op that saves only its
  inputs does not run its kernel); the reentrant one recomputes the whole region and holds
  its output, and the gradient it received for it, until the region's backward returns. The autocast weight cache is refilled
  during the recomputation and emptied after it.
- The RNG states the checkpoint stashes (5,056 bytes for the CPU generator, 16 per CUDA
  device) are host memory, not counted.

:func:`prepare` regroups the graph for ``every:K`` (K layers per iteration); for ``last:N``
and ``layers`` :mod:`symmem.passes.regions` splits the block; :func:`apply` rewrites the
plan's regions.
"""
from __future__ import annotations

from dataclasses import replace

import sympy as sp

from ..errors import ConfigError, UnknownName
from ..graph import Graph
from ..plan import (AUTOGRAD, CACHE, CHECKPOINT, LOCAL, Backward, Begin, Compute, End, Free, Hold, Key, Mark,
                    Plan, Release)
from .regions import check_full_only, first_layer, mark_first_layer

__all__ = ["prepare", "apply", "regions"]

#: The attribute a model gives the nodes of its attention core (``selective``).
TAG = ("recompute", "attention")


def prepare(graph: Graph, policy) -> Graph:
    """The graph the regions are cut from: K layers per iteration for ``every:K`` and
    ``nth:K`` (whose regions are the first layer of each iteration). (For
    ``last:N`` and ``layers``, :mod:`symmem.passes.regions` has split each repeated block where
    the recomputed layers start and end and annotated their part ``checkpoint=True``.) A block
    whose layer 0 is written out (``first_layer_of``, T5's stacks) counts it under ``nth:N``:
    it is marked ``checkpoint=True``, the block's iterations are layers 1 to count (the first
    N - 1 kept, the others grouped N at a time); ``every:K`` is refused there."""
    spec = policy.recompute
    if spec.mode not in ("none", "nodes"):
        graph = _grad_when_checkpointed(graph, policy)
    check_full_only(graph, policy)
    if spec.mode not in ("none", "nodes") and not graph.checkpointing:
        raise ConfigError("recompute", str(spec), f"none for {graph.name!r}: its implementation has no gradient "
                          "checkpointing (transformers' ResNet does not support it; torchvision's checkpoints nothing)",
                          "Leave --recompute out, or name the nodes you checkpoint yourself (Recompute.nodes(...)).")
    if spec.mode not in ("every", "nth"):
        return graph
    if spec.mode == "nth" and not graph.layer_blocks():
        raise ConfigError("recompute", str(spec), "a model with a repeated block of layers",
                          "Use Recompute.layers(...) or Recompute.nodes(...) on an unrolled graph.")
    for rep in graph.layer_blocks():
        lead = first_layer(graph, rep.name)
        if lead and spec.mode == "every":
            raise ConfigError("recompute", str(spec), f"full or nth:N for {graph.name!r}: layer 0 of block "
                              f"{rep.name!r} is written out, so K consecutive layers are not one block's "
                              "iterations (every:K is not modelled)", "Use --recompute full, or nth:N.")
        count = sp.expand(rep.count + 1) if lead else sp.sympify(rep.count)
        bound = sp.sympify(count.xreplace(graph.bindings))
        if bound.is_Integer and int(bound) % spec.k:
            divisors = [f"{spec.mode}:{d}" for d in range(1, int(bound) + 1) if int(bound) % d == 0]
            raise ConfigError("recompute", str(spec), f"{spec.mode}:K with K dividing the {bound} layers of block "
                              f"{rep.name!r}" + (" (its written-out first layer included)" if lead else ""),
                              f"For example {', '.join(divisors)}.")
        if not lead:
            graph = graph.grouped(rep.name, spec.k)
            continue
        # nth:N with layer 0 written out (checkpointed, one region) and the block's iterations
        # layers 1 to count: layers 1 to N - 1 keep their activations, the rest (a multiple of
        # N) grouped N at a time, the first of each group checkpointed
        graph = mark_first_layer(graph, rep.name)
        if spec.k == 1:
            graph = graph.grouped(rep.name, 1)
        elif bound == spec.k:      # layer 0 only: the formulas hold for N layers, no more
            why = f"nth:{spec.k} checkpoints layer 0 of block {rep.name!r} alone: the formulas hold for {spec.k} layers"
            graph.require(count, spec.k, why)
            graph.require(spec.k, count, why)
        else:
            graph = graph.split_layers(rep.name, [spec.k - 1])
            graph = graph.grouped(graph.part_name(rep.name, spec.k - 1, rep.count, rep.count), spec.k)
    return graph


def _grad_when_checkpointed(graph: Graph, policy) -> Graph:
    """Nodes with ``grad_when_checkpointed=True`` get ``requires_grad=True``: a tensor the
    model's code makes a leaf that requires grad when its layers are checkpointed (T5's
    cross-attention zero bias: ``position_bias.requires_grad = True`` under
    ``gradient_checkpointing``; with ``grad_kept=False`` under the reentrant checkpoint, which
    makes the tensor under ``no_grad``: its gradient is made, but no ``.grad`` kept), not under
    ``selective`` (no layer checkpointed: the model's
    flag stays off). Such a node's ``checkpoint_check`` (a function of the graph, after the
    attention pass, and the policy) refuses what is not modelled, ``selective`` included."""
    marked = [n for n in _nodes(graph).values() if n.attr("grad_when_checkpointed")]
    if not marked:
        return graph
    for check in dict.fromkeys(n.attr("checkpoint_check") for n in marked if n.attr("checkpoint_check")):
        check(graph, policy)
    if policy.recompute.mode == "selective":
        return graph

    def rewrite(node, sub) -> bool:
        if not node.attr("grad_when_checkpointed"):
            return False
        extra = {"requires_grad": True, **({"grad_kept": False} if policy.recompute.reentrant else {})}
        sub.items.append(replace(node, attrs=tuple(sorted({**dict(node.attrs), **extra}.items()))))
        return True
    return graph.rewritten(rewrite)


def regions(plan: Plan, graph: Graph, spec) -> list[list[int]]:
    """The regions the spec checkpoints: each a list of positions in ``plan.forward`` of
    consecutive :class:`Compute` events of one layer (a copy of a repeated block, or the
    nodes of an unrolled graph with the same ``layer`` attribute)."""
    nodes = _nodes(graph)
    fwd = plan.forward
    layer = _layers(fwd, nodes)
    if spec.mode == "nodes":
        missing = [n for n in spec.names if n not in nodes]
        if missing:
            raise UnknownName("node to recompute", missing[0], tuple(nodes))
        return _runs(fwd, layer, lambda e: e.node in spec.names)
    if spec.mode == "selective":
        tagged = {n for n, node in nodes.items() if node.attr(TAG[0]) == TAG[1]}
        if not tagged:
            raise ConfigError("recompute", "selective", "a model that tags its attention core "
                              f"({TAG[0]}={TAG[1]!r})", "Use recompute=full, or Recompute.nodes(...).")
        return _runs(fwd, layer, lambda e: e.node in tagged)
    if spec.mode == "nth":     # the first layer of each group of N (prepare grouped them)
        def first(e):          # (or a written-out layer 0 prepare marked)
            node = nodes.get(e.node)
            if node is not None and node.attr("layer") is not None and node.attr("checkpoint") is True:
                return True
            return layer[id(e)] is not None and isinstance(layer[id(e)][0], str) and bool(layer[id(e)][0]) \
                and e.node.startswith(f"{layer[id(e)][0]}/0/")
        return _runs(fwd, layer, first)
    marked = {rep.name for rep in graph.layer_blocks() if spec.mode in ("full", "every") or rep.layers_with("checkpoint")}

    def chosen(e):
        if layer[id(e)] is None:
            return False
        if isinstance(layer[id(e)][0], str) and layer[id(e)][0] in marked:
            return True
        node = nodes.get(e.node)
        return node is not None and node.attr("layer") is not None and (
            spec.mode in ("full", "every") or node.attr("checkpoint") is True)
    return _runs(fwd, layer, chosen)


def _layers(fwd, nodes) -> dict:
    """id(Compute) -> its layer: (block, copy) inside a copy of a repeated block, ("", name)
    for a node of an unrolled layer, None outside any layer."""
    out, block = {}, None
    for e in fwd:
        if isinstance(e, Begin):
            block = (e.block, e.copy)
        elif isinstance(e, End):
            block = None
        elif isinstance(e, Compute):
            node = nodes.get(e.node)
            unrolled = node.attr("layer") if node is not None else None
            out[id(e)] = block if block is not None else (("", unrolled) if unrolled else None)
    return out


def _nodes(graph: Graph) -> dict:
    out = {}
    for item in graph.items:
        if hasattr(item, "body"):
            out.update(_nodes(item.body))
        else:
            out[item.name] = item
    return out


def _runs(fwd, layer: dict, inside) -> list[list[int]]:
    """Maximal runs of consecutive Computes of one layer that satisfy ``inside``."""
    out, run = [], []
    for i, e in enumerate(fwd):
        if not isinstance(e, Compute):
            continue                          # a release of a local does not end a run
        ok = inside(e)
        if ok and run and layer[id(fwd[run[-1]])] == layer[id(e)]:
            run.append(i)
            continue
        if run:
            out.append(run)
        run = [i] if ok else []
    if run:
        out.append(run)
    return out


def apply(plan: Plan, graph: Graph, policy) -> Plan:
    spec = policy.recompute
    if spec.mode == "none":
        return plan
    fwd, bwd = list(plan.forward), list(plan.backward)
    casts = {k: nb for e in fwd if isinstance(e, Compute) for k, nb in e.new if k.kind == "cast"}
    found = regions(plan, graph, spec)
    # what a layer's checkpoint receives as keyword arguments (transformers binds them with
    # functools.partial): kept, not saved through the hooks
    # (layer_kwarg="read": a mask each layer is given its own of, Qwen2's full or sliding one:
    # kept by the layers that read it)
    keywords = ({name for name, node in _nodes(graph).items() if node.attr("layer_kwarg")}
                if spec.mode in ("full", "every", "nth", "last", "layers") else set())
    own = {name for name in keywords if _nodes(graph)[name].attr("layer_kwarg") == "read"}
    for n, region in enumerate(found):
        _checkpoint(fwd, bwd, region, f"{CHECKPOINT}{n}", spec.reentrant, casts, keywords, own)
    note = (f"recompute {spec}: {len(found)} region{'s' * (len(found) != 1)} checkpointed "
            f"({'reentrant' if spec.reentrant else 'non-reentrant'})")
    return replace(plan, forward=tuple(fwd), backward=tuple(bwd), notes=plan.notes + (note,))


def _autograd(e: Compute) -> str:
    return AUTOGRAD + (f"{e.node}#{e.copy}" if e.copy else e.node)


def _checkpoint(fwd: list, bwd: list, region: list[int], holder: str, reentrant: bool, casts: dict,
                keywords=frozenset(), own=frozenset()):
    computes = [fwd[i] for i in region]
    made = {k for e in computes for k in ([e.out] if e.out else []) + [k for k, _ in e.new]}
    inputs = list(dict.fromkeys(k for e in computes for k in e.reads if k not in made))
    later = {k for e in fwd[region[-1] + 1:] if isinstance(e, Compute) for k in e.reads}
    outputs = [k for k in dict.fromkeys(made) if k in later]
    names = {(e.node, e.copy) for e in computes}
    hooked = {(e.node, e.copy) for e in computes
              if any(h.holder == _autograd(e) and h.key.kind != "scalar" for h in e.holds)}
    groups = [j for j, e in enumerate(bwd) if isinstance(e, Backward) and (e.node, e.copy) in names]
    if not groups:
        return                                # no gradient reaches the region: nothing to recompute
    if not hooked and not reentrant:
        return      # nothing saved through the hooks: the frame (and its inputs) dies with forward
    # forward: autograd keeps nothing of the region (but unhooked scalars, non-reentrant);
    # the checkpoint keeps the region's inputs
    for i in region:
        e = fwd[i]
        holds = tuple(h for h in e.holds if h.holder != _autograd(e)
                      or (h.key.kind == "scalar" and not reentrant))
        if reentrant:        # under no_grad no Python number is saved: none is made for autograd
            e = replace(e, new=tuple(x for x in e.new if x[0].kind != "scalar"))
        fwd[i] = replace(e, holds=holds)
    first = fwd[region[0]]
    bound = holder.replace(CHECKPOINT, "checkpointed function's keywords: ")
    inputs += [k for k in (Key("value", name) for name in sorted(keywords - own)) if k not in inputs]
    fwd[region[0]] = replace(first, holds=first.holds + tuple(Hold(k, bound if k.name in keywords else holder)
                                                              for k in inputs))
    # backward: the region again before its backward needs it; the checkpoint lets
    # go of the inputs after the last node that saved through its hooks (reentrant: after
    # the whole region, when CheckpointFunction's backward returns, with the recomputed output)
    # the Python locals the region's code lets go of after each of its nodes
    let_go = [[e for e in fwd[i + 1:j] if isinstance(e, Release) and e.holder.startswith(LOCAL)]
              for i, j in zip(region, region[1:] + [region[-1] + 1])]
    redo = _recomputation(computes, holder, reentrant, casts, outputs, let_go)
    if not reentrant:        # a recomputed tensor, once unpacked, lives only as long as the node's
        for j in groups:     # kernels: it is gone before the engine sums a bias's gradient
            bwd[j] = _released_with_the_kernels(bwd[j])
    savers = [j for j in groups if reentrant or (bwd[j].node, bwd[j].copy) in hooked]
    end = max(savers or groups)               # backward runs the groups in this order
    releases = [Release(holder), Release(bound)] + ([Release(holder + " output")] if reentrant else [])
    if reentrant:        # CheckpointFunction.backward holds the outputs' gradients until it returns
        makers = {(e.node, e.copy) for e in computes if e.out in outputs}
        grads = {bwd[j].grad for j in groups if (bwd[j].node, bwd[j].copy) in makers}
        for j in groups:
            kept = [e for e in bwd[j].events if isinstance(e, Free) and e.key in grads]
            if kept:
                bwd[j] = replace(bwd[j], events=tuple(e for e in bwd[j].events if e not in kept))
                releases += kept
    bwd[end + 1:end + 1] = releases
    # reentrant: CheckpointFunction.backward recomputes before any of the region's backward;
    # non-reentrant: the first unpack of a hooked saved tensor does, so the backward of nodes
    # that saved nothing through the hooks (a residual add, x * 0.125) runs before it
    start = min(groups if reentrant else savers)
    bwd[start:start] = redo


def _released_with_the_kernels(group: Backward) -> Backward:
    """The node's backward with autograd's release moved to just after its main mark."""
    events = list(group.events)
    release = [e for e in events if isinstance(e, Release)]
    marks = [i for i, e in enumerate(events) if isinstance(e, Mark)]
    if not release or not marks:
        return group
    events.remove(release[0])
    events.insert(marks[0] + 1, release[0])
    return replace(group, events=tuple(events))


def _recomputation(computes: list, holder: str, reentrant: bool, casts: dict, outputs: list, let_go: list) -> list:
    """The region's Computes as backward runs them again: autograd holds what they save
    (the Python numbers aside: the recomputation's own graph is thrown away), the autocast
    cache holds the weights it casts again until the recomputation ends, and the code's Python
    locals hold their values as in forward (``let_go``: the releases after each Compute) until
    they are let go of or the recomputation ends."""
    cache = f"{CACHE} ({holder})"

    def again(name):
        return f"{name} ({holder})"
    out, cast_seen = [], set()
    for e in computes:
        keep = tuple(h for h in e.holds if h.holder == _autograd(e) and h.key.kind != "scalar")
        new = [(k, nb) for k, nb in e.new if k.kind != "cast"]
        used = [k for k, _ in e.new if k.kind == "cast"] + [h.key for h in keep if h.key.kind == "cast"]
        for k in dict.fromkeys(used):
            if k not in cast_seen:
                cast_seen.add(k)
                new.append((k, casts[k]))
                keep += (Hold(k, cache),)
        keep += tuple(Hold(h.key, again(h.holder)) for h in e.holds if h.holder.startswith(LOCAL))
        out.append(replace(e, node=f"{e.node} (recomputed)", new=tuple(new), holds=keep))
    if reentrant:        # CheckpointFunction.backward holds the outputs until it returns
        out[-1] = replace(out[-1], holds=out[-1].holds + tuple(Hold(k, holder + " output") for k in outputs))
    else:
        out = _early_stop(out, computes)
    held = dict.fromkeys(h.holder for e in out for h in e.holds if h.holder.startswith(LOCAL))
    woven = [x for e, gone in zip(out, let_go) for x in (e, *(Release(again(r.holder)) for r in gone))]
    return woven + [Release(h) for h in held] + [Release(cache)]


def _saves(e: Compute) -> bool:
    """Does the recomputed ``e`` keep anything for backward (a Python local aside)?"""
    return any(not h.holder.startswith(LOCAL) for h in e.holds)


def _early_stop(redo: list, computes: list) -> list:
    """Cut the recomputation where the last saved tensor is made again. An op whose saved
    tensors all exist before its kernel (inputs, casts, copies) is stopped before the kernel:
    no output. What later ops would read stays referenced until the stop."""
    last = max((i for i, e in enumerate(redo) if _saves(e)), default=None)
    if last is None:
        return []
    e = redo[last]
    after = bool(e.out and any(h.key == e.out and not h.holder.startswith(LOCAL) for h in e.holds)) \
        or any(k in e.late for k, _ in e.new)
    if not after:
        e = replace(e, out=None, out_bytes=sp.Integer(0), new=tuple(x for x in e.new if x[0] not in e.late),
                    temp=sp.Integer(0), holds=tuple(h for h in e.holds if h.key != e.out))
    made = {k for x in redo[:last] + [e] for k in ([x.out] if x.out else []) + [k for k, _ in x.new]}
    inputs = {k for x in computes for k in x.reads} - {
        k for x in computes for k in ([x.out] if x.out else []) + [k for k, _ in x.new]}
    own = {k for k in ([e.out] if e.out else []) + [k for k, _ in e.new]}   # gone when the stop unwinds
    pending = tuple(k for x in redo[last + 1:] for k in x.reads if (k in made or k in inputs) and k not in own)
    e = replace(e, reads=tuple(dict.fromkeys(e.reads + pending)))
    return redo[:last] + [e]
