"""Precisions: how many bytes each role's elements take, and whether autocast runs forward.

The roles are priced by the symbols ``B_w`` (weights), ``B_g`` (gradients), ``B_m``
(master weights), ``B_o`` (optimizer states) and ``B_a`` (activations in the compute
dtype); a precision binds them. With ``torch.autocast`` the float32 weights are
themselves the master copy (``master`` 0) and the rules cast per op (the autocast table
of :mod:`symmem.rules.autocast`); a half-precision model with a float32 master copy
(Megatron-LM, DeepSpeed, Apex O2) keeps weights, gradients and activations in the half
dtype, and its optimizer steps the master copy. ``fp8`` is such a model whose linear
layers are Transformer Engine's, computing in FP8 (:mod:`symmem.passes.fp8`).
"""
from __future__ import annotations

from dataclasses import dataclass

import sympy as sp

from ..rules import Ctx, DType
from ..symbols import B_a, B_g, B_m, B_o, B_w
from .registry import Registry

__all__ = ["Precision", "PRECISIONS"]


@dataclass(frozen=True)
class Precision:
    """Bytes per element of each role, whether autocast runs the forward pass, and the
    torch dtype activations are computed in (``compute``). ``state``: bytes of an optimizer
    state element: torch's optimizers keep their states in the dtype of what they step (the
    float32 weights or master copy; a half-precision model's own dtype). ``scaler``: trained
    with ``torch.amp.GradScaler`` as its documentation runs it. ``fp8``: the linear layers
    are Transformer Engine's, run in FP8 (:mod:`symmem.passes.fp8`)."""
    name: str
    weight: sp.Rational
    grad: sp.Rational
    master: sp.Rational       # 0: no separate master copy
    act: sp.Rational
    autocast: bool
    compute: str              # "float32", "bfloat16" or "float16"
    description: str
    state: sp.Rational = sp.Integer(4)    # bytes of an optimizer state element (the master dtype)
    scaler: bool = False      # trained with torch.amp.GradScaler (its state and step scalars)
    fp8: bool = False         # linear layers as Transformer Engine's FP8 GEMMs (symmem.passes.fp8)

    def bindings(self) -> dict:
        out = {B_w: self.weight, B_g: self.grad, B_a: self.act, B_o: self.state}
        if self.master:
            out[B_m] = self.master
        return out

    def ctx(self, device: str) -> Ctx:
        """What the rules need to know: autocast, the device, the compute dtype priced B_a."""
        half = self.compute != "float32"     # ranks below float32 in type promotion
        return Ctx(autocast=self.autocast, device=device,
                   act=DType("compute", B_a, 2 if half else 3), act_name=self.compute)


_4, _2, _0 = sp.Integer(4), sp.Integer(2), sp.Integer(0)
PRECISIONS = Registry("precision")
for _p in (
    Precision("fp32", _4, _4, _0, _4, False, "float32",
              "float32 weights, gradients, optimizer states and activations"),
    Precision("tf32", _4, _4, _0, _4, False, "float32",
              "float32 storage with TF32 matmuls (torch.backends.cuda.matmul.allow_tf32): faster math, "
              "the same bytes as fp32"),
    Precision("bf16", _2, _2, _0, _2, False, "bfloat16",
              "model.to(torch.bfloat16): weights, gradients, optimizer states and activations in "
              "bfloat16, no float32 copy", _2),
    Precision("fp16", _2, _2, _0, _2, False, "float16",
              "model.to(torch.float16): every role in float16, no float32 copy", _2),
    Precision("bf16-mixed", _4, _4, _0, _2, True, "bfloat16",
              "torch.autocast(dtype=torch.bfloat16): float32 weights (the master copy), gradients and "
              "optimizer states; bfloat16 activations where autocast casts, and cached bfloat16 copies "
              "of the weights during forward"),
    Precision("fp16-mixed", _4, _4, _0, _2, True, "float16",
              "torch.autocast(dtype=torch.float16) with torch.amp.GradScaler: as bf16-mixed, in float16, "
              "plus the scaler's 8 bytes of state, the scaled loss through backward and its unscale_ "
              "scalars", scaler=True),
    Precision("bf16-master", _2, _2, _4, _2, False, "bfloat16",
              "bfloat16 weights, gradients and activations, with a float32 master copy and float32 "
              "optimizer states (Megatron-LM, DeepSpeed, Apex O2); the step casts the gradients to "
              "float32 (one float32 copy of all of them). Under FSDP: MixedPrecisionPolicy("
              "param_dtype=bfloat16, reduce_dtype=float32), the float32 shards the master copy, "
              "gathered in bfloat16, the gradient shards float32"),
    Precision("fp16-master", _2, _2, _4, _2, False, "float16",
              "as bf16-master, in float16 (the loss scaler's scalars are not counted); under FSDP "
              "MixedPrecisionPolicy(param_dtype=float16, reduce_dtype=float32)"),
    Precision("fp8", _2, _2, _4, _2, False, "bfloat16",
              "Transformer Engine FP8 training as Megatron-LM runs it: as bf16-master, with every linear "
              "layer but the output head a te.Linear under te.autocast(DelayedScaling()) on Hopper: FP8 "
              "copies of its input and weight (data and transpose) saved for backward, and its scaling "
              "state (amax history of 1024)", fp8=True),
):
    PRECISIONS.register(_p)
