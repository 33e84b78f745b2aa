"""Training policies: how each role is stored and what the optimizer allocates.

A :class:`Policy` is frozen and built from names, so it can come from a command
line. Its parts:

- :class:`Precision` prices the roles in bytes (``B_w``, ``B_g``, ``B_m``, ``B_o``,
  ``B_a``) and says whether ``torch.autocast`` runs the forward pass.
- :class:`Optimizer` says how many state tensors of a parameter's size it keeps and
  what its step allocates, for each implementation PyTorch has (for-loop,
  foreach, fused).
- ``device``: ``"cuda"`` (the default: what users train on) or ``"cpu"`` (what the
  tests measure). Dropout, wrapped scalars and the optimizer's default
  implementation differ between the two.
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from .errors import ConfigError, UnknownName
from .rules import Ctx, DType
from .symbols import B_a, B_g, B_m, B_o, B_w

__all__ = ["Precision", "Optimizer", "Policy", "PRECISIONS", "OPTIMIZERS", "IMPLEMENTATIONS"]


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each role, and whether autocast runs the forward pass.

    ``master`` is 0 when there is no separate master copy (with torch.autocast the
    float32 weights are themselves the master copy)."""
    name: str
    weight: sp.Rational
    grad: sp.Rational
    master: sp.Rational
    act: sp.Rational
    autocast: bool
    description: str

    def bindings(self, optimizer_state_bytes) -> dict:
        out = {B_w: self.weight, B_g: self.grad, B_a: self.act, B_o: optimizer_state_bytes}
        if self.master:
            out[B_m] = self.master
        return out


_4, _2 = sp.Integer(4), sp.Integer(2)
PRECISIONS: dict[str, Precision] = {
    "fp32": Precision("fp32", _4, _4, sp.Integer(0), _4, False,
                      "float32 weights, gradients, optimizer states and activations"),
    "bf16-mixed": Precision("bf16-mixed", _4, _4, sp.Integer(0), _2, True,
                            "torch.autocast(dtype=torch.bfloat16): float32 weights (the master copy), "
                            "gradients and optimizer states; bfloat16 activations where autocast casts, "
                            "and cached bfloat16 copies of the weights during forward"),
    "fp16-mixed": Precision("fp16-mixed", _4, _4, sp.Integer(0), _2, True,
                            "torch.autocast(dtype=torch.float16) with a GradScaler: as bf16-mixed, in "
                            "float16 (the scaler's few scalars are not counted)"),
    "bf16-master": Precision("bf16-master", _2, _2, _4, _2, False,
                             "bfloat16 weights, gradients and activations, with a float32 master "
                             "copy and float32 optimizer states (Megatron-LM, DeepSpeed, Apex O2); the "
                             "step casts the gradients to float32 (one float32 copy of all of them)"),
    "fp16-master": Precision("fp16-master", _2, _2, _4, _2, False,
                             "as bf16-master, in float16 (the loss scaler's scalars are not counted)"),
}


@dataclass(frozen=True)
class Optimizer:
    """An optimizer's memory: ``states`` tensors of each parameter's size (in the
    optimizer-state dtype), ``step_tensor`` (a 0-dim float32 step count per parameter
    tensor, Adam's ``state['step']``), and the step's temporaries per implementation:

    - for-loop (``foreach=False``): Adam's ``denom = (exp_avg_sq.sqrt() / c).add_(eps)``
      holds two temporaries of one parameter's size at once, and the previous
      parameter's ``denom`` is still referenced: 2 x this tensor + 1 x the previous one;
    - foreach: ``torch._foreach_sqrt(exp_avg_sqs)`` allocates one temporary for every
      parameter at once: 1 x (all parameters);
    - fused: one kernel updates in place: no temporaries.

    Source: torch/optim/adam.py (``_single_tensor_adam``, ``_multi_tensor_adam``,
    ``_fused_adam``) and sgd.py; SGD's updates are in place in every implementation.
    """
    name: str
    states: int
    step_tensor: bool
    largest_temps: int      # for-loop: temporaries of the largest parameter tensor
    all_temps: int          # foreach: temporaries of all parameters
    description: str


OPTIMIZERS: dict[str, Optimizer] = {
    "sgd": Optimizer("sgd", 0, False, 0, 0, "SGD without momentum: p -= lr * g"),
    "sgd-momentum": Optimizer("sgd-momentum", 1, False, 0, 0, "SGD with momentum: one buffer"),
    "adam": Optimizer("adam", 2, True, 2, 1, "Adam (weight_decay=0): exp_avg and exp_avg_sq"),
    "adamw": Optimizer("adamw", 2, True, 2, 1, "AdamW: exp_avg and exp_avg_sq; decay in place"),
}
IMPLEMENTATIONS = ("auto", "for-loop", "foreach", "fused")
DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class Policy:
    """How a training step is run. ``implementation="auto"`` is PyTorch's default:
    foreach on CUDA, the for-loop on the CPU."""
    precision: str = "fp32"
    optimizer: str = "adamw"
    device: str = "cuda"
    implementation: str = "auto"

    def __post_init__(self):
        if self.precision not in PRECISIONS:
            raise UnknownName("precision", self.precision, tuple(PRECISIONS))
        if self.optimizer not in OPTIMIZERS:
            raise UnknownName("optimizer", self.optimizer, tuple(OPTIMIZERS))
        if self.device not in DEVICES:
            raise ConfigError("device", self.device, "'cuda' or 'cpu'")
        if self.implementation not in IMPLEMENTATIONS:
            raise UnknownName("optimizer implementation", self.implementation, IMPLEMENTATIONS)

    @property
    def prec(self) -> Precision:
        return PRECISIONS[self.precision]

    @property
    def opt(self) -> Optimizer:
        return OPTIMIZERS[self.optimizer]

    @property
    def impl(self) -> str:
        if self.implementation != "auto":
            return self.implementation
        return "foreach" if self.device == "cuda" else "for-loop"

    @property
    def step_on_device(self) -> bool:
        """Adam's step counters live on the CPU unless fused (or the device is the CPU)."""
        return self.opt.step_tensor and (self.device == "cpu" or self.impl == "fused")

    def ctx(self) -> Ctx:
        p = self.prec
        act = DType("compute", B_a, 2 if p.autocast else 3)
        name = "float32" if p.act == 4 else ("float16" if self.precision.startswith("fp16") else "bfloat16")
        return Ctx(autocast=p.autocast, device=self.device, act=act, act_name=name)

    def bindings(self) -> dict:
        """Numbers for the byte symbols. Optimizer states are float32 (the master dtype)."""
        return self.prec.bindings(sp.Integer(4))

    def describe(self) -> str:
        return (f"{self.precision} ({self.prec.description}); {self.optimizer} "
                f"[{self.impl}] ({self.opt.description}); device {self.device}")
