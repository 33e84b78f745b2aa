"""Encoder-decoder ops of T5 (transformers' ``modeling_t5.py``): the relative position bias
(and the float mask SDPA gets made of it), the decoder's input ids made from the labels, T5's
layer norm in a half-precision model, the copy autocast makes at an op's entry (the loss, SDPA's
mask), and T5's float16 clamp.

The position bias is computed once per stack, in its first layer (``T5Attention.compute_bias``),
and added to the scores of every layer; none of these ops is on an autocast list but
``log`` (float32 on CUDA, whose input is float32 already).
"""
from __future__ import annotations

import sympy as sp

from ..errors import ConfigError
from .core import BOOL, F32, I64, Footprint, Saved, TensorInfo, _grads, maximum, rule

__all__ = ["bias_mask_rule", "position_pair_rule", "relative_position_rule", "position_bucket_rule", "bias_heads_rule",
           "zeros_bias_rule", "shift_right_rule", "autocast_copy_rule", "t5_layer_norm_rule", "fp16_clamp_rule"]


def _lengths(node, ins):
    """(s_q, s_k): the query's and the key's sequence lengths, from (b, a, s, d) heads."""
    return ins[0].shape[-2], ins[1].shape[-2]


@rule("position_pair")
def position_pair_rule(node, ins, ctx):
    """``compute_bias``'s ``arange(s_q)[:, None] + past_seen_tokens`` and ``arange(s_k)[None, :]``:
    two int64 tensors, written as one value of s_q + s_k elements (inputs: the query and key
    heads, read for their lengths). ``+ 0`` copies the first arange, which is freed after it:
    at that moment 16 s_q bytes, the two results' 8 (s_q + s_k) when s_q = s_k, as in
    self-attention, where the bias is computed."""
    sq, sk = _lengths(node, ins)
    return Footprint(TensorInfo((sq + sk,), I64, requires_grad=False), fwd_temp=8 * maximum(0, sq - sk),
                     grads=(None, None))


@rule("relative_position")
def relative_position_rule(node, ins, ctx):
    """``memory_position - context_position``: the (s_q, s_k) int64 relative positions
    (inputs: the position pair, the query and key heads for the lengths)."""
    sq, sk = _lengths(node, ins[1:])
    return Footprint(TensorInfo((sq, sk), I64, requires_grad=False), grads=(None, None, None))


@rule("position_bucket")
def position_bucket_rule(node, ins, ctx):
    """``T5Attention._relative_position_bucket(relative_position, bidirectional, ...)``: the
    (s_q, s_k) int64 bucket of each relative position. Written in Python over n = s_q s_k
    elements; its largest moment (after ``torch.min(large, full_like(large, n_b - 1))``, the
    input held by the caller), besides the input (8n) and the buckets (8n):

    - bidirectional (the encoder): the sign buckets are the result already; ``abs`` (8n),
      ``is_small`` (bool, n), the large positions, the full tensor and their minimum (8n
      each): 33n bytes;
    - causal (the decoder): the buckets do not exist yet (``0 + where`` makes them last); the
      negated positions (8n), ``is_small`` (n), large, full and the minimum (24n) beside the
      minimum's (8n) in place of the buckets: 25n bytes beside the result counted at the end
      (the same 41n at ``0 + where``: input, negated, is_small, large, where, result).

    (The float chain, ``log(x.float() / max_exact) ...``, holds at most 16n besides the
    inputs: below both.)"""
    rp = ins[0]
    n = rp.numel
    temp = 33 * n if node.attr("bidirectional") else 25 * n
    return Footprint(TensorInfo(tuple(rp.shape), I64, requires_grad=False), fwd_temp=temp, grads=(None,))


@rule("bias_heads")
def bias_heads_rule(node, ins, ctx):
    """``values.permute([2, 0, 1]).unsqueeze(0)``: the (s_q, s_k, a) bias as (1, a, s_q, s_k),
    a view (not contiguous)."""
    x = ins[0]
    sq, sk, a = x.shape
    out = TensorInfo((sp.Integer(1), a, sq, sk), x.dtype, False, x.requires_grad)
    return Footprint(out, alias=0, grads=_grads(ins, "pass"))


