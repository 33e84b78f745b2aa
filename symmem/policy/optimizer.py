"""Optimizers: the state each keeps per parameter tensor and what its step allocates.

An optimizer is its behaviour, not a row of numbers: ``states`` tensors of each
parameter's size (priced ``B_o``), a step counter per parameter tensor where PyTorch keeps
one, and, per implementation, the temporaries its step allocates, as a function of the
parameters in the order the step meets them. PyTorch has three implementations
(torch/optim/adam.py, sgd.py):

- ``for-loop`` (``foreach=False``, ``_single_tensor_adam``): one parameter at a time;
- ``foreach`` (``_multi_tensor_adam``): ``torch._foreach_*`` over all parameters at once;
- ``fused`` (``_fused_adam``): one kernel, in place.

``auto`` is PyTorch's default: foreach when every parameter is on CUDA, the for-loop on
the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy as sp

from ..symbols import B_o
from .registry import Registry

__all__ = ["Optimizer", "Implementation", "OPTIMIZERS", "IMPLEMENTATIONS"]


@dataclass(frozen=True)
class Implementation:
    name: str
    description: str


IMPLEMENTATIONS = Registry("optimizer implementation")
for _i in (Implementation("auto", "PyTorch's default: foreach on cuda, for-loop on cpu"),
           Implementation("for-loop", "foreach=False: one parameter tensor at a time"),
           Implementation("foreach", "torch._foreach_* over every parameter tensor at once"),
           Implementation("fused", "fused=True: one kernel updates every tensor in place")):
    IMPLEMENTATIONS.register(_i)

#: The step's marks: ``fn(order, total)`` -> [(where, transient bytes), ...], with ``order``
#: the parameter tensors as (name, numel) in the order the step meets them (a repeated
#: block's twice, so that its last parameter precedes its first) and ``total`` the number
#: of parameter elements N.
StepTemps = Callable[[list, sp.Expr], list]


def _none(order, total) -> list:
    return [("all parameters", sp.Integer(0))]


def _adam_for_loop(order, total) -> list:
    """``denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)`` holds two
    temporaries of this parameter's size at once, while the previous parameter's ``denom``
    is still referenced: 2 x this tensor + 1 x the previous one. A repeated block's order
    repeats, so its last parameter precedes its first. One mark per distinct size."""
    marks = {}
    for (_, prev), (name, cur) in zip([(None, 0)] + order[:-1], order):
        marks.setdefault(sp.expand((2 * cur + prev) * B_o), name)
    return [(name, temp) for temp, name in marks.items()]


def _nesterov_for_loop(order, total) -> list:
    """``grad = grad.add(buf, alpha=momentum)`` makes one temporary of this parameter's
    size; the previous parameter's is freed when the loop rebinds ``grad`` first
    (torch/optim/sgd.py, ``_single_tensor_sgd``). One mark per distinct size."""
    marks = {}
    for name, cur in order:
        marks.setdefault(sp.expand(cur * B_o), name)
    return [(name, temp) for temp, name in marks.items()]


def _adam_foreach(order, total) -> list:
    """``torch._foreach_sqrt(exp_avg_sqs)`` allocates one temporary for every parameter."""
    return [("all parameters", sp.expand(total * B_o))]


@dataclass(frozen=True)
class Optimizer:
    """``states`` tensors of each parameter's size (in ``B_o``); ``step_counter``: a 0-dim
    float32 ``state['step']`` per parameter tensor; ``temps``: implementation -> the step's
    temporaries (for-loop, foreach, fused)."""
    name: str
    states: int
    step_counter: bool
    temps: tuple            # ((implementation, StepTemps), ...)
    description: str

    def step_temps(self, implementation: str, order, total) -> list:
        return dict(self.temps)[implementation](order, total)

    def counters_on_device(self, device: str, implementation: str) -> bool:
        """Adam keeps ``state['step']`` on the host (a CPU tensor) unless it is fused or
        everything is on the CPU (``capturable=False``, torch/optim/adam.py)."""
        return self.step_counter and (device == "cpu" or implementation == "fused")


_SGD = (("for-loop", _none), ("foreach", _none), ("fused", _none))
# foreach adds the buffers into the gradients in place (torch._foreach_add_), fused in its kernel
_NESTEROV = (("for-loop", _nesterov_for_loop), ("foreach", _none), ("fused", _none))
_ADAM = (("for-loop", _adam_for_loop), ("foreach", _adam_foreach), ("fused", _none))
OPTIMIZERS = Registry("optimizer")
for _o in (Optimizer("sgd", 0, False, _SGD, "SGD without momentum: p -= lr * g, in place"),
           Optimizer("sgd-momentum", 1, False, _SGD, "SGD with momentum: one buffer per parameter"),
           Optimizer("sgd-nesterov", 1, False, _NESTEROV, "SGD with Nesterov momentum: one buffer per "
                     "parameter; the for-loop adds it into a copy of each gradient"),
           Optimizer("adam", 2, True, _ADAM, "Adam (weight_decay=0): exp_avg and exp_avg_sq"),
           Optimizer("adamw", 2, True, _ADAM, "AdamW: exp_avg and exp_avg_sq; decay in place")):
    OPTIMIZERS.register(_o)
