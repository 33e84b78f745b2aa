"""The plan: one training step as an explicit, printable list of events (the IR passes rewrite).

Lowering (:mod:`symmem.lowering`) turns a graph and a policy into a :class:`Plan`;
passes (:mod:`symmem.passes`) rewrite it; the counter (:mod:`symmem.counter`) runs it and
finds the peak. As in torch.fx: a graph, passes, an interpreter.

A plan has four phases: ``states`` (what exists before the step: parameters, optimizer
states, the batch), ``forward``, ``backward`` and ``optimizer``. Each is a tuple of events:

- :class:`Compute` -- an operator runs (in forward, or again in backward when a pass
  recomputes it): it allocates its output and the new tensors it saves, reads its
  inputs and names who keeps what (``holds``: autograd for the node, the autocast cache,
  a checkpoint). Nothing is freed explicitly in a ``Compute``: a storage is freed when its
  last reader has run and its last holder has let go, which the counter works out.
- :class:`Alloc` and :class:`Free` -- a storage comes and goes at a known moment
  (gradients in backward, optimizer temporaries).
- :class:`Release` -- a holder lets go of everything it holds (autograd releases what a
  node saved once the node's backward has run; the autocast cache empties when forward ends).
- :class:`Mark` -- a moment at which memory can peak: the live bytes then, plus ``extra``
  bytes that exist only at that moment (an operator's scratch).
- :class:`Backward` -- the events of one node's backward, grouped so that passes can find them.
- :class:`Begin` / :class:`End` -- the bounds of one copy of a repeated block.

A block repeated ``count`` times (``L`` layers) is lowered as three copies: the first
iteration, a middle one and the last. Every middle iteration is alike, so the counter
runs each copy once and extrapolates the middle one ``count - 2`` times; the formulas
stay symbolic in ``count``. A storage is named by a :class:`Key`; ``copy`` (1, 2, 3) tells
the copies of a block apart, 0 is outside any block.

``str(plan)`` prints one event a line, in the fixed format of each event's ``__str__``.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple, Union

import sympy as sp

__all__ = ["Key", "Hold", "Compute", "Alloc", "Free", "Release", "Mark", "Backward", "Begin", "End", "Event",
           "MicroBatch", "flat", "map_bytes",
           "Plan", "PHASES", "ROLES", "AUTOGRAD", "CHECKPOINT", "LOCAL", "CACHE", "OUTPUTS", "LOOP"]

#: The phases of a step, in order.
PHASES = ("states", "forward", "backward", "optimizer")
#: The roles every live byte belongs to, in display order.
ROLES = ("params", "buffers", "master", "optimizer", "grads", "activations", "cache", "batch", "transient")

#: Holders that are not a node: the autocast weight cache (emptied when forward ends), the
#: model's outputs (referenced until forward ends), the training loop (the batch and the
#: loss, referenced for the whole step).
CACHE, OUTPUTS, LOOP = "autocast cache", "model outputs", "training loop"
#: The prefix of autograd's holders: ``AUTOGRAD + node`` holds what ``node`` saved; of a
#: checkpoint's, which holds the inputs of the region it recomputes; of the model's Python
#: locals (``Graph.hold``).
AUTOGRAD, CHECKPOINT, LOCAL = "autograd:", "checkpoint:", "local:"

ZERO = sp.Integer(0)


class Key(NamedTuple):
    """A storage: its kind (``value``, ``saved``, ``cast``, ``param``, ``grad``, ...), a name
    and the copy of a repeated block it belongs to (0: outside any block)."""
    kind: str
    name: str
    copy: int = 0

    def __str__(self) -> str:
        return f"{self.kind}:{self.name}" + (f"#{self.copy}" if self.copy else "")

    def in_copy(self, copy: int) -> "Key":
        return self._replace(copy=copy)


class Hold(NamedTuple):
    """``holder`` keeps ``key`` alive until a :class:`Release` of that holder."""
    key: Key
    holder: str


@dataclass(frozen=True)
class Compute:
    """An operator runs: ``out`` (None for a view: no new storage) and ``new`` (storages it
    allocates besides its output, e.g. saved statistics or an autocast copy of a weight)
    are allocated, ``reads`` are read, ``holds`` say who keeps what, and ``temp`` bytes exist
    only while it runs. ``role`` prices ``out``/``new`` storages nobody holds for backward;
    ``late`` names the ``new`` storages the kernel makes (the others exist before it runs);
    ``brief`` those a composite op frees before its largest moment when nobody holds them.
    Keys of kind ``scalar`` are Python numbers autograd saves as 0-dim tensors without the
    saved-tensor hooks."""
    node: str
    out: Key | None = None
    out_bytes: sp.Expr = ZERO
    new: tuple = ()            # ((Key, bytes), ...)
    reads: tuple = ()          # (Key, ...)
    holds: tuple = ()          # (Hold, ...)
    temp: sp.Expr = ZERO
    copy: int = 0
    role: str = "transient"    # of out/new when not held by autograd
    late: tuple = ()           # keys of ``new`` the op's kernel itself makes (after it runs)
    brief: tuple = ()          # keys of ``new`` gone before the op's largest moment unless held

    def __str__(self) -> str:
        parts = [f"compute  {_node(self.node, self.copy)}"]
        if self.out is not None:
            parts.append(f"out {self.out} ({self.out_bytes})")
        if self.new:
            parts.append("new " + ", ".join(f"{k} ({n})" for k, n in self.new))
        if self.reads:
            parts.append("reads " + ", ".join(map(str, self.reads)))
        if self.holds:
            parts.append("holds " + ", ".join(f"{k} by {h}" for k, h in self.holds))
        if self.temp != 0:
            parts.append(f"temp {self.temp}")
        return "  ".join(parts)


@dataclass(frozen=True)
class Alloc:
    """A storage of ``nbytes`` is allocated (``count`` of them: a parameter of a repeated
    block exists once per layer)."""
    key: Key
    nbytes: sp.Expr
    role: str
    count: sp.Expr = sp.Integer(1)

    def __str__(self) -> str:
        n = f" x {self.count}" if self.count != 1 else ""
        return f"alloc  {self.key}  {self.nbytes}  {self.role}{n}"


@dataclass(frozen=True)
class Free:
    """A storage allocated by an :class:`Alloc` is freed."""
    key: Key
    nbytes: sp.Expr
    role: str

    def __str__(self) -> str:
        return f"free  {self.key}  {self.nbytes}  {self.role}"


@dataclass(frozen=True)
class Release:
    """``holder`` lets go of every storage it holds."""
    holder: str
    copy: int = 0

    def __str__(self) -> str:
        return f"release  {_node(self.holder, self.copy)}"


@dataclass(frozen=True)
class Mark:
    """A moment that can be the peak: the live bytes plus ``extra`` ((role, bytes), ...)."""
    phase: str
    node: str
    extra: tuple = ()
    copy: int = 0

    def __str__(self) -> str:
        ex = "".join(f"  +{role} {e}" for role, e in self.extra if e != 0)
        return f"mark  {self.phase} {_node(self.node, self.copy)}{ex}"


@dataclass(frozen=True)
class Backward:
    """The backward of one node (``copy`` as in :class:`Compute`): its events in order
    (its gradients allocated, a mark, its output's gradient freed, autograd's release of
    what it saved). ``params``: the parameters whose gradient it computes (their keys);
    ``grad``: the storage of its output's gradient (another value's, when handed on).
    Passes find a node's backward by it."""
    node: str
    copy: int
    events: tuple
    params: tuple = ()
    grad: "Key | None" = None

    def __str__(self) -> str:
        inner = "\n".join("    " + str(e) for e in self.events)
        return f"backward  {_node(self.node, self.copy)}" + (f"\n{inner}" if inner else "")


