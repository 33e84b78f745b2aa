"""Inference: the mode of a policy (a training step, or generation with a KV cache) and the
cache's kind (:mod:`symmem.passes.inference` models them)."""
from __future__ import annotations

from .registry import Registry
from .slots import Choice

__all__ = ["MODES", "CACHES", "LOGITS", "QUANTO_BITS"]

MODES = Registry("mode")
MODES.register(Choice("training", "one training step: forward, backward, optimizer step"))
MODES.register(Choice("inference", "generation under torch.no_grad with a KV cache: the prefill of the prompt "
                                   "and one decoding step (symmem infer)"))

CACHES = Registry("KV cache")
CACHES.register(Choice("dynamic", "transformers' DynamicCache (generate's default): each layer's keys and "
                                  "values concatenated step by step, torch.cat making the longer copy"))
CACHES.register(Choice("static", "transformers' StaticCache: each layer's keys and values preallocated for "
                                 "max_cache_len positions (s + n_g unless --max-cache-len) at the first update and "
                                 "written in place; attention runs over all max_cache_len positions"))
CACHES.register(Choice("fp8", "transformers' QuantizedCache(backend=\"fp8\"): each layer's keys and values in "
                              "float8_e4m3fn (1 byte an element) with one float32 scale per tensor, calibrated "
                              "at the prefill; each decoding step appends in fp8 and hands attention a "
                              "dequantized copy of the whole cache in the states' dtype"))
_QUANTO = ("transformers' QuantizedCache(backend=\"quanto\", nbits={bits}) (optimum-quanto 0.2.7): at the "
           "prefill each layer's keys and values quantized to {bits}-bit codes in groups of --q-group-size "
           "elements, a scale and a shift per group in the states' dtype; each decoding step dequantizes them, "
           "hands attention the cat of them, the residual (the positions since the last quantization, in the "
           "states' dtype) and the new position, and appends the new position to the residual, or, when the "
           "residual reaches --residual-length positions, re-quantizes everything (the flush). The decoding "
           "step modelled is the one whose residual holds --residual-position positions before it")
#: the bits of each quanto cache's codes (QuantoQuantizedLayer's ``nbits``)
QUANTO_BITS = {"quanto-int4": 4, "quanto-int2": 2}
for _name, _bits in QUANTO_BITS.items():
    CACHES.register(Choice(_name, _QUANTO.format(bits=_bits)))

LOGITS = Registry("logits")
LOGITS.register(Choice("last", "generate's logits_to_keep=1: the prefill projects the last position only, "
                               "(b, 1, V) logits"))
LOGITS.register(Choice("all", "the model's forward without logits_to_keep: the prefill's (b, s, V) logits"))
