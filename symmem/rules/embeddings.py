"""Embeddings and the causal mask: token and learned position embeddings, rotary
position embeddings (Llama's cos/sin tables and their application to q and k), Hugging
Face's additive causal mask. ``aten::embedding`` is on no autocast list, so these
produce the parameters' dtype (:attr:`symmem.rules.Ctx.param_dtype`: float32 under
autocast, the model dtype otherwise)."""
from __future__ import annotations

import sympy as sp

from .core import F32, I64, Footprint, Saved, TensorInfo, _grads, _promote, _same, rule

__all__ = ["embedding_rule", "positions_rule", "position_embedding_rule", "causal_mask_rule", "rotary_rule",
           "rope_rule", "ones_like_ids_rule", "cumsum_positions_rule", "offset_ids_rule"]


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


@rule("ones_like_ids")
def ones_like_ids_rule(node, ins, ctx):
    """OPT's position mask: ``torch.ones(b, past_seen_tokens + q)`` for ids (b, q), float32,
    no gradient (``OPTDecoder.forward``, transformers 5.24 ``modeling_opt.py`` lines 351-354,
    when no ``attention_mask`` is passed). Attribute ``length``: its columns, every position
    seen (with a KV cache, the cached ones and the step's: s + n_g in a decoding step that
    brings the cache to s + n_g); the ids' q by default (training, the prefill)."""
    ids = ins[0]
    length = sp.sympify(node.attr("length", ids.shape[-1]))
    return Footprint(TensorInfo((*ids.shape[:-1], length), F32, requires_grad=False), grads=(None,))


@rule("cumsum_positions")
def cumsum_positions_rule(node, ins, ctx):
    """OPT's position ids from its mask m (b, n): ``c = cumsum(m); (c * m - 1).long()``: int64
    (8 bytes each); c (float32) lives until the result is made, beside ``c * m - 1`` (8 bytes
    per element of scratch at the end; c, c * m and c * m - 1 before it: 12, less)
    (``modeling_opt.py`` lines 357-359). Over every position seen: with a KV cache n is the
    mask's s + n_g columns, of which ``position_ids[:, past_seen_tokens:]`` (line 361) keeps
    the step's as a view (:func:`offset_ids_rule`), so the (b, n) int64 storage stays."""
    m = ins[0]
    return Footprint(TensorInfo(tuple(m.shape), I64, requires_grad=False), fwd_temp=8 * m.numel, grads=(None,))


@rule("offset_ids")
def offset_ids_rule(node, ins, ctx):
    """``position_ids[:, past_seen_tokens:] + offset`` (OPT's learned positions start at 2;
    ``modeling_opt.py`` lines 361 and 71): the slice a view, the sum a new int64 tensor of
    its last ``columns`` columns (attribute: the step's q in a decoding step; all of them by
    default)."""
    ids = ins[0]
    columns = sp.sympify(node.attr("columns", ids.shape[-1]))
    return Footprint(TensorInfo((*ids.shape[:-1], columns), I64, requires_grad=False), grads=(None,))


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
    minimum) in the model's dtype, built once per forward and read by every layer. With a
    KV cache its columns are the cached positions: attribute ``kv_len`` (b, 1, s, kv_len)."""
    ids = ins[0]
    bb, ss = ids.shape
    kv = sp.sympify(node.attr("kv_len", ss))
    return Footprint(TensorInfo((bb, sp.Integer(1), ss, kv), ctx.param_dtype, requires_grad=False),
                     grads=(None,))


@rule("rotary")
def rotary_rule(node, ins, ctx):
    """Llama's ``LlamaRotaryEmbedding.forward(x, position_ids)``: freqs = ids[..., None].float()
    * inv_freq, (1, s, d/2) float32; emb = cat(freqs, freqs), (1, s, d); cos = emb.cos() *
    scaling and sin = emb.sin() * scaling (each a new float32 tensor, the first product freed),
    returned ``.to(x.dtype)``. One node per returned tensor (``which``: cos, sin), inputs the
    position ids and x; no gradient. Its temporaries (freqs, emb, the float32 cos and sin,
    8 + 2 bytes per s*d before the copies) live until it returns: the cos node's scratch is
    freqs, emb and cos's first product (10 bytes per s*d; a half x adds the float32 cos beside its
    copy: 14 - 2), the sin node's the same beside the cos returned (10; half: 14, the float32 cos
    and sin beside both copies). ``dim``: d, the rotated head dimension."""
    ids, x = ins
    d = sp.sympify(node.attr("dim"))
    ss = ids.shape[-1]
    sd = ss * d
    half = not ctx.same(x.dtype, F32)
    temp = (14 if half else 10) * sd - (2 * sd if half and node.attr("which") == "cos" else 0)
    return Footprint(TensorInfo((sp.Integer(1), ss, d), x.dtype, requires_grad=False), fwd_temp=temp,
                     grads=(None, None))


@rule("rope")
def rope_rule(node, ins, ctx):
    """``apply_rotary_pos_emb`` on one of q, k (b, heads, s, d): ``x * cos + rotate_half(x) * sin``
    with rotate_half = ``cat(-x2, x1)`` of the two halves of the last dimension. MulBackward0
    saves cos and sin (references: they live for the whole step); x is not saved. Forward
    makes x*cos, -x2 (freed after the cat), the cat (freed after its product), its product
    with sin, and their sum: at the sum, two temporaries of the output's size. The output
    keeps x's layout (the first operand's: a head view stays sequence-major), in x's dtype
    promoted with the tables' (float32 under autocast, where cos and sin are float32). Tables
    narrower than x rotate its first dimensions only (GPT-NeoX's ``rotary_pct``)."""
    x, cos, sin = ins
    dt = _promote(x.dtype, cos.dtype)
    saved = (Saved("rope cos", "in1"), Saved("rope sin", "in2")) if x.requires_grad else ()
    grads = _grads(ins[:1]) + (None, None)
    n = x.numel
    if _same(cos.shape[-1], x.shape[-1]):
        out = TensorInfo(x.shape, dt, x.contiguous, x.requires_grad, seq_major=x.seq_major)
        return Footprint(out, saved=saved, fwd_temp=2 * n * dt.nbytes, grads=grads)
    # partial rotation (GPT-NeoX: the first r of d dimensions): the rotated part as above, n_r =
    # n*r/d elements, then cat([rotated, x[..., r:]]) into a new contiguous output; its largest
    # moment is 3 n_r beside nothing else, or the rotated part beside the output
    n_r = n * cos.shape[-1] / x.shape[-1]
    out = TensorInfo(x.shape, dt, True, x.requires_grad)
    return Footprint(out, saved=saved, fwd_temp=sp.Max(3 * n_r - n, n_r) * dt.nbytes, grads=grads)