@dataclass(frozen=True)
class Begin:
    """Copy ``copy`` (1: first iteration, 2: a middle one, 3: the last) of block ``block``,
    repeated ``count`` times in all."""
    block: str
    copy: int
    count: sp.Expr

    def __str__(self) -> str:
        return f"begin  {self.block} copy {self.copy} of {self.count}"


@dataclass(frozen=True)
class End:
    block: str
    copy: int

    def __str__(self) -> str:
        return f"end  {self.block} copy {self.copy}"


Event = Union[Compute, Alloc, Free, Release, Mark, Backward, Begin, End]


def flat(events):
    """The events with every :class:`Backward` group replaced by its events."""
    for e in events:
        if isinstance(e, Backward):
            yield from e.events
        else:
            yield e


def _node(name: str, copy: int) -> str:
    return f"{name}#{copy}" if copy else name


@dataclass(frozen=True)
class MicroBatch:
    """A micro-batch after the first (gradient accumulation): its forward and backward,
    run before the optimizer step. ``label`` names it in the timeline ("2", "8").
    ``warmup``: its forward ran earlier, before the first backward (a pipeline's warm-up),
    so none of its moments can be the peak: it only makes what its backward frees."""
    label: str
    forward: tuple
    backward: tuple
    warmup: bool = False


