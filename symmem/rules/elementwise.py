"""Elementwise ops: add, multiplication by a Python number, dropout, activations and
dtype conversions. None of them is on an autocast list except ``pow`` inside
``gelu_new`` (float32 on CUDA; see :mod:`symmem.rules.autocast`)."""
from __future__ import annotations

from dataclasses import replace

import sympy as sp

from ..errors import ShapeError
from .core import BOOL, F32, F64, Footprint, Saved, TensorInfo, _grads, _promote, rule

__all__ = ["add_rule", "mul_rule", "silu_rule", "scale_rule", "dropout_rule", "gelu_rule", "gelu_new_rule", "relu_rule",
           "clone_rule", "type_as_rule", "to_compute_rule", "to_param_dtype_rule", "to_float32_rule"]


def _broadcast(node, x: tuple, y: tuple) -> tuple:
    n = max(len(x), len(y))
    x = (1,) * (n - len(x)) + tuple(x)
    y = (1,) * (n - len(y)) + tuple(y)
    out = []
    for dx, dy in zip(x, y):
        if dx == 1:
            out.append(dy)
        elif dy == 1 or dx == dy:
            out.append(dx)
        else:
            raise ShapeError(node.name, (x, y), "shapes that broadcast")
    return tuple(sp.sympify(d) for d in out)


@rule("add")
def add_rule(node, ins, ctx):
    """``x + y`` saves nothing. Backward hands the gradient to both inputs; an input of
    another dtype or a broadcast shape gets its own converted/reduced gradient.
    ``inplace=True``: ``x.add_(y)``, written into x's storage (x must have the result's
    shape and dtype)."""
    x, y = ins
    shape = _broadcast(node, x.shape, y.shape)
    dt = _promote(x.dtype, y.dtype)
    out = TensorInfo(shape, dt, True, x.requires_grad or y.requires_grad)
    grads = tuple(None if not t.requires_grad else
                  ("pass" if tuple(t.shape) == shape and t.dtype == dt else "new") for t in ins)
    if node.attr("inplace"):
        if tuple(x.shape) != shape or x.dtype != dt:
            raise ShapeError(node.name, (x.shape, y.shape), "an in-place add into a tensor of the result's shape")
        return Footprint(replace(out, contiguous=x.contiguous), alias=0, grads=grads)
    return Footprint(out, grads=grads)


@rule("scale")
def scale_rule(node, ins, ctx):
    """``x * c`` for a Python number c: PyTorch wraps c in a 0-dim float64 tensor and
    MulBackward saves it: 8 bytes, in host memory (so 0 bytes on the GPU under CUDA).
    ``scalar="c++"``: ATen's ``mul.Scalar`` from C++ (SDPA's math kernel), which saves
    nothing. The output keeps x's layout (a transposed x gives a transposed output)."""
    x = ins[0]
    python = node.attr("scalar", "python") == "python"
    saved = (Saved("scalar", "new", sp.Integer(1), F64, hooked=False),) if python and ctx.device == "cpu" else ()
    return Footprint(TensorInfo(x.shape, x.dtype, x.contiguous, x.requires_grad), saved=saved, grads=_grads(ins))


@rule("mul")
def mul_rule(node, ins, ctx):
    """``x * y`` of two tensors (broadcasting): MulBackward0 saves y where x requires grad and
    x where y does (no new memory: references to the inputs). Each input's gradient is new
    (the output's gradient times the other), summed to the input's shape where it broadcast."""
    x, y = ins
    shape = _broadcast(node, x.shape, y.shape)
    saved = tuple(Saved(f"mul {'other' if i == 0 else 'self'}", f"in{1 - i}")
                  for i, t in enumerate(ins) if t.requires_grad)
    out = TensorInfo(shape, _promote(x.dtype, y.dtype), True, x.requires_grad or y.requires_grad)
    return Footprint(out, saved=saved, grads=_grads(ins))


@rule("silu")
def silu_rule(node, ins, ctx):
    """``F.silu(x)`` (Llama's ``hidden_act``) saves its input (SiluBackward0: self)."""
    x = ins[0]
    return Footprint(TensorInfo(x.shape, x.dtype, True, x.requires_grad),
                     saved=(Saved("silu input", "in0"),), grads=_grads(ins))


@rule("dropout")
def dropout_rule(node, ins, ctx):
    """``F.dropout(x, p)`` in training. p = 0 returns x itself (nothing saved).
    CUDA (``native_dropout``) saves a bool mask: 1 byte per element.
    CPU (``x * noise``, noise = bernoulli(1-p)/(1-p)) saves the noise in x's dtype."""
    x = ins[0]
    if node.attr("p", 0.0) == 0:
        return Footprint(x, alias=0, grads=_grads(ins, "pass"))
    if ctx.device == "cuda":
        saved = (Saved("dropout mask", "new", x.numel, BOOL, after=True),)
    else:
        saved = (Saved("dropout noise", "new", x.numel, x.dtype),)
    return Footprint(TensorInfo(x.shape, x.dtype, True, x.requires_grad), saved=saved, grads=_grads(ins))


