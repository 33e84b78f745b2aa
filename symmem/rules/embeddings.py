"""Embeddings and the causal mask: token and learned position embeddings, Hugging
Face's additive causal mask. ``aten::embedding`` is on no autocast list, so these
produce the parameters' dtype (:attr:`symmem.rules.Ctx.param_dtype`: float32 under
autocast, the model dtype otherwise)."""
from __future__ import annotations

import sympy as sp

from .core import I64, Footprint, Saved, TensorInfo, rule

__all__ = ["embedding_rule", "positions_rule", "position_embedding_rule", "causal_mask_rule"]


@rule("embedding")
def embedding_rule(node, ins, ctx):
    """``F.embedding(ids, W)`` saves the indices (int64). Not autocast: the output has the
    weight's dtype. Backward builds a dense gradient of W's full size."""
    ids = ins[0]
    (w,) = node.params
    return Footprint(TensorInfo(tuple(ids.shape) + (w.shape[1],), ctx.param_dtype),
                     saved=(Saved("indices", "in0"),), grads=(None,))


@rule("positions")
def positions_rule(node, ins, ctx):
    """Hugging Face's position ids for a batch of token ids (b, s): ``arange(s)`` as int64,
    made in forward, used as a (1, s) view."""
    ss = ins[0].shape[-1]
    return Footprint(TensorInfo((sp.Integer(1), ss), I64, requires_grad=False), grads=(None,))


@rule("position_embedding")
def position_embedding_rule(node, ins, ctx):
    """GPT-2's learned positions: ``wpe(position_ids)`` of the (1, s) ids, which it saves
    (its weight's gradient needs them). Output (1, s, h), broadcast later."""
    ids = ins[0]
    (w,) = node.params
    ss = ids.shape[-1]
    return Footprint(TensorInfo((sp.Integer(1), ss, w.shape[1]), ctx.param_dtype),
                     saved=(Saved("position ids", "in0"),), grads=(None,))


@rule("causal_mask")
def causal_mask_rule(node, ins, ctx):
    """Hugging Face's eager causal mask: a (b, 1, s, s) additive mask (0 or the dtype's
    minimum) in the model's dtype, built once per forward and read by every layer."""
    ids = ins[0]
    bb, ss = ids.shape
    return Footprint(TensorInfo((bb, sp.Integer(1), ss, ss), ctx.param_dtype, requires_grad=False),
                     grads=(None,))
