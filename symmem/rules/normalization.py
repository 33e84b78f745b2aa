"""Normalisation and softmax: layer_norm, softmax, log_softmax. On CUDA autocast runs
all three in float32 (``layer_norm``: fp32 list; ``softmax.int``, ``log_softmax.int``:
fp32_set_opt_dtype list); CPU autocast leaves them alone (see
:mod:`symmem.rules.autocast`)."""
from __future__ import annotations

from dataclasses import replace

from .core import F32, Footprint, Saved, TensorInfo, _grads, rule

__all__ = ["layer_norm_rule", "softmax_rule", "log_softmax_rule"]


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
    it in float32; CPU autocast leaves it in x's dtype. ``safe=True``: ATen's
    ``_safe_softmax`` (SDPA's math kernel), whose kernel also holds a bool ``isneginf`` of
    x's shape and a bool row flag while it runs (1 byte per element, ``attention.cpp``)."""
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
