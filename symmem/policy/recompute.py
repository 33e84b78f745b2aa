"""Activation recomputation: which parts of forward are run again in backward.

``torch.utils.checkpoint`` runs a region without keeping what its operators save for
backward; it keeps the region's inputs instead, and runs the region again when backward
first needs one of its saved tensors. The spec names the regions:

- ``none``: nothing is recomputed;
- ``full``: every layer of every repeated block is a region, as Hugging Face's
  ``activation_checkpointing_enable()`` (``gradient_checkpointing_enable()`` before 5.24) does
  (transformers 5: ``use_reentrant=False``);
- ``every:K``: K consecutive layers form one region (the layer count must be a
  multiple of K);
- ``nth:N``: layers 0, N, 2N, ... are regions, one each, and the others keep their
  activations: transformers' ``activation_checkpointing_enable(every_n_layers=N)``
  (``layer_index % every_n_layers == 0``; the layer count must be a multiple of N);
- ``selective``: only the attention core of each layer (Korthikanti et al. 2022): the
  nodes a model tags ``recompute="attention"`` (scores, softmax, dropout, context);
- ``last:N``: the last N layers keep their activations, the others are recomputed
  layer by layer (the seed's "selective retention");
- from Python, any nodes (:meth:`Recompute.nodes`: runs of consecutive nodes form the
  regions, in every layer for a block's nodes) or a range of layers
  (:meth:`Recompute.layers`).

Each spec takes ``,reentrant`` for ``use_reentrant=True`` (the region runs under
``no_grad`` and is recomputed whole in backward, its output held until the region's
backward ends); the default is the non-reentrant checkpoint (recomputation stops once
the last saved tensor is made again: PyTorch's early stop).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError
from .registry import Registry

__all__ = ["Recompute", "RecomputeMode", "RECOMPUTE"]


@dataclass(frozen=True)
class RecomputeMode:
    name: str
    syntax: str
    description: str


RECOMPUTE = Registry("recompute mode")
for _m in (RecomputeMode("none", "none", "keep every activation (no recomputation)"),
           RecomputeMode("full", "full", "checkpoint every layer (Hugging Face's gradient checkpointing)"),
           RecomputeMode("every", "every:K", "checkpoint K consecutive layers as one region"),
           RecomputeMode("nth", "nth:N", "checkpoint layers 0, N, 2N, ... one region each, the others keep "
                                         "their activations (transformers' every_n_layers=N)"),
           RecomputeMode("selective", "selective", "checkpoint the attention core of each layer"),
           RecomputeMode("last", "last:N", "keep the last N layers' activations, checkpoint the others"),
           RecomputeMode("nodes", "Recompute.nodes(...)", "from Python: checkpoint the given nodes"),
           RecomputeMode("layers", "Recompute.layers(a, z)", "from Python: checkpoint layers a to z - 1")):
    RECOMPUTE.register(_m)

_ACCEPTED = "none, full, every:K, nth:N, selective or last:N, each optionally followed by ,reentrant"


@dataclass(frozen=True)
class Recompute:
    """What is recomputed: ``mode`` (a :data:`RECOMPUTE` name), ``k`` (K of ``every:K``, N of
    ``nth:N`` and ``last:N``), ``reentrant``, ``names`` (``nodes``) and ``span`` ((start, stop) of
    ``layers``, stop None for the last layer)."""
    mode: str = "none"
    k: int = 0
    reentrant: bool = False
    names: tuple = ()
    span: tuple = ()

    @classmethod
    def parse(cls, spec) -> "Recompute":
        """``"full"``, ``"every:2"``, ``"last:4,reentrant"``, ... (case ignored), or a Recompute."""
        if isinstance(spec, Recompute):
            return spec
        if not isinstance(spec, str):
            raise ConfigError("recompute", spec, _ACCEPTED)
        text = spec.strip().lower()
        reentrant = False
        if text.endswith(",reentrant"):
            text, reentrant = text[: -len(",reentrant")], True
        mode, _, arg = text.partition(":")
        if mode not in ("none", "full", "every", "nth", "selective", "last"):
            raise ConfigError("recompute", spec, _ACCEPTED)
        needs_arg = mode in ("every", "nth", "last")
        if needs_arg != bool(arg):
            raise ConfigError("recompute", spec, _ACCEPTED,
                              f"{mode}:K takes a number of layers, e.g. {mode}:2." if needs_arg
                              else f"{mode} takes no number.")
        k = 0
        if needs_arg:
            if not arg.isdigit() or int(arg) < 1:
                raise ConfigError("recompute", spec, f"{mode}:K with K a whole number >= 1 (e.g. {mode}:2)")
            k = int(arg)
        if mode == "none" and reentrant:
            raise ConfigError("recompute", spec, _ACCEPTED, "none recomputes nothing: drop ,reentrant.")
        return cls(mode, k, reentrant)

    @classmethod
    def nodes(cls, *names: str, reentrant: bool = False) -> "Recompute":
        """Checkpoint these nodes: each run of consecutive ones (in forward order, within a
        layer for a block's nodes) is one region."""
        if not names or not all(isinstance(n, str) and n for n in names):
            raise ConfigError("recompute nodes", names, "one or more node names")
        return cls("nodes", 0, reentrant, tuple(names))

    @classmethod
    def layers(cls, start: int, stop: int | None = None, reentrant: bool = False) -> "Recompute":
        """Checkpoint layers ``start`` to ``stop - 1`` of the repeated block, one region each."""
        if not (isinstance(start, int) and start >= 0 and (stop is None or (isinstance(stop, int) and stop > start))):
            raise ConfigError("recompute layers", (start, stop), "0 <= start < stop (stop None for the last layer)")
        return cls("layers", 0, reentrant, (), (start, stop))

    def __str__(self) -> str:
        text = self.mode
        if self.mode in ("every", "nth", "last"):
            text = f"{self.mode}:{self.k}"
        elif self.mode == "nodes":
            text = f"nodes({', '.join(self.names)})"
        elif self.mode == "layers":
            start, stop = self.span
            text = f"layers({start}:{'' if stop is None else stop})"
        return text + (",reentrant" if self.reentrant else "")
