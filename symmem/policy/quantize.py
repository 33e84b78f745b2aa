"""Quantized frozen weights, as bitsandbytes stores them for Hugging Face's
``BitsAndBytesConfig`` (``load_in_8bit``, ``load_in_4bit``) and QLoRA (Dettmers et al. 2023).

``--quantize int8|int4`` replaces every linear layer but the output head (transformers keeps
``lm_head`` and the weights tied to it in their dtype: ``get_keys_to_not_convert``) by
bitsandbytes' layer, its weight frozen; biases, norms and embeddings stay as they are. The
pass is :mod:`symmem.passes.quantize`; the layers' rules are in :mod:`symmem.rules.quantized`.

- ``int8``: LLM.int8() (``bnb.nn.Linear8bitLt``, ``has_fp16_weights=False``): the weight in
  one byte per element and a float32 scale per output row (``SCB``):
  ``out*in + 4*out`` bytes (bitsandbytes/nn/modules.py, ``Int8Params._quantize``).
- ``int4``: NF4 with double quantization, QLoRA's setting (``bnb.nn.Linear4bit``,
  ``quant_type="nf4"``, ``compress_statistics=True``, blocks of 64): for n = out*in elements,
  ``ceil(n/2)`` packed bytes, an 8-bit scale per block of 64 (``absmax``: ceil(n/64) bytes),
  a float32 scale per 256 of those (``state2.absmax``), and per layer the NF4 code (16
  float32: 64 B), the nested 8-bit code (256 float32, copied per layer: 1024 B) and the
  float32 offset (4 B) (bitsandbytes/functional.py, ``quantize_4bit``, ``quantize_blockwise``).

Some layers can stay in the model's dtype (the seed's "fp32 for key layers, int4 elsewhere";
transformers' ``llm_int8_skip_modules``): ``quantize_skip`` names modules (``c_proj``, ``attn``:
every linear layer in the module) and layer ranges (``first:N``, ``last:N``: the first or last
N layers of the repeated block), comma-separated, as :mod:`symmem.policy.regions` reads them.

On CUDA int8 runs ``MatMul8bitLt`` (int8 products of the quantized input and weight), on the
CPU ``MatMul8bitFp`` (the weight dequantized): :func:`symmem.rules.quantized.linear_int8_rule`
has both.

The layer computes in the dtype its input arrives in (bitsandbytes' ``compute_dtype`` left
at the input's dtype, as a model loaded in that dtype runs): a pure precision (``fp32``,
``bf16``, ``fp16``). Autocast or master weights over a quantized model are refused; float32
layers around a bfloat16 4-bit compute (peft's ``prepare_model_for_kbit_training``) are not
modelled yet.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import sympy as sp

from .registry import Registry

__all__ = ["Quantization", "QUANTIZE", "INT4_BLOCK", "int4_bytes", "int8_bytes"]

#: NF4's block: one absmax per 64 weights; the nested block: one float32 per 256 absmax
INT4_BLOCK, NESTED_BLOCK = 64, 256
#: per 4-bit layer: the NF4 code (16 float32), the nested code (256 float32), the offset
INT4_CONSTANTS = sp.Integer(16 * 4 + 256 * 4 + 4)


def int4_bytes(out, in_) -> sp.Expr:
    """NF4, double quantization: ceil(n/2) + ceil(n/64) + 4 ceil(ceil(n/64)/256) + 1092."""
    n = out * in_
    blocks = sp.ceiling(n / INT4_BLOCK)
    return sp.ceiling(n / 2) + blocks + 4 * sp.ceiling(blocks / NESTED_BLOCK) + INT4_CONSTANTS


def int8_bytes(out, in_) -> sp.Expr:
    """LLM.int8(): the int8 weight and a float32 scale per output row, out*in + 4*out."""
    return out * in_ + 4 * out


@dataclass(frozen=True)
class Quantization:
    """A stored format of frozen linear weights: ``nbytes(out, in)``, the weight with its
    constants; ``op``: the rule its layers run (None: not quantized)."""
    name: str
    description: str
    nbytes: Callable | None = None
    op: str | None = None


QUANTIZE = Registry("quantization")
for _q in (Quantization("none", "weights in the precision's dtype"),
           Quantization("int8", "LLM.int8() (bitsandbytes Linear8bitLt): int8 weights and a float32 scale "
                        "per output row, frozen; every linear layer but the output head",
                        int8_bytes, "linear_int8"),
           Quantization("int4", "QLoRA's NF4 with double quantization (bitsandbytes Linear4bit): 4.13 bits "
                        "per weight with its scales, frozen; every linear layer but the output head",
                        int4_bytes, "linear_int4")):
    QUANTIZE.register(_q)
