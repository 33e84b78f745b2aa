"""Linear layers with quantized frozen weights: bitsandbytes' ``Linear4bit`` (NF4 with double
quantization, QLoRA's) and ``Linear8bitLt`` (LLM.int8()), as transformers' ``load_in_4bit`` /
``load_in_8bit`` make them (layouts: :mod:`symmem.policy.quantize`). The weight is (out, in),
frozen; the layer computes in its input's dtype (``compute_dtype`` the model's dtype; the
quantize pass refuses autocast).

Neither layer saves anything through ``save_for_backward``: what its backward needs rides on
``ctx`` attributes, which saved-tensor hooks (and so checkpoints) never see.
"""
from __future__ import annotations

import sympy as sp

from ..errors import ShapeError
from .core import DType, Footprint, Saved, TensorInfo, _grads, _same, rule

__all__ = ["linear_int4_rule", "linear_int8_rule"]


def _shapes(node, x):
    out_features, in_features = node.params[0].shape
    if not _same(x.shape[-1], in_features):
        raise ShapeError(node.name, x.shape, f"a last dimension of {in_features}")
    return TensorInfo(tuple(x.shape[:-1]) + (out_features,), x.dtype, True, x.requires_grad)


@rule("linear_int4")
def linear_int4_rule(node, ins, ctx):
    """``bnb.nn.Linear4bit`` -> ``bnb.matmul_4bit`` -> ``MatMul4Bit`` (bitsandbytes/autograd/
    _functions.py) with a nested quantization state: ``gemm_4bit`` dequantizes the 8-bit block
    scales to float32 and adds the offset (4 ceil(n/64) bytes; on CUDA the dequantized scales
    stay referenced beside their sum: 8 ceil(n/64)), the weight to the input's dtype (n
    elements), then ``F.linear`` (CPU: backends/default/ops.py, ``_gemm_4bit_default_impl``;
    CUDA: backends/cuda/ops.py, ``_dequant_linear_fallback``, taken above 1536 rows of input,
    b*s > 1536, or where bitsandbytes' heuristic declines its fused kernel, which dequantizes
    nothing whole: there this scratch is an upper bound). ``ctx.tensors = (None, B)``: the
    packed weight, no new memory. Backward: ``grad_output @ F.dequantize_4bit(B,
    state).to(grad_output.dtype)``: the weight in its original dtype (the model's: no second
    copy) beside the input's gradient; ``F.dequantize_4bit``'s float32 scales (4 ceil(n/64)) are
    freed when it returns, before the product (so at b*s*in*dtype < 4 ceil(n/64) bytes, a
    handful of tokens, the moment before it is larger by the difference).
    ``block``: weights per 8-bit scale (64)."""
    x = ins[0]
    out = _shapes(node, x)
    n = node.params[0].numel
    weight = n * x.dtype.nbytes
    scales = (8 if ctx.device == "cuda" else 4) * sp.ceiling(n / node.attr("block", 64))
    return Footprint(out, fwd_temp=scales + weight, grads=_grads(ins), bwd_temp=weight if x.requires_grad else 0)


#: a float16 tensor's dtype, as rules compare dtypes (by name: Ctx.same)
_F16 = DType("float16", sp.Integer(2), 2)


@rule("linear_int8")
def linear_int8_rule(node, ins, ctx):
    """``bnb.nn.Linear8bitLt`` (``has_fp16_weights=False``, transformers' ``llm_int8_threshold``
    6.0) in training. Where the input requires grad (else autograd records no node) ``ctx``
    keeps it (CPU: ``ctx.A``; CUDA: ``ctx.tensors = (None, subA, A)``, A its (N, in) view) as long
    as the autograd graph, through backward and, while the training loop holds the loss, the
    optimizer step (a ``ctx`` attribute: not released after the node's backward, unseen by
    checkpoints). N = b*s rows of in features, out outputs, n = out*in weights, D bytes per
    element of x (bitsandbytes/autograd/_functions.py, backends/cuda/ops.py, backends/default/ops.py).

    - CPU, ``MatMul8bitFp``: ``CB.to(A.dtype).mul_(SCB.unsqueeze(1).mul(1/127))``, the weight
      dequantized (n*D; its 4*out-byte scale is gone before the output is made), then
      ``F.linear``; backward the same copy (``CB.to(dtype, copy=True)``) beside the input's
      gradient.
    - CUDA, ``MatMul8bitLt``: ``int8_vectorwise_quant(A.to(float16), threshold)`` makes the
      float16 copy (2*N*in, none for a float16 input), the row scales (4N) and the int8 rows
      (N*in), and to find the outlier columns ``A.abs() >= threshold`` (2*N*in, then a bool
      N*in): h16 + 4N + 4*N*in at once, before the output exists. Then ``int8_mixed_scaled_mm``:
      the int32 product (4*N*out, cuBLASLt), dequantized to float16 (2*N*out) and cast to D (the
      output, N*out*D; no copy in float16), beside the int8 rows and scales: N*in + 4N + 4*N*out
      (+ 2*N*out) beside the output. ``fwd_temp`` is the larger of the two, seen from the moment
      the output exists. Backward: ``CB.to(D, copy=True).mul_(...)`` (n*D) beside the input's
      gradient. Outlier columns (k of them, data-dependent; none in a model without activations
      above 6) would add ``subA = A[:, idx]`` (N*k*D) to what ``ctx`` keeps and a dequantized
      out*k slice of the weight: not counted (k = 0). cuBLASLt needs in % 4 == 0 (a requirement;
      bitsandbytes otherwise multiplies in float32)."""
    x = ins[0]
    w = node.params[0]
    out = _shapes(node, x)
    weight = w.numel * x.dtype.nbytes
    saved = (Saved("input (ctx.A)", "in0", hooked=False, graph=True),) if x.requires_grad else ()
    if ctx.device == "cuda":
        rows = x.numel / x.shape[-1]
        half = not ctx.same(x.dtype, _F16)               # A.to(float16) copies, the output is cast back
        out_elems = out.numel
        quant = (2 * x.numel if half else 0) + 4 * rows + 4 * x.numel
        product = x.numel + 4 * rows + 4 * out_elems + (2 * out_elems if half else 0)
        scratch = sp.Max(sp.expand(quant - out_elems * x.dtype.nbytes), sp.expand(product))
        return Footprint(out, saved=saved, fwd_temp=scratch, grads=_grads(ins),
                         bwd_temp=weight if x.requires_grad else 0)
    return Footprint(out, saved=saved, fwd_temp=weight,
                     grads=_grads(ins), bwd_temp=weight if x.requires_grad else 0)