@rule("gelu")
def gelu_rule(node, ins, ctx):
    """``F.gelu(x, approximate='none'|'tanh')`` saves its input (GeluBackward: self)."""
    x = ins[0]
    return Footprint(TensorInfo(x.shape, x.dtype, True, x.requires_grad),
                     saved=(Saved("gelu input", "in0"),), grads=_grads(ins))


@rule("gelu_new")
def gelu_new_rule(node, ins, ctx):
    """Hugging Face's ``NewGELUActivation`` (``gelu_new``), written in Python:
    ``0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x**3))))``.
    Autograd saves x (pow), tanh's result, ``0.5*x`` and ``1 + tanh`` (the final mul),
    plus three 0-dim float64 scalars on the CPU (24 bytes).
    The tanh branch runs in the dtype autocast gives ``pow.Tensor_Scalar`` (float32 on
    CUDA, where pow is on the fp32 list), else in x's dtype (CPU autocast leaves pow
    alone); the output is promoted to the wider of x's dtype and that branch's. Where pow
    runs in float32 on a half x, what it saves is its float32 copy of x, not x (measured
    on an H200 under CUDA autocast: 2 bytes per element more than saving x).
    Its largest moment is its end (the output beside the three saved tensors): each
    intermediate of the tanh branch is freed by the next op, so it has no scratch; when
    nothing is saved (recomputation), the tanh (and pow's float32 copy) is gone by then."""
    x = ins[0]
    t = ctx.autocast_dtype("pow.Tensor_Scalar")
    if t is None:
        t = x.dtype
    first = (Saved("gelu input (float32 copy)", "new", x.numel, t, brief=True) if not ctx.same(t, x.dtype)
             else Saved("gelu input", "in0"))
    saved = [first, Saved("tanh", "new", x.numel, t, brief=True),
             Saved("0.5*x", "new", x.numel, x.dtype), Saved("1+tanh", "new", x.numel, t)]
    if ctx.device == "cpu":
        saved.append(Saved("scalars", "new", sp.Integer(3), F64, hooked=False))
    out = TensorInfo(x.shape, _promote(x.dtype, t), True, x.requires_grad)
    return Footprint(out, saved=tuple(saved), grads=_grads(ins), bwd_temp=x.numel * t.nbytes)


@rule("relu")
def relu_rule(node, ins, ctx):
    """``F.relu(x)`` saves its output (ReluBackward: result)."""
    x = ins[0]
    return Footprint(TensorInfo(x.shape, x.dtype, True, x.requires_grad),
                     saved=(Saved("relu output", "out"),), grads=_grads(ins))


@rule("to_compute")
def to_compute_rule(node, ins, ctx):
    """``x.type(v.dtype)``: a copy into the compute dtype (in x's layout), or x itself when
    it has it."""
    x = ins[0]
    if ctx.same(x.dtype, ctx.act):
        return Footprint(x, alias=0, grads=_grads(ins, "pass"))
    return Footprint(TensorInfo(x.shape, ctx.act, x.contiguous, x.requires_grad), grads=_grads(ins))


@rule("type_as")
def type_as_rule(node, ins, ctx):
    """``x.type(y.dtype)``: a copy of x into y's dtype (in x's layout), or x itself when it
    has it. y is read for its dtype only: it gets no gradient from here. (Eager attention's
    ``attn_weights.type(value.dtype)``: bfloat16 under autocast, float32 where the value is.)"""
    x, y = ins[:2]
    if ctx.same(x.dtype, y.dtype):
        return Footprint(x, alias=0, grads=(_grads(ins[:1], "pass") + (None,)))
    return Footprint(TensorInfo(x.shape, y.dtype, x.contiguous, x.requires_grad), grads=_grads(ins[:1]) + (None,))


@rule("clone")
def clone_rule(node, ins, ctx):
    """``x.clone()``: a copy in x's dtype and layout; saves nothing, and backward hands the
    gradient on (CloneBackward0)."""
    x = ins[0]
    return Footprint(TensorInfo(x.shape, x.dtype, x.contiguous, x.requires_grad), grads=_grads(ins, "pass"))


@rule("to_param_dtype")
def to_param_dtype_rule(node, ins, ctx):
    """``x.to(weight.dtype)`` before an adapter (peft's ``_cast_input_dtype``): a copy into
    the parameters' dtype (float32 under autocast, where x is often bfloat16), in x's
    layout, or x itself when it has that dtype."""
    x = ins[0]
    if ctx.same(x.dtype, ctx.param_dtype):
        return Footprint(x, alias=0, grads=_grads(ins, "pass"))
    return Footprint(TensorInfo(x.shape, ctx.param_dtype, x.contiguous, x.requires_grad), grads=_grads(ins))


@rule("to_float32")
def to_float32_rule(node, ins, ctx):
    """``x.float()``: a float32 copy (in x's layout), or x itself when it is float32 already."""
    x = ins[0]
    if ctx.same(x.dtype, F32):
        return Footprint(x, alias=0, grads=_grads(ins, "pass"))
    return Footprint(TensorInfo(x.shape, F32, x.contiguous, x.requires_grad), grads=_grads(ins))
