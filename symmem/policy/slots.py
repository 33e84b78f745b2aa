"""Policy parts with a few entries, each a registry later issues fill: the device and the
parallel layout."""
from __future__ import annotations

from dataclasses import dataclass

from .registry import Registry

__all__ = ["Choice", "DEVICES", "PARALLEL"]


@dataclass(frozen=True)
class Choice:
    name: str
    description: str


DEVICES = Registry("device")
DEVICES.register(Choice("cuda", "a CUDA GPU (what users train on): 1-byte dropout masks, float32 "
                                "layer-norm statistics, foreach optimizers, step counters on the host"))
DEVICES.register(Choice("cpu", "the CPU (what the tests measure): dropout keeps its noise tensor, "
                               "Python scalars saved as 8-byte tensors, for-loop optimizers"))

PARALLEL = Registry("parallel layout")
PARALLEL.register(Choice("none", "one device: no data, tensor, pipeline or context parallelism"))
