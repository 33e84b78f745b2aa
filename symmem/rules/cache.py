"""The KV cache: what ``past_key_values.update`` makes of a layer's keys and values.

Read off transformers 5.24's ``cache_utils.py``; ``tests/test_inference_measured.py``
measures it on the CPU.
"""
from __future__ import annotations

import sympy as sp

from ..errors import ShapeError
from .core import BOOL, F32, I64, Footprint, TensorInfo, rule
from .fp8 import FP8

__all__ = ["kv_cache_rule", "static_update_temp", "static_sdpa_mask_rule", "sdpa_float_mask_rule",
           "static_seq_length_rule", "fp8_scale_rule", "fp8_quantize_rule", "fp8_dequantize_rule", "fp8_cast_temp", "kv_one_head_rule"]


@rule("kv_cache")
def kv_cache_rule(node, ins, ctx):
    """``DynamicLayer.update``: ``self.keys = torch.cat([self.keys, key_states], dim=-2)``
    (the same for the values): a new contiguous (b, k, T, d) tensor in the dtype of the
    states it receives, T = attribute ``length`` (the positions cached after this step: s
    after a prefill of s tokens, s + n_g after the decoding step that brings it there). The
    previous tensor (T - 1 positions, or an empty one before the prefill) is dropped when
    ``self.keys`` is rebound, after the cat: the inference pass frees it there. Nothing is
    saved (inference runs under ``torch.no_grad``). Attribute ``kv_heads``: the heads as the
    model binds them (1 for multi-query attention, where repeating them is a view).

    ``static``: transformers' ``StaticLayer.update`` instead, T = max_cache_len; its scratch
    in :func:`static_update_temp` (``which``: k or v).

    ``fp8`` (``QuantizedCache(backend="fp8")``'s ``Fp8QuantizedLayer``): ``"calibrated"`` at the
    prefill, the states quantized whole with their scale (inputs: the states, the
    :func:`fp8_scale_rule` node), ``(x.float() / scale).to(float8_e4m3fn)``: a (b, k, s, d)
    fp8 tensor, its scratch in :func:`fp8_cast_temp`; ``"append"`` in a decoding step,
    ``torch.cat([quantized_keys, new_keys], dim=-2)`` of the :func:`fp8_quantize_rule` node's
    new positions: a (b, k, T, d) fp8 tensor, as the dynamic cache's cat."""
    if node.attr("fp8") == "calibrated":
        x = ins[0]
        return Footprint(TensorInfo(x.shape, FP8, requires_grad=False), grads=(None, None),
                         fwd_temp=fp8_cast_temp(x))
    (x,) = ins
    if len(x.shape) != 4:
        raise ShapeError(node.name, x.shape, "(batch, kv heads, sequence, head_dim) key or value states")
    length = sp.sympify(node.attr("length", x.shape[2]))
    heads = sp.sympify(node.attr("kv_heads", x.shape[1]))
    temp = static_update_temp(x.shape[2]) if node.attr("static") and node.attr("which") == "v" else 0
    return Footprint(TensorInfo((x.shape[0], heads, length, x.shape[3]), x.dtype, True, False),
                     grads=(None,), fwd_temp=temp)


def static_update_temp(new):
    """``StaticLayer.update`` (transformers 5.24) for ``new`` positions: at the first call
    ``lazy_initialization`` allocates ``torch.zeros`` keys and values of (b, k, max_cache_len,
    d) (the key node's and the value node's outputs; the inference pass allocates them before
    a decoding step instead); then ``cache_position = torch.arange(new) + cumulative_length``,
    two int64 tensors of ``new`` positions while the sum is made (16 bytes a position; the
    arange freed after it, the sum kept through both ``index_copy_``, which write in place and
    allocate nothing). Charged to the value node, when both tensors exist."""
    return 16 * sp.sympify(new)


@rule("kv_one_head")
def kv_one_head_rule(node, ins, ctx):
    """Key or value states of one kv head (multi-query attention, the model binding k = 1) as
    a quantized cache's prefill hands them back to attention: a (b, 1, q, d) view of them,
    contiguous even where it is a transposed view (PyTorch ignores the stride of a dimension
    of size 1), so that ``repeat_kv``'s reshape is a view and ``.contiguous()`` returns the
    tensor itself. Nothing allocated. Input: the states (b, k, q, d)."""
    (x,) = ins
    return Footprint(TensorInfo((x.shape[0], sp.Integer(1), *x.shape[2:]), x.dtype, True, x.requires_grad), alias=0,
                     grads=(None,))


