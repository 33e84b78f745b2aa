"""Gradient accumulation: K micro-batches of size ``b`` per optimizer step (batch ``b * K``).

The training loop, as PyTorch and Hugging Face's Trainer run it::

    for micro_batch in micro_batches:            # K of them
        loss = model(**micro_batch).loss / K
        loss.backward()
    optimizer.step(); optimizer.zero_grad(set_to_none=True)

What PyTorch does, measured (``tests/test_recompute_measured.py``):

- the first micro-batch's backward creates the gradients, as without accumulation
  (``AccumulateGrad`` takes the new gradient as ``.grad``, no copy);
- every later micro-batch runs its forward with all the gradients alive, and its
  backward computes each parameter's gradient as a new tensor, adds it into ``.grad`` in
  place and frees it; a tied weight's first gradient waits until its second arrives;
- ``loss / K`` is a new 0-dim tensor (its backward saves K, a 0-dim float64 tensor on the
  CPU, on the host under CUDA); the previous micro-batch's loss is referenced until the next
  one replaces it; ``backward`` holds the gradient of the scaled loss until it
  returns, and the division's backward makes the gradient of the loss;
- one micro-batch's tensors are on the device at a time (each replaces the last).

Micro-batches 2 to K - 1 leave memory as they found it, so the plan holds micro-batch 1,
micro-batch 2 (for every middle one) and micro-batch K: the peak over the step is exact.

A pipeline's micro-batches (``Parallel.microbatches``) are accumulated so too; a stage
before the last has no loss to scale: its backward starts from the gradient it receives
(:mod:`symmem.passes.pipeline`).
"""
from __future__ import annotations

from dataclasses import replace

import sympy as sp

from ..graph import Repeat
from ..plan import LOOP, Alloc, Backward, Compute, Free, Hold, Key, Mark, MicroBatch, Plan, Release

__all__ = ["prepare", "apply", "loss_holder", "SCALED_LOSS"]

#: The node of the loss divided by K (the training loop's division).
SCALED_LOSS = "loss / K"


def prepare(graph, policy):
    return graph


def apply(plan: Plan, graph, policy) -> Plan:
    k = policy.micro_batches
    if k == 1:
        return plan
    labels = ["1", "2", str(k)][:min(k, 3)]
    if graph.items and isinstance(graph.items[-1], Repeat):     # a pipeline stage that sends its output on
        forwards = [plan.forward] * len(labels)
        backwards = [plan.backward] + [tuple(_temporary_grads(list(plan.backward)))] * (len(labels) - 1)
    else:
        forwards = [_forward(plan, label, labels, policy.device == "cpu") for label in labels]
        backwards = [_backward(plan, later=label != "1") for label in labels]
    later = tuple(MicroBatch(label, f, b) for label, f, b in zip(labels[1:], forwards[1:], backwards[1:]))
    note = (f"accumulate {k}: micro-batches 1, " + ("2 (each of 2 to {0}) and {1}".format(k - 1, k) if k > 3
                                                      else ", ".join(labels[1:]))
            + f" before one optimizer step; batch b*{k} per step")
    return replace(plan, forward=forwards[0], backward=backwards[0], later=later, notes=plan.notes + (note,))


def loss_holder(label: str) -> str:
    """The training loop's hold on micro-batch ``label``'s scaled loss."""
    return f"{LOOP} (loss of micro-batch {label})"


_K = Key("scalar", f"{SCALED_LOSS}:K")
_DIVISION = "the division's backward"


def _forward(plan: Plan, label: str, labels: list, cpu: bool) -> tuple:
    """The forward of micro-batch ``label``, then, once the model has returned, the loss
    divided by K, kept by the loop until the next micro-batch's replaces it (the loss itself
    is dropped once divided)."""
    out = [replace(e, holds=tuple(h for h in e.holds if h.holder != LOOP)) if isinstance(e, Compute) else e
           for e in plan.forward]
    nbytes = next(e.out_bytes for e in plan.forward if isinstance(e, Compute) and e.out == plan.loss)
    scaled = Key("value", SCALED_LOSS)
    new, holds = (), (Hold(scaled, loss_holder(label)),)
    if cpu:       # DivBackward0 saves K, wrapped in a 0-dim float64 tensor (on the host under CUDA);
        # the loop's, not among the model's activations
        new, holds = ((_K, sp.Integer(8)),), holds + (Hold(_K, _DIVISION),)
    out.append(Compute(SCALED_LOSS, scaled, nbytes, new=new, reads=(plan.loss,), holds=holds))
    if label != labels[0]:
        out.append(Release(loss_holder(labels[labels.index(label) - 1])))
    return tuple(out)


def _backward(plan: Plan, later: bool) -> tuple:
    """The backward of a micro-batch: backward holds the scaled loss's gradient until it
    returns; the division's backward makes the loss's gradient, an ordinary one. In a later
    micro-batch each parameter's gradient is a temporary, added into ``.grad`` and freed
    after the last node that contributes to it."""
    events = list(plan.backward)
    first = events[0]                         # the loss's gradient, held to the end by lowering
    scaled = Key("vgrad", SCALED_LOSS)
    events[0] = Alloc(scaled, first.nbytes, "transient")
    events.insert(1, Backward(SCALED_LOSS, 0, (first, Mark("backward", SCALED_LOSS, ()), Release(_DIVISION))))
    end = events.pop()                        # the Free of the loss's gradient, held to the end ...
    events.append(Free(scaled, first.nbytes, "transient"))
    loss_group = next(j for j, e in enumerate(events) if isinstance(e, Backward) and e.node == plan.loss.name)
    events.insert(loss_group + 1, end)        # ... now freed once the loss's backward has used it
    if later:
        events = _temporary_grads(events)
    return tuple(events)


def _temporary_grads(events: list) -> list:
    last = {}                                 # parameter key -> position of its last group
    for j, e in enumerate(events):
        if isinstance(e, Backward):
            for p in e.params:
                last[p] = j
    out = []
    for j, e in enumerate(events):
        if not isinstance(e, Backward):
            out.append(e)
            continue
        inner = []
        for x in e.events:
            if isinstance(x, Alloc) and x.role == "grads":
                x = replace(x, key=Key("new grad", x.key.name, x.key.copy), role="transient")
            inner.append(x)
        for p, at in last.items():            # added into .grad in place, then freed
            if at == j:
                nbytes = _grad_bytes(events, p)
                if nbytes is not None:
                    inner.append(Free(Key("new grad", p.name, p.copy), nbytes, "transient"))
        out.append(replace(e, events=tuple(inner)))
    return out


def _grad_bytes(events: list, p: Key):
    for e in events:
        if isinstance(e, Backward):
            for x in e.events:
                if isinstance(x, Alloc) and x.role == "grads" and (x.key.name, x.key.copy) == (p.name, p.copy):
                    return x.nbytes
    return None
