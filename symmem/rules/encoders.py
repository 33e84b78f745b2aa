"""Ops of bidirectional encoders (BERT): a slice of a position buffer, the padding mask
transformers builds from the ``attention_mask`` of a batch, and the cast autocast makes at
the entry of ``F.cross_entropy``."""
from __future__ import annotations

import sympy as sp

from .core import BOOL, Footprint, TensorInfo, rule

__all__ = ["buffer_slice_rule", "padding_mask_rule", "cross_entropy_cast_rule"]


@rule("buffer_slice")
def buffer_slice_rule(node, ins, ctx):
    """``buffer[:, :s]`` of a (1, n) buffer, s the last dimension of the second input (the
    token ids): BertEmbeddings' ``self.position_ids[:, :seq_length]``. A view: nothing
    allocated, nothing saved, no gradient. Attribute ``gather``: a new tensor of that shape
    instead, BertEmbeddings' token types without ``token_type_ids``,
    ``torch.gather(self.token_type_ids.expand(1, -1), 1, position_ids)`` (8 s bytes)."""
    buf, ids = ins
    out = TensorInfo(tuple(buf.shape[:-1]) + (ids.shape[-1],), buf.dtype, True, False)
    return Footprint(out, alias=None if node.attr("gather") else 0, grads=(None, None))


@rule("padding_mask")
def padding_mask_rule(node, ins, ctx):
    """transformers' ``create_bidirectional_mask`` (``masking_utils.py``) for a 2-D
    ``attention_mask`` (b, s) beside the embeddings x (b, s, h), whose dtype the mask takes.

    It first makes ``attention_mask.to(torch.bool)`` (b*s bytes). Where some token is
    padding (``padded=True``), ``sdpa_mask`` combines the bidirectional mask function with the
    padding one (``and_masks``): ``padding_mask[batch_arange, kv_arange]`` (b, 1, 1, s) and'ed
    with the (1, 1, s, s) bidirectional mask gives a full boolean (b, 1, s, s) tensor (b*s^2
    bytes); ``eager_mask`` then makes ``torch.where(mask, torch.zeros((), dtype), min)``: the
    additive (b, 1, s, s) mask in x's dtype, which the model keeps until its encoder returns.
    At that ``where`` the boolean copy, the boolean mask and two 0-dim tensors in x's dtype
    (the zero and the wrapped minimum) exist beside it; all four are freed when the mask is
    returned (measured: ``tests/test_bert_measured.py``). Not counted: the moment before
    ``where``, when the int64 index ranges (8(b + 1 + 2s) bytes) and a few (s,)-sized boolean
    tensors exist instead of the (b, 1, s, s) output: larger only for tiny b*s^2 (s < 16 at
    b = 1 in bfloat16), and always below the embeddings' dropout just before it, which holds
    (b, s, h) tensors.
    For SDPA (``boolean=True``, set by the attention pass) ``sdpa_mask`` returns the boolean
    (b, 1, s, s) mask itself, which SDPA converts to a float copy in each layer
    (:func:`~symmem.rules.masks.sdpa_bool_mask_rule`).
    Without padding (``padded=False``) the mask is skipped (``allow_is_bidirectional_skip``):
    the output is a view of the 2-D mask, which no op reads; only the boolean copy existed."""
    m, x = ins
    bb, ss = m.shape
    if node.attr("padded") and node.attr("boolean"):
        # SDPA (sdpa_mask, no eager_mask after it): the boolean (b, 1, s, s) mask itself; at
        # the last `&` the boolean copy, padding_mask[batch_arange, kv_arange] (b*s bytes
        # each), the bidirectional part (1, 1, s, 1) and the int64 ranges (b, 1, s and s
        # elements) exist beside it
        temp = (2 * bb * ss + ss) * BOOL.nbytes + 8 * (bb + 1 + 2 * ss)
        return Footprint(TensorInfo((bb, sp.Integer(1), ss, ss), BOOL, True, False), fwd_temp=temp,
                         grads=(None, None))
    if not node.attr("padded"):
        return Footprint(TensorInfo(tuple(m.shape), m.dtype, True, False), alias=0, fwd_temp=bb * ss,
                         grads=(None, None))
    temp = (bb * ss + bb * ss * ss) * BOOL.nbytes + 2 * x.dtype.nbytes
    out = TensorInfo((bb, sp.Integer(1), ss, ss), x.dtype, True, False)
    return Footprint(out, fwd_temp=temp, grads=(None, None))


@rule("cross_entropy_cast")
def cross_entropy_cast_rule(node, ins, ctx):
    """What ``torch.autocast`` does at the entry of ``F.cross_entropy`` (aten
    ``cross_entropy_loss``): on the CPU it is on the fp32 list, so half logits are copied
    to float32 (the copy log_softmax reads, freed when log_softmax has run); on CUDA it is on
    no list (log_softmax then runs in float32 by its own entry). Otherwise x itself."""
    x = ins[0]
    cast = ctx.autocast_dtype("cross_entropy_loss")
    if cast is None or ctx.same(x.dtype, cast):
        return Footprint(x, alias=0, grads=("pass" if x.requires_grad else None,))
    return Footprint(TensorInfo(x.shape, cast, True, x.requires_grad), grads=("new" if x.requires_grad else None,))