@rule("bias_mask")
def bias_mask_rule(node, ins, ctx):
    """transformers' ``create_position_bias_mask`` (``integrations/sdpa_attention.py``): the
    position bias made SDPA's float ``attn_mask``, ``.contiguous()``. ``mode``:

    - ``"contiguous"`` (no mask, not causal: T5's encoder): the bias itself, copied where it is
      a view that is not contiguous (the first layer's permuted embedding: a copy per layer);
      the copy's gradient is handed on;
    - ``"causal"`` (T5's decoder): ``torch.where(arange(s_q)[:, None] >= arange(s_k)[None, :],
      bias, min)``: a new tensor; WhereBackward saves the (s_q, s_k) bool condition; the two
      int64 aranges (8 (s_q + s_k) bytes) exist while the condition is made."""
    x = ins[0]
    mode = node.attr("mode")
    if mode == "contiguous":
        if x.contiguous:
            return Footprint(x, alias=0, grads=_grads(ins, "pass"))
        return Footprint(TensorInfo(x.shape, x.dtype, True, x.requires_grad), grads=_grads(ins, "pass"))
    if mode != "causal":
        raise ConfigError("bias_mask mode", mode, "contiguous or causal")
    sq, sk = x.shape[-2], x.shape[-1]
    out = TensorInfo(x.shape, x.dtype, True, x.requires_grad)
    saved = (Saved("where condition", "new", sq * sk, BOOL),) if x.requires_grad else ()
    temp = maximum(0, 8 * (sq + sk) - out.nbytes - (0 if x.requires_grad else sq * sk))
    return Footprint(out, saved=saved, fwd_temp=temp, grads=_grads(ins))


@rule("zeros_bias")
def zeros_bias_rule(node, ins, ctx):
    """The position bias of an attention without relative buckets (T5's cross-attention):
    ``torch.zeros((1, a, s_q, s_k), dtype=query.dtype)`` (inputs: the query and key heads).
    No gradient, but with attribute ``requires_grad`` (T5Attention under gradient
    checkpointing sets ``position_bias.requires_grad = True``): a leaf whose gradient,
    summed over the layers reading it, AccumulateGrad makes its ``.grad``; the graph keeps the
    tensor (and so its gradient) as long as the training loop keeps the loss. With
    ``grad_kept=False`` (the reentrant checkpoint, which makes the tensor under ``no_grad``:
    the later layers read the checkpoint's output) the gradient is made and summed as well, but
    not kept: no leaf."""
    q, k = ins[:2]
    grad = bool(node.attr("requires_grad", False))
    leaf = grad and node.attr("grad_kept", True)
    out = TensorInfo((sp.Integer(1), q.shape[1], q.shape[2], k.shape[2]), q.dtype, requires_grad=grad)
    saved = (Saved("the leaf (AccumulateGrad's variable)", "out", hooked=False, graph=True),) if leaf else ()
    return Footprint(out, saved=saved, grads=(None, None), leaf=leaf)


@rule("shift_right")
def shift_right_rule(node, ins, ctx):
    """``T5PreTrainedModel._shift_right(labels)``: ``labels.new_zeros(b, s_d)`` (the result,
    int64), ``labels[..., :-1].clone()`` copied into it (b(s_d - 1) int64, freed after), then
    ``masked_fill_`` with ``shifted == -100`` (bool, b s_d, freed after)."""
    x = ins[0]
    rows = x.numel / x.shape[-1]
    temp = maximum(8 * rows * (x.shape[-1] - 1), rows * x.shape[-1])
    return Footprint(TensorInfo(tuple(x.shape), I64, requires_grad=False), fwd_temp=temp, grads=(None,))


