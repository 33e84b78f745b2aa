"""The KV cache: what ``past_key_values.update`` makes of a layer's keys and values.

Read off transformers 5.24's ``cache_utils.py``; ``tests/test_inference_measured.py``
measures it on the CPU.
"""
from __future__ import annotations

import sympy as sp

from ..errors import ShapeError
from .core import Footprint, TensorInfo, rule

__all__ = ["kv_cache_rule"]


@rule("kv_cache")
def kv_cache_rule(node, ins, ctx):
    """``DynamicLayer.update``: ``self.keys = torch.cat([self.keys, key_states], dim=-2)``
    (the same for the values): a new contiguous (b, k, T, d) tensor in the dtype of the
    states it receives, T = attribute ``length`` (the positions cached after this step: s
    after a prefill of s tokens, s + n_g after the decoding step that brings it there). The
    previous tensor (T - 1 positions, or an empty one before the prefill) is dropped when
    ``self.keys`` is rebound, after the cat: the inference pass frees it there. Nothing is
    saved (inference runs under ``torch.no_grad``). Attribute ``kv_heads``: the heads as the
    model binds them (1 for multi-query attention, where repeating them is a view)."""
    (x,) = ins
    if len(x.shape) != 4:
        raise ShapeError(node.name, x.shape, "(batch, kv heads, sequence, head_dim) key or value states")
    length = sp.sympify(node.attr("length", x.shape[2]))
    heads = sp.sympify(node.attr("kv_heads", x.shape[1]))
    return Footprint(TensorInfo((x.shape[0], heads, length, x.shape[3]), x.dtype, True, False),
                     grads=(None,))
