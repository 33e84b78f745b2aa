"""Normalisation and softmax: layer_norm, rms_norm, softmax, log_softmax. On CUDA autocast runs
all three in float32 (``layer_norm``: fp32 list; ``softmax.int``, ``log_softmax.int``:
fp32_set_opt_dtype list); CPU autocast leaves them alone (see
:mod:`symmem.rules.autocast`)."""
from __future__ import annotations

from dataclasses import replace

from .core import F32, Footprint, Saved, TensorInfo, _grads, _promote, rule

__all__ = ["layer_norm_rule", "softmax_rule", "log_softmax_rule", "rms_norm_rule"]


@rule("layer_norm")
def layer_norm_rule(node, ins, ctx):
    """``F.layer_norm(x, (h,), w, b)``: NativeLayerNormBackward saves the input, the
    weight and bias (parameters) and the per-row mean and rstd: numel/h each.

    The op runs in the dtype autocast gives ``layer_norm``: float32 under CUDA autocast
    (a float32 copy of a half input is what is saved; the output is float32); CPU
    autocast leaves it alone (x itself is saved, the output has x's dtype). The
    statistics are a kernel matter, not a cast: CUDA keeps mean and rstd in float32
    whatever x's dtype; the CPU kernel keeps them in float32 when x and the weights
    differ in dtype (autocast: float32 weights) and in x's dtype otherwise (2 bytes each
    for a bfloat16 model; measured)."""
    x = ins[0]
    rows = x.numel / x.shape[-1]
    cast = ctx.autocast_dtype("layer_norm")
    saved = []
    if cast is not None and not ctx.same(x.dtype, cast):
        saved.append(Saved(f"layer-norm input ({cast.name} copy)", "new", x.numel, cast))
        out_dt = cast
    else:
        saved.append(Saved("layer-norm input", "in0"))
        out_dt = x.dtype if cast is None else cast
    stats = F32 if (ctx.device == "cuda" or ctx.autocast) else x.dtype
    saved += [Saved("layer-norm mean", "new", rows, stats, after=True),
              Saved("layer-norm rstd", "new", rows, stats, after=True)]
    return Footprint(TensorInfo(x.shape, out_dt), saved=tuple(saved), grads=_grads(ins))


def _softmax(ins, ctx, op: str, label: str) -> Footprint:
    """softmax and log_softmax save their output; they run in the dtype autocast gives
    ``op`` (fp32_set_opt_dtype: ``dtype=float32``, the input is not copied), else in x's."""
    x = ins[0]
    dt = ctx.autocast_dtype(op)
    if dt is None:
        dt = x.dtype
    return Footprint(TensorInfo(x.shape, dt, True, x.requires_grad),
                     saved=(Saved(label, "out"),), grads=_grads(ins))


@rule("softmax")
def softmax_rule(node, ins, ctx):
    """``F.softmax(x, -1)`` saves its output (SoftmaxBackward: result). CUDA autocast runs
    it in float32; CPU autocast leaves it in x's dtype. ``float32=True``: ``F.softmax(x, -1,
    dtype=torch.float32)`` (Llama's eager attention): x converted to float32 first (a copy
    freed when softmax returns), the output float32; for a half x backward makes x's gradient
    in float32 first and casts it (measured: a bfloat16 ViT). ``safe=True``: ATen's
    ``_safe_softmax`` (SDPA's math kernel), whose kernel also holds a bool ``isneginf`` of
    x's shape and a bool row flag while it runs (1 byte per element, ``attention.cpp``)."""
    if node.attr("float32"):      # F.softmax(x, dim, dtype=torch.float32): x converted first
        x = ins[0]
        half = not ctx.same(x.dtype, F32)
        # backward: the float32 gradient of the converted x, then its copy in x's dtype (the
        # node's new gradient): the float32 one is the larger, by numel * (4 - bytes of x)
        bwd = x.numel * (4 - x.dtype.nbytes) if half and x.requires_grad else 0
        return Footprint(TensorInfo(x.shape, F32, True, x.requires_grad), saved=(Saved("softmax output", "out"),),
                         fwd_temp=x.numel * 4 if half else 0, grads=_grads(ins), bwd_temp=bwd)
    fp = _softmax(ins, ctx, "softmax.int", "softmax output")
    if node.attr("safe"):
        x = ins[0]
        fp = replace(fp, fwd_temp=x.numel + x.numel / x.shape[-1])
    return fp