def map_bytes(e, fn):
    """``e`` with each of its byte expressions ``x`` replaced by ``fn(x)``."""
    if isinstance(e, Compute):
        return replace(e, out_bytes=fn(e.out_bytes), new=tuple((k, fn(n)) for k, n in e.new), temp=fn(e.temp))
    if isinstance(e, (Alloc, Free)):
        return replace(e, nbytes=fn(e.nbytes))
    if isinstance(e, Mark):
        return replace(e, extra=tuple((r, fn(x)) for r, x in e.extra))
    if isinstance(e, Backward):
        return replace(e, events=tuple(map_bytes(x, fn) for x in e.events))
    return e


@dataclass(frozen=True)
class Plan:
    """One training step: events per phase, and what the counter needs beside them.

    ``later``: the micro-batches after the first (:class:`MicroBatch`, gradient accumulation);
    ``components``: the model states as formulas (params, grads, master, optimizer, buffers),
    from the policy; ``loss``: the key of the loss value; ``requirements``: the
    :class:`~symmem.requirements.Requirement` objects the formulas need; ``notes``: what
    each pass did, one line each (printed at the top)."""
    name: str
    states: tuple = ()
    forward: tuple = ()
    backward: tuple = ()
    optimizer: tuple = ()
    components: dict = field(default_factory=dict)
    loss: Key | None = None
    requirements: tuple = ()
    notes: tuple = ()
    later: tuple = ()

    def phase(self, name: str) -> tuple:
        return getattr(self, name)

    def with_phase(self, name: str, events) -> "Plan":
        return replace(self, **{name: tuple(events)})

    def mapped_bytes(self, fn) -> "Plan":
        """The plan with every event's bytes ``x`` replaced by ``fn(x)`` (every phase, every
        micro-batch; the components are left as they are)."""
        def phase(events):
            return tuple(map_bytes(e, fn) for e in events)
        return replace(self, states=phase(self.states), forward=phase(self.forward), backward=phase(self.backward),
                       optimizer=phase(self.optimizer),
                       later=tuple(replace(mb, forward=phase(mb.forward), backward=phase(mb.backward))
                                   for mb in self.later))

    def sections(self):
        """(title, phase, micro-batch label, events) in the order the step runs them (phase
        None: a warm-up forward, whose moments are not counted as the peak's candidates)."""
        first = "1" if self.later else ""
        out = [("states", "states", "", self.states),
               ("forward" + (" (micro-batch 1)" if first else ""), "forward", first, self.forward),
               ("backward" + (" (micro-batch 1)" if first else ""), "backward", first, self.backward)]
        for mb in self.later:
            warm = " (warm-up, before the first backward)" if mb.warmup else ""
            out += [(f"forward (micro-batch {mb.label}){warm}", None if mb.warmup else "forward", mb.label,
                     mb.forward),
                    (f"backward (micro-batch {mb.label})", "backward", mb.label, mb.backward)]
        return out + [("optimizer", "optimizer", "", self.optimizer)]

    def __str__(self) -> str:
        lines = [f"plan {self.name}"] + [f"# {n}" for n in self.notes]
        for title, _, _, events in self.sections():
            lines.append(title)
            depth = 1
            for e in events:
                if isinstance(e, End):
                    depth -= 1
                lines.append("\n".join("  " * depth + line for line in str(e).splitlines()))
                if isinstance(e, Begin):
                    depth += 1
        return "\n".join(lines)
