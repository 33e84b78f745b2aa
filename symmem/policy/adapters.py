"""Adapters: LoRA (Hu et al. 2021) as Hugging Face's ``peft`` adds it, and the frozen base
model it trains beside.

``LoRA(rank, targets, dropout)``: every parameter of the model is frozen (no gradient, no
optimizer state) and each linear layer whose module name ends with one of ``targets`` gets
two trainable matrices, A (r x in) and B (out x r), computed beside it:
``base(x) + B(A(dropout(x))) * scaling`` (``peft.tuners.lora.layer.Linear.forward``). The
rank is a number or the symbol ``r``, which then stays in the formulas. The pass that
applies it is :mod:`symmem.passes.lora`.

``peft``'s defaults: ``target_modules`` from its table per model type (GPT-2: ``c_attn``),
``lora_dropout`` 0.0, and adapters in float32 on a half-precision model (``get_peft_model``'s
``autocast_adapter_dtype=True``); :data:`LORA_DTYPES` names the other choice, adapters in the
model's dtype (``autocast_adapter_dtype=False``: QLoRA's "bf16 adapters").
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import sympy as sp

from ..errors import ConfigError
from ..symbols import r
from .registry import Registry

__all__ = ["LoRA", "DEFAULT_TARGETS", "LORA_DTYPES", "AdapterDType"]

#: peft's default target modules (``TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING``)
#: for the model families symmem builds; the LoRA pass takes the first whose modules the
#: model has.
DEFAULT_TARGETS = MappingProxyType({"gpt2": ("c_attn",), "llama": ("q_proj", "v_proj")})


@dataclass(frozen=True)
class LoRA:
    """A LoRA configuration: ``rank`` (a positive integer or the symbol ``r``), the
    module names it adapts (None: peft's default for the model, :data:`DEFAULT_TARGETS`), the
    adapters' dropout probability."""
    rank: object = r
    targets: tuple | None = None
    dropout: float = 0.0

    @staticmethod
    def parse(rank, targets=None, dropout=0.0) -> "LoRA | None":
        """From a policy's fields: ``rank`` None or "none" (no LoRA), a positive integer (or its
        digits), or "r" (the symbol); ``targets`` a comma-separated string or a sequence of
        module names (None: peft's default)."""
        if rank is None or (isinstance(rank, str) and rank.strip().lower() in ("", "none")):
            return None
        if isinstance(rank, LoRA):
            return rank
        if isinstance(rank, str) and rank.strip() == "r" or rank == r:
            value = r
        elif isinstance(rank, str) and rank.strip().isdigit():
            value = int(rank.strip())
        else:
            value = rank
        if value != r and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError("lora", rank, "a rank >= 1 (an integer), or r for the rank as a symbol",
                              "--lora 8 adds rank-8 adapters; leave it out for none.")
        names = None if targets is None else tuple(
            t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets))
        if names is not None and (not names or any(not n for n in names)):
            raise ConfigError("lora_targets", targets, "module names separated by commas, e.g. c_attn,c_proj")
        if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
            raise ConfigError("lora_dropout", dropout, "a dropout probability in [0, 1)")
        return LoRA(value, names, float(dropout))

    @property
    def symbol_value(self) -> dict:
        """The binding of ``r`` (empty while the rank is the symbol)."""
        return {} if self.rank == r else {r: sp.Integer(self.rank)}

    def __str__(self) -> str:
        where = ", ".join(self.targets) if self.targets else "peft's default targets"
        return (f"LoRA rank {self.rank} on {where}"
                + (f", dropout {self.dropout}" if self.dropout else ""))


@dataclass(frozen=True)
class AdapterDType:
    """Where the adapters' weights live on a half-precision model: ``float32`` (peft's default,
    ``upcast``) or the model's own dtype. Under autocast or in float32 the two agree."""
    name: str
    upcast: bool
    description: str


LORA_DTYPES = Registry("LoRA adapter dtype")
for _d in (AdapterDType("float32", True, "peft's default (autocast_adapter_dtype=True): on a bf16/fp16 model "
                                         "the adapters, their gradients and states in float32"),
           AdapterDType("model", False, "get_peft_model(..., autocast_adapter_dtype=False): the adapters in "
                                        "the model's dtype")):
    LORA_DTYPES.register(_d)