@rule("log_softmax")
def log_softmax_rule(node, ins, ctx):
    """``F.log_softmax(x, -1)`` saves its output. CUDA autocast runs it in float32; CPU
    autocast leaves it in x's dtype."""
    return _softmax(ins, ctx, "log_softmax.int", "log-softmax output")


@rule("rms_norm")
def rms_norm_rule(node, ins, ctx):
    """Llama's ``LlamaRMSNorm`` (transformers' ``modeling_llama.py``), written in Python::

        x32 = x.to(float32); var = x32.pow(2).mean(-1, keepdim=True)
        y = x32 * torch.rsqrt(var + eps); return weight * y.to(x.dtype)

    Autograd saves x32 (pow's and the product's input: x itself when it is float32, else
    a float32 copy), rsqrt's result (numel/h float32) and, where the weight trains, ``y`` in
    x's dtype (the product in float32, or its copy in x's dtype); the weight itself (a
    parameter). Where x does not require grad only the last is saved. None of these ops is
    on CPU autocast's lists; on CUDA pow and rsqrt are float32 ops, and their inputs are
    float32 already: the same tensors on both devices. The output is the weight's dtype
    promoted with x's (float32 under autocast). ``residual``: x also feeds a residual add
    (a decoder layer's norms), so it has a gradient when backward reaches the norm."""
    x = ins[0]
    w = node.params[0]
    rows = x.numel / x.shape[-1]
    half = not ctx.same(x.dtype, F32)
    saved = []
    if x.requires_grad:
        saved.append(Saved("rms-norm float32 input", "new", x.numel, F32, brief=True) if half
                     else Saved("rms-norm input", "in0"))
        saved.append(Saved("rms-norm rsqrt", "new", rows, F32))
    if w.trainable:
        saved.append(Saved("rms-norm normalized", "new", x.numel, x.dtype))
    if x.requires_grad:
        saved.append(Saved("rms-norm weight", "param:0"))
    out = TensorInfo(x.shape, _promote(ctx.param_dtype, x.dtype), True, x.requires_grad or w.trainable)
    # at the output: the local ``variance`` (numel/h float32) and, for a half x, the float32
    # product before its copy in x's dtype
    temp = 4 * rows + (4 * x.numel if half else 0)
    # backward's largest moment is pow's backward, grad * (2 * x32.pow(1)): four float32
    # tensors of x's size (mean's expanded gradient, pow, the * 2, the product) beside the
    # product's gradient for x32 (a fifth, unless x32 is x and x already has a gradient
    # from the residual add, ``residual=True``: then it joins that one at once), by when the
    # output's gradient, the saved y and rsqrt are gone and x's gradient is not yet made
    # (measured); with x needing no gradient, the weight's full-size gradient before its sum
    n = x.numel
    if x.requires_grad:
        joined = node.attr("residual", False) and not half
        bwd = ((16 if joined else 20) * n - n * out.dtype.nbytes - (n * x.dtype.nbytes if w.trainable else 0)
               - n * x.dtype.nbytes - 4 * rows)
    else:
        bwd = n * out.dtype.nbytes if w.trainable else 0
    # the weight's gradient is made first (MulBackward0, then summed to (h,)), before the rest
    return Footprint(out, saved=tuple(saved), fwd_temp=temp, grads=_grads(ins), bwd_temp=bwd)