@rule("static_sdpa_mask")
def static_sdpa_mask_rule(node, ins, ctx):
    """The boolean mask ``create_causal_mask`` makes for SDPA in a StaticCache's decoding
    step (``masking_utils.py``: ``allow_is_causal_skip`` is off for a compileable cache with
    one query, so ``sdpa_mask`` materialises it): ``kv_idx <= q_idx`` broadcast from the
    (1, 1, q, 1) and (1, 1, 1, T) index tensors into a (1, 1, q, T) bool tensor (q·T bytes),
    then ``expand``-ed to (b, 1, q, T), a view. T = attribute ``kv_len`` (max_cache_len); the
    model's ``causal_mask`` local holds it through every layer. Input: the token ids (b, q)."""
    ids = ins[0]
    q = ids.shape[-1]
    return Footprint(TensorInfo((sp.Integer(1), sp.Integer(1), q, sp.sympify(node.attr("kv_len"))), BOOL,
                                requires_grad=False), grads=(None,))


@rule("sdpa_float_mask")
def sdpa_float_mask_rule(node, ins, ctx):
    """``scaled_dot_product_attention`` handed a boolean ``attn_mask`` (PyTorch's
    ``convert_boolean_attn_mask`` in ``aten/src/ATen/native/transformers/attention.cpp``):
    ``at::where(mask, 0, -inf)`` in the query's dtype (autocast's when it runs), of the
    mask's expanded shape (b, 1, q, T), made before the kernel and freed when SDPA returns
    (the pass holds it until the attention node). Inputs: the boolean mask, the query
    (b, a, q, d)."""
    mask, q = ins
    dt = ctx.autocast_dtype("scaled_dot_product_attention") or q.dtype
    return Footprint(TensorInfo((q.shape[0], sp.Integer(1), q.shape[2], mask.shape[-1]), dt, requires_grad=False),
                     grads=(None, None))


@rule("static_seq_length")
def static_seq_length_rule(node, ins, ctx):
    """``seq_length = past_seen_tokens + q`` (OPT's ``OPTDecoder.forward``, transformers 5.24
    ``modeling_opt.py`` line 353) when the cache counts in a tensor: ``StaticLayer.get_seq_length``
    returns its ``cumulative_length`` (``cache_utils.py`` line 504), a 0-dim int64, once the
    prefill has initialised it, so the sum is a new 0-dim int64 tensor: 8 bytes, a local of the
    decoder until it returns. Input: the token ids (b, q)."""
    return Footprint(TensorInfo((), I64, requires_grad=False), grads=(None,))


def fp8_cast_temp(x) -> sp.Expr:
    """Scratch of ``Fp8QuantizedLayer._quantize``'s ``(x.float() / scale).to(float8_e4m3fn)``
    on states ``x`` of N elements, beyond its fp8 output (N bytes): ``x.float()`` is a float32
    copy (4N; ``x`` itself in float32), the division another 4N while it lives; the copy is
    freed, then the cast makes the output while the quotient lives. Largest: 8N with a copy
    (7N beyond the output), else 4N + N (4N beyond it)."""
    n = x.numel
    return 4 * n if x.dtype.nbytes == 4 else 7 * n


@rule("kv_fp8_scale")
def fp8_scale_rule(node, ins, ctx):
    """``Fp8QuantizedLayer._quantize``'s calibration at the prefill (transformers 5.24
    ``cache_utils.py``): ``scale = (x.abs().amax().float() / fp8_max).clamp(min=tiny)``, a
    0-dim float32 (4 bytes) the cache keeps with its tensor. Largest moment: ``x.abs()`` (N
    elements in x's B bytes) with its 0-dim ``amax`` (B bytes), before the scale exists, so the
    scratch beyond it is B·N + B - 4. Input: the key or value states (b, k, s, d)."""
    (x,) = ins
    return Footprint(TensorInfo((), F32, requires_grad=False), grads=(None,),
                     fwd_temp=x.numel * x.dtype.nbytes + x.dtype.nbytes - 4)


@rule("kv_fp8_quantize")
def fp8_quantize_rule(node, ins, ctx):
    """``Fp8QuantizedLayer.update``'s ``new_keys, _ = self._quantize(key_states, scale=key_scale)``
    in a decoding step: the step's states in fp8 with the prefill's scale, a local of
    ``update`` until it returns; scratch :func:`fp8_cast_temp`. Input: the new key or value
    states (b, k, q, d)."""
    (x,) = ins
    return Footprint(TensorInfo(x.shape, FP8, requires_grad=False), grads=(None,), fwd_temp=fp8_cast_temp(x))


@rule("kv_fp8_dequantize")
def fp8_dequantize_rule(node, ins, ctx):
    """``Fp8QuantizedLayer._dequantize``: ``(quant_tensor.float() * scale).to(self.keys.dtype)``
    over the whole cache (N elements), what ``update`` returns to the attention: a (b, k, T, d)
    tensor in the states' dtype (B bytes; ``self.keys`` is an empty tensor of the prefill's). ``float()`` makes 4N, the product
    another 4N while it lives (8N), then the cast B·N while the product lives (none in
    float32, where the product is the result): scratch 8N - B·N beyond the output. Inputs:
    the fp8 cache tensor, the step's new states (b, k, q, d) in their dtype."""
    x, states = ins
    dt = states.dtype
    return Footprint(TensorInfo(x.shape, dt, requires_grad=False), grads=(None, None),
                     fwd_temp=8 * x.numel - x.numel * dt.nbytes)
