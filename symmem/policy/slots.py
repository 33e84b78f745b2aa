"""The device a step runs on: a policy part with a few entries, each a :class:`Choice`."""
from __future__ import annotations

from dataclasses import dataclass

from .registry import Registry

__all__ = ["Choice", "DEVICES"]


@dataclass(frozen=True)
class Choice:
    name: str
    description: str


DEVICES = Registry("device")
DEVICES.register(Choice("cuda", "a CUDA GPU (what users train on): 1-byte dropout masks, float32 "
                                "layer-norm statistics, foreach optimizers, step counters on the host"))
DEVICES.register(Choice("cpu", "the CPU (what the tests measure): dropout keeps its noise tensor, "
                               "Python scalars saved as 8-byte tensors, for-loop optimizers"))