@rule("autocast_copy")
def autocast_copy_rule(node, ins, ctx):
    """The copy ``torch.autocast`` makes of a floating input of an aten op
    whose cast policy gives another dtype (attribute ``aten``: ``cross_entropy_loss``: float32 on the CPU list,
    not on CUDA's): a new tensor, whose gradient ToCopyBackward casts back (a new gradient of
    the input's size and dtype); x itself where autocast leaves the op alone or x has the
    dtype already. The wrapper holds the copy until the op returns (the model holds it)."""
    x = ins[0]
    dt = ctx.autocast_dtype(node.attr("aten"), x.dtype)
    if dt is None or ctx.same(dt, x.dtype):
        return Footprint(x, alias=0, grads=_grads(ins, "pass"))
    return Footprint(TensorInfo(x.shape, dt, x.contiguous, x.requires_grad), grads=_grads(ins))


@rule("t5_layer_norm")
def t5_layer_norm_rule(node, ins, ctx):
    """``T5LayerNorm`` (``modeling_t5.py``)::

        variance = x.to(float32).pow(2).mean(-1, keepdim=True)
        y = x * torch.rsqrt(variance + eps)
        if weight.dtype in (float16, bfloat16): y = y.to(weight.dtype)
        return weight * y

    For a float32 x (float32 weights, or autocast's float32 residual stream) this is Llama's
    RMSNorm op for op (:func:`symmem.rules.normalization.rms_norm_rule`). For a half x (a
    half-precision model), ``x * rsqrt`` multiplies x itself, not its float32 copy: MulBackward0
    saves x (no new memory, but x is kept) beside the float32 copy pow saves, rsqrt's float32
    result and ``y`` in the half dtype; the product is float32 (x promoted), copied to the
    weight's dtype."""
    from .normalization import rms_norm_rule
    x = ins[0]
    if ctx.same(x.dtype, F32):
        return rms_norm_rule(node, ins, ctx)
    w = node.params[0]
    rows = x.numel / x.shape[-1]
    n = x.numel
    hb = x.dtype.nbytes
    saved = []
    if x.requires_grad:
        saved += [Saved("t5-norm float32 input", "new", n, F32), Saved("t5-norm input", "in0"),
                  Saved("t5-norm rsqrt", "new", rows, F32)]
    if w.trainable:
        saved.append(Saved("t5-norm normalized", "new", n, x.dtype))
    if x.requires_grad:
        saved.append(Saved("t5-norm weight", "param:0"))
    out = TensorInfo(x.shape, x.dtype, True, x.requires_grad or w.trainable)
    # forward, at the copy: the float32 product and the local ``variance`` (rows, float32)
    temp = 4 * n + 4 * rows
    if not x.requires_grad:
        bwd = n * out.dtype.nbytes if w.trainable else 0
    else:
        # backward's largest moment is pow's backward, grad * (2 * x32.pow(1)): four float32
        # tensors of x's size (mean's expanded gradient, pow, the * 2, the product), by when the
        # output's gradient, y, rsqrt and x itself (MulBackward0's) are released; the gradient
        # x gets from ``x * rsqrt`` (cast back to x's dtype) is x's new gradient, or with
        # ``residual=True`` joins the one the residual add gave x at once (then the lowering's
        # second gradient of x is not there) (measured)
        joined = node.attr("residual", False)
        bwd = (16 * n - n * out.dtype.nbytes - n * hb - (n * hb if w.trainable else 0) - 4 * rows
               - (n * hb if joined else 0))
    return Footprint(out, saved=tuple(saved), fwd_temp=temp, grads=_grads(ins), bwd_temp=bwd)


@rule("fp16_clamp")
def fp16_clamp_rule(node, ins, ctx):
    """``T5Block``'s clamp of float16 hidden states after each sub-layer (``torch.where(isinf(x)
    .any(), ...)`` then ``torch.clamp``): only for float16 hidden states, which a float16 model
    (not autocast, whose residual stream is float32) has; not modelled, so refused there.
    Otherwise nothing happens: x itself."""
    x = ins[0]
    if x.dtype.name == "float16" or (x.dtype == ctx.act and ctx.act_name == "float16"):
        raise ConfigError("precision", "fp16", "a precision whose hidden states are not float16 (T5 clamps "
                          "float16 hidden states after every sub-layer, which symmem does not model)",
                          "Train in bf16, bf16-mixed or fp16-mixed.")
    return Footprint(x, alias=0, grads=_grads(ins, "pass"))
