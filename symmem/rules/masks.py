"""Boolean attention masks transformers passes to SDPA, and SDPA's conversion of them.

From the sequence length equal to a sliding window on (Mistral), transformers'
``sdpa_mask`` (``masking_utils.py``) materialises the window's boolean mask instead of
leaving SDPA its ``is_causal`` flag; ``scaled_dot_product_attention``
(``aten/src/ATen/native/transformers/attention.cpp``) turns a boolean ``attn_mask`` into an
additive one in the query's dtype (``convert_boolean_attn_mask``) before it picks its
kernel's entry, and the kernel keeps that float mask for backward.
"""
from __future__ import annotations

import sympy as sp

from .core import BOOL, Footprint, TensorInfo, rule

__all__ = ["window_mask_rule", "mask_expand_rule", "sdpa_bool_mask_rule", "sdpa_bias_expand_rule"]


@rule("window_mask")
def window_mask_rule(node, ins, ctx):
    """``sdpa_mask`` with ``sliding_window_causal_mask_function(w)`` and no padding, on the
    (b, s) ids: the index ranges broadcast as (b, 1, 1, 1), (1, 1, 1, 1), (1, 1, s, 1) and
    (1, 1, 1, s) go through ``and_masks``: ``ones(()) & (kv > q - w)`` then ``& (kv <= q)``,
    each comparison and each ``&`` a new (1, 1, s, s) boolean tensor; ``expand(b, -1, s, s)``
    is a view. Output: the (1, 1, s, s) boolean mask (s^2 bytes) the model keeps until its
    forward returns and passes to every layer. At the last ``&`` the previous result and the
    causal comparison (2 s^2 bytes) exist beside it; the int64 ranges (8(b + 1 + 2s) bytes,
    and ``q - w``'s 8s) are not counted: smaller than the (b, s, h) embeddings made just
    before, which are not yet freed either."""
    ids = ins[0]
    ss = ids.shape[-1]
    one = sp.Integer(1)
    return Footprint(TensorInfo((one, one, ss, ss), BOOL, True, False), fwd_temp=2 * ss * ss * BOOL.nbytes,
                     grads=(None,))


@rule("mask_expand")
def mask_expand_rule(node, ins, ctx):
    """``attention_mask.expand(b, -1, s, s)`` of a (1, 1, s, s) mask, the batch taken from the
    (b, s) ids: a view (stride 0 over the batch), nothing allocated. Also BERT's token types
    from its buffer, ``buffered_token_type_ids.expand(b, s)`` of a (1, s) slice."""
    mask, ids = ins
    out = TensorInfo((ids.shape[0],) + tuple(mask.shape[1:]), mask.dtype, False, False)
    return Footprint(out, alias=0, grads=(None, None))


@rule("sdpa_bias_expand")
def sdpa_bias_expand_rule(node, ins, ctx):
    """``preprocess_mask``'s ``mask.expand(b, a, s_q, s_k)`` (PyTorch's ``attention.cpp``,
    before the CUDA mem-efficient kernel) of a float (1, a, s_q, s_k) mask: a view, nothing
    allocated. Backward (ExpandBackward0): the gradient summed over the batch, a new
    (1, a, s_q, s_k) tensor; at b = 1 the gradient itself. Inputs: the mask, the query
    (b, a, s_q, d) and the key (b, a, s_k, d)."""
    mask, q, key = ins
    out = TensorInfo((q.shape[0], mask.shape[1], q.shape[2], key.shape[2]), mask.dtype, False, mask.requires_grad)
    return Footprint(out, alias=0, grads=(("pass" if ctx.batch_view(q) else "new") if mask.requires_grad else None,
                                          None, None))


@rule("sdpa_bool_mask")
def sdpa_bool_mask_rule(node, ins, ctx):
    """``convert_boolean_attn_mask(attn_mask, query.dtype())``: ``at::where(mask, 0.0,
    scalar_tensor(-inf))`` on the boolean mask expanded to the batch (stride 0), so a new,
    full (b, 1, s, s) tensor in the dtype the query reaches SDPA in (autocast's for
    ``scaled_dot_product_attention``, else the query's). Inputs: the (b, 1, s, s) expanded mask
    and the query (b, a, s, d). The 0-dim ``-inf`` tensor and the wrapped 0.0 exist while it is
    made (measured)."""
    mask, q = ins
    dt = ctx.autocast_dtype("scaled_dot_product_attention") or q.dtype
    out = TensorInfo(tuple(mask.shape), dt, True, False)
    return Footprint(out, fwd_temp=dt.nbytes + 8, grads=(None, None))
